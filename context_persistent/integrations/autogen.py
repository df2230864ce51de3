"""An AutoGen ``ChatCompletionContext`` whose messages live in the event log (``pip install
context-persistent[autogen]``).

:class:`PersistentChatCompletionContext` implements ``autogen_core.model_context.ChatCompletionContext``
(``add_message``, ``get_messages``, ``clear``, ``save_state``, ``load_state``). Every ``add_message`` returns once
the message is durable; a new process that opens the same ``session_id`` sees every acknowledged message.

``get_messages`` returns what the chosen strategy makes of the stored history:

- :class:`RequestView` (the default): the store's request view, valid for a provider (tool calls never split from
  their results) and fitted to a token budget (docs/compaction.md);
- :class:`Unbounded`, :class:`Buffered`, :class:`HeadAndTail`: the same results as AutoGen's
  ``UnboundedChatCompletionContext``, ``BufferedChatCompletionContext`` and
  ``HeadAndTailChatCompletionContext`` on the same messages.

Message mapping (exact both ways: ``get_messages`` with :class:`Unbounded` returns messages equal to the ones
added). Each AutoGen message becomes a chat message of the store; what the store's format has no field for is
kept under the message's ``"autogen"`` key:

=====================================  ==============================================================
AutoGen                                stored as
=====================================  ==============================================================
``SystemMessage``                      ``{"role": "system", "content": text}``
``UserMessage`` (text)                 ``{"role": "user", "content": text, "autogen": {"source"}}``
``UserMessage`` (list of text/Image)   content blocks ``{"type": "text"}`` / ``{"type": "image_url"}``
                                       (the image as a ``data:image/png;base64`` URL)
``AssistantMessage`` (text)            ``{"role": "assistant", "content": text}``; ``source`` and
                                       ``thought`` under ``"autogen"``
``AssistantMessage`` (FunctionCalls)   ``{"role": "assistant", "content": null, "tool_calls": [...]}``
``FunctionExecutionResultMessage``     one ``{"role": "tool", "tool_call_id", "content"}`` message per
                                       result (so compaction keeps each result with its call); ``name``,
                                       ``is_error`` and the result's place in its message under
                                       ``"autogen"``
=====================================  ==============================================================

A request view can hold notes the store wrote (the "messages left out" marker, a summary); they come back as
``UserMessage(source="context-persistent")``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

try:
    from autogen_core import Component, FunctionCall, Image
    from autogen_core.model_context import ChatCompletionContext
    from autogen_core.model_context._chat_completion_context import ChatCompletionContextState
    from autogen_core.models import (
        AssistantMessage,
        FunctionExecutionResult,
        FunctionExecutionResultMessage,
        LLMMessage,
        SystemMessage,
        UserMessage,
    )
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "context_persistent.integrations.autogen needs autogen-core: pip install 'context-persistent[autogen]'"
    ) from e

from pydantic import BaseModel

from ..store.manager import PersistentContextManager

__all__ = [
    "Buffered",
    "HeadAndTail",
    "PersistentChatCompletionContext",
    "RequestView",
    "Unbounded",
    "from_stored",
    "to_stored",
]

#: ``source`` of the notes the store itself puts in a request view.
NOTE_SOURCE = "context-persistent"
_DATA_URI_PREFIX = "data:image/png;base64,"


# -- strategies ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestView:
    """The store's request view for ``token_budget`` (None: the store's ``max_tokens``)."""

    token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.token_budget is not None and (isinstance(self.token_budget, bool)
                                              or not isinstance(self.token_budget, int) or self.token_budget <= 0):
            raise ValueError(f"token_budget must be a positive int or None, got {self.token_budget!r}")


@dataclass(frozen=True)
class Unbounded:
    """Every message (AutoGen's ``UnboundedChatCompletionContext``)."""


@dataclass(frozen=True)
class Buffered:
    """The last ``buffer_size`` messages, without a leading function result (``BufferedChatCompletionContext``)."""

    buffer_size: int

    def __post_init__(self) -> None:
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size <= 0:
            raise ValueError(f"buffer_size must be an int greater than 0, got {self.buffer_size!r}")


@dataclass(frozen=True)
class HeadAndTail:
    """The first ``head_size`` and last ``tail_size`` messages with a note between
    (``HeadAndTailChatCompletionContext``)."""

    head_size: int
    tail_size: int

    def __post_init__(self) -> None:
        for name in ("head_size", "tail_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an int greater than 0, got {value!r}")


Strategy = Union[RequestView, Unbounded, Buffered, HeadAndTail]


def _buffered(messages: list[LLMMessage], buffer_size: int) -> list[LLMMessage]:
    out = messages[-buffer_size:]
    if out and isinstance(out[0], FunctionExecutionResultMessage):
        out = out[1:]
    return out


def _head_and_tail(messages: list[LLMMessage], head_size: int, tail_size: int) -> list[LLMMessage]:
    skipped = len(messages) - head_size - tail_size
    if skipped <= 0:
        return list(messages)
    head = messages[:head_size]
    last = head[-1] if head else None
    if (isinstance(last, AssistantMessage) and isinstance(last.content, list)
            and all(isinstance(item, FunctionCall) for item in last.content)):
        head = head[:-1]
    tail = messages[-tail_size:]
    if tail and isinstance(tail[0], FunctionExecutionResultMessage):
        tail = tail[1:]
    return [*head, UserMessage(content=f"Skipped {skipped} messages.", source="System"), *tail]


# -- mapping ---------------------------------------------------------------------------------------------------
def to_stored(message: LLMMessage) -> list[dict[str, Any]]:
    """The store's messages for one AutoGen message (one, or one per result of a function-result message)."""
    if isinstance(message, SystemMessage):
        return [{"role": "system", "content": message.content}]
    if isinstance(message, UserMessage):
        meta: dict[str, Any] = {"source": message.source}
        if isinstance(message.content, str):
            return [{"role": "user", "content": message.content, "autogen": meta}]
        blocks: list[dict[str, Any]] = []
        for item in message.content:
            if isinstance(item, str):
                blocks.append({"type": "text", "text": item})
            elif isinstance(item, Image):
                blocks.append({"type": "image_url", "image_url": {"url": _DATA_URI_PREFIX + item.to_base64()}})
            else:
                raise ValueError(f"UserMessage content items must be str or autogen_core.Image, got "
                                 f"{type(item).__name__}")
        return [{"role": "user", "content": blocks, "autogen": meta}]
    if isinstance(message, AssistantMessage):
        meta = {"source": message.source}
        if message.thought is not None:
            meta["thought"] = message.thought
        if isinstance(message.content, str):
            return [{"role": "assistant", "content": message.content, "autogen": meta}]
        calls = []
        for call in message.content:
            if not isinstance(call, FunctionCall):
                raise ValueError(f"AssistantMessage content must be str or a list of FunctionCall, got an item of "
                                 f"type {type(call).__name__}")
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}})
        return [{"role": "assistant", "content": None, "tool_calls": calls, "autogen": meta}]
    if isinstance(message, FunctionExecutionResultMessage):
        results = message.content
        if not results:
            return [{"role": "tool", "content": "", "autogen": {"part": 0, "parts": 0}}]
        out = []
        for i, result in enumerate(results):
            meta = {"name": result.name, "part": i, "parts": len(results)}
            if result.is_error is not None:
                meta["is_error"] = result.is_error
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": result.content, "autogen": meta})
        return out
    raise ValueError(f"not an AutoGen LLMMessage: {type(message).__name__} (allowed: SystemMessage, UserMessage, "
                     "AssistantMessage, FunctionExecutionResultMessage)")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # text blocks (a message another host wrote)
        parts = []
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            else:
                raise ValueError(f"{where}: content block {block!r} has no text; cannot map it to AutoGen")
        return "".join(parts)
    raise ValueError(f"{where}: content of type {type(content).__name__} cannot be mapped to AutoGen")


