"""Message history that survives restarts for Pydantic AI agents: :class:`PersistentMessageHistory`.

Pydantic AI (``pip install 'context-persistent[pydantic-ai]'``) keeps no history between runs: a caller passes
``message_history=`` to ``agent.run`` and keeps ``result.new_messages()`` itself. This class keeps them in a
session of the store: ``await history.append(result.new_messages())`` stores each ``ModelMessage`` as one
``message_added`` event, durable when it returns, and ``await history.load()`` gives them back, as
``ModelMessagesTypeAdapter`` read them, after any restart or crash, with the history processors applied.

Each stored message keeps the ``ModelMessage`` whole under ``"pydantic_ai"`` (``ModelMessagesTypeAdapter``'s
JSON form: parts, timestamps, tool call ids, usage, provider details, binary content as base64) and adds a
``role`` and readable ``content`` for the store's own views and the CLI: a ``ModelRequest`` is a ``user``
message (its prompts, tool returns and retry prompts as text), a ``ModelResponse`` an ``assistant`` one (its
text, thinking and tool calls as text).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

try:
    from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelRequest, ModelResponse
except ImportError as e:  # pragma: no cover - exercised by a test in a process without Pydantic AI
    raise ImportError("context_persistent.integrations.pydantic_ai needs Pydantic AI: "
                      "pip install 'context-persistent[pydantic-ai]'") from e

from ..store.manager import PersistentContextManager
from ..storage.paths import validate_session_id
from ._loop import LoopThread

__all__ = ["KEY", "PersistentMessageHistory", "message_from_model", "model_from_message"]

T = TypeVar("T")

#: The key under which a stored message holds its ``ModelMessage`` (ModelMessagesTypeAdapter's JSON form).
KEY = "pydantic_ai"

#: A history processor as Pydantic AI's ``history_processors`` takes it, without a ``RunContext``.
Processor = Callable[[list[ModelMessage]], "list[ModelMessage] | Awaitable[list[ModelMessage]]"]


def _part_text(part: Any) -> str:
    kind = getattr(part, "part_kind", "")
    if kind in ("system-prompt", "text", "thinking"):
        return f"[{kind}] {part.content}" if kind != "text" else str(part.content)
    if kind == "user-prompt":
        return part.content if isinstance(part.content, str) else " ".join(
            c if isinstance(c, str) else f"[{type(c).__name__}]" for c in part.content)
    if kind == "tool-call":
        return f"→ {part.tool_name}({part.args_as_json_str()}) [{part.tool_call_id}]"
    if kind == "tool-return":
        return f"← {part.tool_name} [{part.tool_call_id}]: {part.model_response_str()}"
    if kind == "retry-prompt":
        return f"[retry] {part.model_response()}"
    return f"[{kind or type(part).__name__}]"


def message_from_model(message: ModelMessage) -> dict[str, Any]:
    """The stored form of one ``ModelMessage`` (see the module docstring)."""
    if not isinstance(message, (ModelRequest, ModelResponse)):
        raise ValueError(f"a message must be a pydantic_ai ModelRequest or ModelResponse, got "
                         f"{type(message).__name__}")
    [dumped] = ModelMessagesTypeAdapter.dump_python([message], mode="json")
    role = "user" if isinstance(message, ModelRequest) else "assistant"
    return {"role": role, "content": "\n".join(_part_text(p) for p in message.parts), KEY: dumped}


def model_from_message(stored: dict[str, Any], where: str = "message") -> ModelMessage:
    """The ``ModelMessage`` a stored message holds; ValueError if it holds none (another host's message)."""
    if KEY not in stored:
        raise ValueError(f"{where} was not stored by PersistentMessageHistory (no {KEY!r} key): role "
                         f"{stored.get('role')!r}; a Pydantic AI history holds only Pydantic AI messages")
    [message] = ModelMessagesTypeAdapter.validate_python([stored[KEY]])
    return message


class PersistentMessageHistory:
    """The message history of one Pydantic AI conversation, in ``<storage_path>/<session_id>/events.jsonl``.

    ``PersistentMessageHistory(storage_path, session_id, *, history_processors=(), **config)``: ``config``
    takes the store's keys (docs/configuration.md). ``history_processors`` are functions of the message list
    (sync or async, as Pydantic AI's without a ``RunContext``), applied in order by :meth:`load`; what is stored
    is never changed by them. The store opens on the first call; close with ``close()``/``aclose()`` or
    ``async with``.
    """

    def __init__(self, storage_path: str | os.PathLike[str], session_id: str, *,
                 history_processors: Sequence[Processor] = (), **config: Any) -> None:
        validate_session_id(session_id)
        config.setdefault("recognise_replay", False)  # (a history is appended as given, never a replay)
        PersistentContextManager.check_config(dict(config))
        for p in history_processors:
            if not callable(p):
                raise ValueError(f"history_processors must be functions of the message list, got {p!r}")
            if len(inspect.signature(p).parameters) != 1:
                raise ValueError(f"history processor {getattr(p, '__name__', p)!r} takes a RunContext: only "
                                 "processors of the message list alone can run outside an agent run")
        self.storage_path = Path(storage_path).expanduser()
        self.session_id = session_id
        self.history_processors = list(history_processors)
        self._config = config
        self._store: PersistentContextManager | None = None
        self._loop = LoopThread(f"context-persistent Pydantic AI history {session_id}")

    async def _call(self, fn: Callable[[PersistentContextManager], Awaitable[T]]) -> T:
        async def job() -> T:
            if self._store is None:
                self._store = await PersistentContextManager.open(storage_path=self.storage_path,
                                                                  session_id=self.session_id, **self._config)
            return await fn(self._store)

        return await self._loop.call(job)

    async def append(self, messages: Sequence[ModelMessage]) -> None:
        """Store ``messages`` (e.g. ``result.new_messages()``) after the history; returns once they are durable.

        A message that is not a ``ModelMessage`` (ValueError) means none of them is stored.
        """
        stored = [message_from_model(m) for m in messages]
        if stored:
            await self._call(lambda store: store.add_messages(stored))

    async def load(self, *, raw: bool = False) -> list[ModelMessage]:
        """The whole history as ``ModelMessage``s, with the history processors applied (``raw``: without)."""
        stored = await self._call(lambda store: store.get_messages())
        messages = [model_from_message(m, f"stored message {i}") for i, m in enumerate(stored)]
        if raw:
            return messages
        for processor in self.history_processors:
            out = processor(messages)
            messages = await out if inspect.isawaitable(out) else out  # type: ignore[assignment]
        return messages

    async def clear(self) -> None:
        """Empty the history (a ``cleared`` event; the log keeps what was there)."""
        await self._call(lambda store: store.clear())

    async def run(self, fn: Callable[[PersistentContextManager], Awaitable[T]]) -> T:
        """``await fn(store)`` with the underlying store, on its thread (its views, ``stats()``, ``export``)."""
        return await self._call(fn)

    def close(self) -> None:
        """Flush and release the session (idempotent)."""
        async def final() -> None:
            if self._store is not None:
                await self._store.close()

        self._loop.close(final)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "PersistentMessageHistory":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<PersistentMessageHistory {self.session_id!r} storage={str(self.storage_path)!r}>"
