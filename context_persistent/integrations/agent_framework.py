"""A Microsoft Agent Framework history provider whose messages live in the event log (``pip install
context-persistent[agent-framework]``).

:class:`PersistentHistoryProvider` is an ``agent_framework.HistoryProvider``: put it in an agent's
``context_providers`` and every run's input and response messages are appended to the session's log, each
``save_messages`` returning once they are durable. One store session per Agent Framework session id, opened on
first use and held (with its writer lock) until :meth:`PersistentHistoryProvider.aclose`.

Messages are stored losslessly: each is kept as its ``Message.to_dict()`` (every content type: text, reasoning,
function calls and results, approvals, hosted tool calls, data and URIs, annotations, ``additional_properties``,
NaN, infinities and integers beyond 64 bits included) under the stored message's ``"agent_framework"`` key,
next to a ``role`` and the message's text as ``content`` for the store's own views and tools
(``context-persistent show``). Only ``raw_representation``, which ``to_dict`` leaves out, is not kept.

Compaction, as Agent Framework designs it (annotations on the messages, never a deletion):

- ``CompactionProvider(before_strategy=...)`` compacts the loaded history before each model call, unchanged;
- :meth:`PersistentHistoryProvider.compact_storage` runs any ``CompactionStrategy`` on the stored history and
  records the result (exclusion annotations, inserted summaries) as one ``messages_replaced`` event; the
  messages before it stay in the log; ``compaction_strategy=`` does this after every run;
- ``skip_excluded=True`` loads only the messages the last compaction kept.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

try:
    from agent_framework import HistoryProvider, Message
    from agent_framework._compaction import annotate_message_groups, annotate_token_counts
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "context_persistent.integrations.agent_framework needs agent-framework-core: "
        "pip install 'context-persistent[agent-framework]'"
    ) from e

from ..errors import ConcurrencyError
from ..model.events import ROLES
from ..store.manager import PersistentContextManager
from ..storage.paths import MAX_SESSION_ID, make_private_dirs, validate_session_id
from ..storage.segments import has_log

__all__ = ["PersistentHistoryProvider", "decode_message", "encode_message", "store_session_id"]

_KEY = "agent_framework"
_TAG = "$cp"  # marks a value the log cannot hold (non-finite float, integer beyond 64 bits) or a dict using this key
_ENCODED_PREFIX = "af="
_ROLE_SET = frozenset(ROLES)
#: Runs of the strategy ``compact_storage`` makes when the history keeps changing under it, before it gives up.
COMPACT_ATTEMPTS = 3


# -- values JSON cannot hold ------------------------------------------------------------------------------------
def _encode_value(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return {_TAG: "int", "v": str(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return {_TAG: "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, dict):
        encoded = {k: _encode_value(v) for k, v in value.items()}
        return {_TAG: "dict", "v": encoded} if _TAG in value else encoded
    if isinstance(value, (list, tuple)):
        return [_encode_value(v) for v in value]
    return value


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag is None:
            return {k: _decode_value(v) for k, v in value.items()}
        if tag == "float":
            return float(value["v"])
        if tag == "int":
            return int(value["v"])
        if tag == "dict":
            return {k: _decode_value(v) for k, v in value["v"].items()}
        raise ValueError(f"unknown {_TAG} tag {tag!r} in a stored Agent Framework message")
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


# -- messages ---------------------------------------------------------------------------------------------------
def encode_message(message: Message) -> dict[str, Any]:
    """The store's message for an Agent Framework ``Message`` (ValueError if it holds non-JSON values)."""
    if not isinstance(message, Message):
        raise ValueError(f"expected an agent_framework.Message, got {type(message).__name__}")
    role = str(message.role)
    return {"role": role if role in _ROLE_SET else "user", "content": message.text,
            _KEY: _encode_value(message.to_dict())}


def decode_message(stored: dict[str, Any], where: str = "message") -> Message:
    """The Agent Framework ``Message`` a stored message holds (a plain chat message another host wrote maps to a
    text message; anything else is a ValueError naming it)."""
    payload = stored.get(_KEY)
    if payload is not None:
        return Message.from_dict(_decode_value(payload))
    content = stored.get("content")
    if isinstance(content, str):
        return Message(role=stored["role"], contents=[content] if content else [])
    raise ValueError(f"{where} was not written by the Agent Framework adapter and its content is not text: "
                     f"{str(stored)[:120]}")