def _user_content(content: Any, where: str) -> str | list[str | Image]:
    if not isinstance(content, list):
        return _text(content, where)
    items: list[str | Image] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            items.append(block["text"])
        elif kind == "image_url":
            url = (block.get("image_url") or {}).get("url", "")
            if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
                raise ValueError(f"{where}: only data: image URLs can be mapped to autogen_core.Image, got "
                                 f"{str(url)[:60]!r}")
            items.append(Image.from_base64(url.split(";base64,", 1)[1]))
        else:
            raise ValueError(f"{where}: content block {block!r} cannot be mapped to AutoGen (text or image_url)")
    return items


def from_stored(messages: Sequence[Mapping[str, Any]]) -> list[LLMMessage]:
    """AutoGen messages for a list of the store's messages (inverse of :func:`to_stored`).

    Consecutive tool messages that were one ``FunctionExecutionResultMessage`` become one again; messages that no
    AutoGen message wrote (a request view's notes, another host's messages) map by role.
    """
    out: list[LLMMessage | list[FunctionExecutionResult]] = []  # a list: the results of one message
    group: list[FunctionExecutionResult] | None = None
    expected_part = 0
    for i, m in enumerate(messages):
        where = f"message {i}"
        role = m.get("role")
        meta = m.get("autogen") or {}
        if role == "tool":
            part, parts = meta.get("part", 0), meta.get("parts", 1)
            if parts == 0:
                out.append([])
                group = None
                continue
            result = FunctionExecutionResult(content=_text(m.get("content"), where), name=meta.get("name", ""),
                                             call_id=m.get("tool_call_id") or "", is_error=meta.get("is_error"))
            if group is not None and part == expected_part and part > 0:
                group.append(result)
            else:
                group = [result]
                out.append(group)
            expected_part = part + 1
            if expected_part >= parts:
                group = None
            continue
        group = None
        if role in ("system", "developer"):
            out.append(SystemMessage(content=_text(m.get("content"), where)))
        elif role == "user":
            source = meta.get("source", NOTE_SOURCE)
            out.append(UserMessage(content=_user_content(m.get("content"), where), source=source))
        elif role == "assistant":
            source = meta.get("source", "assistant")
            thought = meta.get("thought")
            if m.get("tool_calls") is not None:
                calls = [FunctionCall(id=c.get("id") or "", name=c["function"]["name"],
                                      arguments=c["function"]["arguments"]) for c in m["tool_calls"]]
                out.append(AssistantMessage(content=calls, thought=thought, source=source))
            else:
                out.append(AssistantMessage(content=_text(m.get("content"), where), thought=thought, source=source))
        else:
            raise ValueError(f"{where}: role {role!r} cannot be mapped to an AutoGen message")
    return [FunctionExecutionResultMessage(content=item) if isinstance(item, list) else item for item in out]


# -- the context -------------------------------------------------------------------------------------------------
class PersistentChatCompletionContextConfig(BaseModel):
    """The declarative configuration (``dump_component`` / ``load_component``): where the session is, not what
    it holds."""

    storage_path: str
    session_id: str
    strategy: dict[str, Any] = {"kind": "request_view"}
    store_config: dict[str, Any] = {}
    initial_messages: list[LLMMessage] | None = None


def _strategy_to_config(strategy: Strategy) -> dict[str, Any]:
    if isinstance(strategy, RequestView):
        return {"kind": "request_view", "token_budget": strategy.token_budget}
    if isinstance(strategy, Buffered):
        return {"kind": "buffered", "buffer_size": strategy.buffer_size}
    if isinstance(strategy, HeadAndTail):
        return {"kind": "head_and_tail", "head_size": strategy.head_size, "tail_size": strategy.tail_size}
    return {"kind": "unbounded"}


def _strategy_from_config(config: Mapping[str, Any]) -> Strategy:
    kinds: dict[str, Any] = {"request_view": RequestView, "unbounded": Unbounded, "buffered": Buffered,
                             "head_and_tail": HeadAndTail}
    args = dict(config)
    kind = args.pop("kind", None)
    if kind not in kinds:
        raise ValueError(f"strategy kind must be one of {', '.join(kinds)}; got {kind!r}")
    return kinds[kind](**args)  # type: ignore[no-any-return]