def store_session_id(session_id: str | None) -> str:
    """The store's session id for an Agent Framework session id (None: ``default``).

    An id the store accepts as a folder name is used as it is; any other (and any starting with ``af=``) is
    ``af=`` + its UTF-8 in unpadded base32, so two different ids never share a session.
    """
    if session_id is None:
        return "default"
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string or None, got {session_id!r}")
    if not session_id.startswith(_ENCODED_PREFIX):
        try:
            return validate_session_id(session_id)
        except ValueError:
            pass
    encoded = _ENCODED_PREFIX + base64.b32encode(session_id.encode("utf-8")).decode("ascii").rstrip("=")
    if len(encoded) > MAX_SESSION_ID:
        raise ValueError(f"session_id {session_id[:40]!r}… is too long for the store once encoded "
                         f"({len(encoded)} > {MAX_SESSION_ID} characters)")
    return encoded


# -- the provider -----------------------------------------------------------------------------------------------
class PersistentHistoryProvider(HistoryProvider):
    """An Agent Framework ``HistoryProvider`` that keeps each session's messages in the store.

    ``storage_path`` is the store's root folder (created 0700); ``store_config`` are
    :meth:`PersistentContextManager.open` keywords (``fsync``, ``backend``, ``dsn``, ...). The flags are
    ``HistoryProvider``'s; ``skip_excluded`` as in Agent Framework's own providers; ``compaction_strategy``
    (with an optional ``compaction_tokenizer``) compacts the stored history after every run
    (:meth:`compact_storage`).
    """

    DEFAULT_SOURCE_ID: ClassVar[str] = "context_persistent"

    def __init__(
        self,
        storage_path: str | os.PathLike[str],
        *,
        source_id: str | None = None,
        load_messages: bool = True,
        store_inputs: bool = True,
        store_context_messages: bool = False,
        store_context_from: set[str] | None = None,
        store_outputs: bool = True,
        skip_excluded: bool = False,
        compaction_strategy: Any = None,
        compaction_tokenizer: Any = None,
        **store_config: Any,
    ) -> None:
        super().__init__(
            source_id=source_id or self.DEFAULT_SOURCE_ID,
            load_messages=load_messages,
            store_inputs=store_inputs,
            store_context_messages=store_context_messages,
            store_context_from=store_context_from,
            store_outputs=store_outputs,
        )
        self.store_config = {"recognise_replay": False, **store_config}
        PersistentContextManager.check_config(dict(self.store_config))  # a bad key fails here, not at first use
        self.storage_path = Path(storage_path).expanduser()
        if self.store_config.get("backend", "file") == "file" and self.store_config.get("dsn") is None:
            make_private_dirs(self.storage_path)
        self.skip_excluded = skip_excluded
        self.compaction_strategy = compaction_strategy
        self.compaction_tokenizer = compaction_tokenizer
        self._stores: dict[str, PersistentContextManager] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- stores ------------------------------------------------------------------------------------------------
    def _is_file_backend(self) -> bool:
        return self.store_config.get("backend", "file") == "file" and self.store_config.get("dsn") is None

    async def store(self, session_id: str | None, *, create: bool = True) -> PersistentContextManager | None:
        """The open store of a session (opened on first use; None if ``create`` is false and it has no log)."""
        sid = store_session_id(session_id)
        store = self._stores.get(sid)
        if store is not None:
            return store
        if not create and self._is_file_backend() and not has_log(self.storage_path / sid):
            return None
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            store = self._stores.get(sid)
            if store is None:
                store = await PersistentContextManager.open(storage_path=self.storage_path, session_id=sid,
                                                            **self.store_config)
                self._stores[sid] = store
        return store

    async def close_session(self, session_id: str | None) -> None:
        """Close one session's store (releasing its writer lock); it reopens on next use."""
        store = self._stores.pop(store_session_id(session_id), None)
        if store is not None:
            await store.close()

    async def aclose(self) -> None:
        """Close every store this provider opened (releasing their writer locks)."""
        stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            await store.close()

    close = aclose

    async def __aenter__(self) -> "PersistentHistoryProvider":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- HistoryProvider ---------------------------------------------------------------------------------------
    async def get_messages(self, session_id: str | None, *, state: dict[str, Any] | None = None,
                           **kwargs: Any) -> list[Message]:
        """The session's stored messages (without excluded ones when ``skip_excluded``)."""
        store = await self.store(session_id, create=False)
        if store is None:
            return []
        stored = await store.get_messages()
        messages = [decode_message(m, f"message {i} of session {store.session_id!r}") for i, m in enumerate(stored)]
        if self.skip_excluded:
            messages = [m for m in messages if not m.additional_properties.get("_excluded", False)]
        return messages

    async def save_messages(self, session_id: str | None, messages: Sequence[Message], *,
                            state: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Append the messages; returns once they are durable. All are checked before the first is written."""
        encoded = [encode_message(m) for m in messages]
        if not encoded:
            return
        store = await self.store(session_id)
        assert store is not None
        await store.add_messages(encoded)  # (every message validated before the first is written: all or none)

    async def replace_messages(self, session_id: str | None, messages: Sequence[Message]) -> None:
        """Make the session's history exactly ``messages`` (one ``messages_replaced`` event; the log keeps what
        came before)."""
        encoded = [encode_message(m) for m in messages]
        store = await self.store(session_id)
        assert store is not None
        await store.replace_messages(encoded)

    async def compact_storage(self, session_id: str | None, strategy: Any = None, *, tokenizer: Any = None) -> bool:
        """Run an Agent Framework ``CompactionStrategy`` on the stored history and store its result.

        The strategy sees every stored message (excluded ones too) with group annotations, as
        ``CompactionProvider`` gives it the in-memory history; if it reports a change, the annotated list
        (exclusions, summaries it inserted) replaces the history. Returns whether it changed anything.

        The replacement is a compare-and-replace: if a turn was saved, or a message erased or redacted, while the
        strategy ran, its result is dropped and it runs again on the history as it is now (so a saved turn is
        never dropped and an erased message never written back). After ``COMPACT_ATTEMPTS`` runs overtaken
        so, ConcurrencyError (nothing replaced).
        """
        strategy = strategy if strategy is not None else self.compaction_strategy
        if strategy is None:
            raise ValueError("no compaction strategy: pass one or set compaction_strategy")
        store = await self.store(session_id, create=False)
        if store is None:
            return False
        done = await self._compact(store, strategy, tokenizer if tokenizer is not None else self.compaction_tokenizer)
        if done is None:
            raise ConcurrencyError(f"session {store.session_id!r}: the history changed while the compaction "
                                   f"strategy ran, {COMPACT_ATTEMPTS} times; nothing was replaced (try again later)")
        return done

    async def _compact(self, store: PersistentContextManager, strategy: Any, tokenizer: Any) -> bool | None:
        """compact_storage's attempts: whether the history changed, or None if every attempt was overtaken."""
        for _ in range(COMPACT_ATTEMPTS):
            stored = await store.get_messages()
            version = store.history_version  # (read in the same step as the history: nothing ran in between)
            messages = [decode_message(m) for m in stored]
            if not messages:
                return False
            annotate_message_groups(messages)
            if tokenizer is not None:
                annotate_token_counts(messages, tokenizer=tokenizer)
            if not await strategy(messages):
                return False
            try:
                await store.replace_messages([encode_message(m) for m in messages], if_version=version)
                return True
            except ConcurrencyError:
                if store.history_version == version:
                    raise  # (not this compare-and-replace's refusal)
                continue  # the history changed while the strategy ran: compact it as it is now
        return None

    async def _record_usage(self, context: Any) -> None:
        """Usage never fails a run: a report the store refuses is one warning line."""
        from .usage_of import agent_framework_report

        try:
            report = agent_framework_report(getattr(context, "response", None))
            if report is not None:
                store = await self.store(context.session_id)
                if store is not None:
                    await store.record_usage(report[0], source="agent-framework", **report[1])
        except Exception as e:
            logging.getLogger("context_persistent").warning("agent-framework usage not recorded: %s", e)

    async def after_run(self, *, agent: Any, session: Any, context: Any, state: dict[str, Any]) -> None:
        """Store the run's messages and the usage its response reports (a ``usage_reported`` event, once per
        ``response_id``), then compact the stored history if ``compaction_strategy`` is set."""
        await super().after_run(agent=agent, session=session, context=context, state=state)
        await self._record_usage(context)
        store = await self.store(context.session_id, create=False) if self.compaction_strategy is not None else None
        if store is not None and await self._compact(store, self.compaction_strategy,
                                                     self.compaction_tokenizer) is None:
            # every message of the run is stored; the next run compacts again
            logging.getLogger("context_persistent").warning(
                "session %s: agent-framework compaction skipped: the history changed during each of %d runs of "
                "the strategy", store.session_id, COMPACT_ATTEMPTS)