def _stamp(store: PersistentContextManager, added: int = 0) -> tuple[int, int]:
    """What the history's state is known by: the head seq (``added`` to it), and the store's epoch, which an
    erase moves although the head seq stays (its tombstones take the erased records' places)."""
    return store.head_seq + added, store._epoch


class PersistentChatCompletionContext(ChatCompletionContext, Component[PersistentChatCompletionContextConfig]):
    """A ``ChatCompletionContext`` backed by one session of the store.

    Give either ``storage_path`` and ``session_id`` (the store opens on first use, with ``store_config`` as
    :meth:`PersistentContextManager.open` keywords; :meth:`close` closes it) or an open ``store`` (the caller
    closes it). ``initial_messages`` are added only to a new session (one whose log holds no event yet), so a
    resumed process does not add them again, not even after a ``clear``.
    """

    component_type = "chat_completion_context"
    component_config_schema = PersistentChatCompletionContextConfig
    component_provider_override = "context_persistent.integrations.autogen.PersistentChatCompletionContext"

    def __init__(self, storage_path: str | os.PathLike[str] | None = None, session_id: str | None = None, *,
                 store: PersistentContextManager | None = None, strategy: Strategy | None = None,
                 initial_messages: list[LLMMessage] | None = None, **store_config: Any) -> None:
        super().__init__(None)
        if store is None and (storage_path is None or session_id is None):
            raise ValueError("give storage_path and session_id, or an open store")
        if store is not None and (storage_path is not None or session_id is not None or store_config):
            raise ValueError("give either an open store or storage_path/session_id/store config, not both")
        strategy = RequestView() if strategy is None else strategy
        if not isinstance(strategy, (RequestView, Unbounded, Buffered, HeadAndTail)):
            raise ValueError(f"strategy must be RequestView, Unbounded, Buffered or HeadAndTail, got {strategy!r}")
        if store_config:
            PersistentContextManager.check_config(dict(store_config))  # a bad key fails here, not at first use
        self.strategy: Strategy = strategy
        self._store = store
        self._owns_store = store is None
        self._open_args = (Path(storage_path) if storage_path is not None else None, session_id, store_config)
        self._initial = list(initial_messages) if initial_messages is not None else None
        self._pending_initial = list(initial_messages or [])
        self._open_lock: asyncio.Lock | None = None
        #: The full history as AutoGen messages, kept in step with the store (rebuilt from it when it changed
        #: behind our back); None until first needed.
        self._mirror: list[LLMMessage] | None = None
        self._mirror_seq: tuple[int, int] = (-1, -1)

    def _to_config(self) -> PersistentChatCompletionContextConfig:
        path, session_id, config = self._open_args
        if path is None or session_id is None:
            raise ValueError("a context built on an open store has no declarative form; build it from "
                             "storage_path and session_id to dump it")
        return PersistentChatCompletionContextConfig(
            storage_path=str(path), session_id=session_id, strategy=_strategy_to_config(self.strategy),
            store_config=dict(config), initial_messages=self._initial)

    @classmethod
    def _from_config(cls, config: PersistentChatCompletionContextConfig) -> "PersistentChatCompletionContext":
        return cls(config.storage_path, config.session_id, strategy=_strategy_from_config(config.strategy),
                   initial_messages=config.initial_messages, **config.store_config)

    # -- the store ---------------------------------------------------------------------------------------------
    async def store(self) -> PersistentContextManager:
        """The open store (opened on first call)."""
        if self._store is not None:
            return self._store
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._store is None:
                path, session_id, config = self._open_args
                assert path is not None and session_id is not None
                config = {"recognise_replay": False, **config}
                self._store = await PersistentContextManager.open(storage_path=path, session_id=session_id,
                                                                  **config)
        store = self._store
        if self._pending_initial:
            initial, self._pending_initial = self._pending_initial, []
            if store.head_seq <= 1:  # nothing but session_started: a new session (not merely an empty one)
                for message in initial:
                    await self._add(store, message)
        return store

    async def record_usage(self, result: Any, *, provider: str | None = None, model: str | None = None) -> int:
        """Record what the model reported: ``result`` is a ``CreateResult`` (what a model client's ``create``
        returns), a ``RequestUsage``, or an agent's ``Response``/``TaskResult`` (its messages' ``models_usage``).
        Returns the number of reports written (docs/integrations.md, "Usage")."""
        from .usage_of import autogen_reports

        store = await self.store()
        done = 0
        for usage, kw in autogen_reports(result):
            done += await store.record_usage(usage, provider=provider, model=model, source="autogen", **kw) is not None
        return done

    async def close(self) -> None:
        """Close the store if this context opened it."""
        if self._store is not None and self._owns_store:
            await self._store.close()
            self._store = None
            self._mirror = None

    async def __aenter__(self) -> "PersistentChatCompletionContext":
        await self.store()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _add(self, store: PersistentContextManager, message: LLMMessage) -> None:
        stored = to_stored(message)
        await store.add_messages(stored)  # (each part validated before the first is written: all or none)
        if self._mirror is not None and self._mirror_seq == _stamp(store, -len(stored)):
            self._mirror.append(message.model_copy(deep=True))
            self._mirror_seq = _stamp(store)

    async def _history(self) -> list[LLMMessage]:
        store = await self.store()
        if self._mirror is None or self._mirror_seq != _stamp(store):
            self._mirror = from_stored(await store.get_messages())
            self._mirror_seq = _stamp(store)
        return self._mirror

    # -- ChatCompletionContext ---------------------------------------------------------------------------------
    async def add_message(self, message: LLMMessage) -> None:
        """Append a message; returns once it is durable. ValueError (nothing stored) if it cannot be stored."""
        store = await self.store()
        to_stored(message)  # validate before the first write
        await self._add(store, message)

    async def get_messages(self) -> list[LLMMessage]:
        """The messages for the next model call, as the strategy selects them (new objects on every call)."""
        strategy = self.strategy
        if isinstance(strategy, RequestView):
            store = await self.store()
            return from_stored(await store.get_messages_for_request(token_budget=strategy.token_budget))
        history = await self._history()
        if isinstance(strategy, Buffered):
            selected = _buffered(history, strategy.buffer_size)
        elif isinstance(strategy, HeadAndTail):
            selected = _head_and_tail(history, strategy.head_size, strategy.tail_size)
        else:
            selected = list(history)
        return [m.model_copy(deep=True) for m in selected]

    async def clear(self) -> None:
        """Empty the context: a ``cleared`` event (the log keeps what came before)."""
        store = await self.store()
        await store.clear()

    async def save_state(self) -> Mapping[str, Any]:
        """The full history in AutoGen's ``ChatCompletionContextState`` form (loadable by any context)."""
        return ChatCompletionContextState(messages=list(await self._history())).model_dump()

    async def load_state(self, state: Mapping[str, Any]) -> None:
        """Make the history the state's messages: one ``messages_replaced`` event, written only when they differ
        from the stored history (loading the state of this same session writes nothing)."""
        messages = ChatCompletionContextState.model_validate(state).messages
        store = await self.store()
        stored = [m for message in messages for m in to_stored(message)]
        if stored == await store.get_messages():
            return
        await store.replace_messages(stored)
