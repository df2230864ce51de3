"""PersistentContextManager: wires the log, the projection, token counting and the views together."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from . import codec
from . import events as ev
from .budget import resolve_budget
from .errors import ReadOnlyError, StoreClosedError
from .eventlog import EventLog
from .log import FSYNC_MODES, FileEventLog
from .paths import session_dir, validate_session_id
from .replay import COMPLETE, HELD, ReplayRecogniser
from .projection import MAX_BATCH, Projection, make_key, split_key
from .tokens import DEFAULT_ENCODING, TokenCounter
from .views import conversation_view, reasoning_view

logger = logging.getLogger("context_persistent")

PROGRAM = "context-persistent"
EVENT_RECOVERED = "context:recovered"
EVENT_TRANSCRIPT_IGNORED = "context:transcript_ignored"

#: Every configuration key the store understands, with its default (see docs/configuration.md).
DEFAULTS: dict[str, Any] = {
    "fsync": "always",
    "tokenizer": DEFAULT_ENCODING,
    "max_tokens": 200_000,
    "safety_margin": 1000,
    "checkpoint_every": 10_000,
    "recognise_replay": True,
}


#: Keys validated and used by the compaction layer (docs/compaction.md).
COMPACTION_KEYS = ("auto_compact", "compact_threshold", "target_usage", "compaction_strategy", "keep_recent",
                   "custom_strategy", "summarizer", "export_on_compact", "export_on_compact_every")


def _copy(value: Any) -> Any:
    """A deep copy of JSON-shaped data (orjson round trip: far faster than copy.deepcopy)."""
    return orjson.loads(orjson.dumps(value))


def _positive_int(config: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


class _FullView:
    __slots__ = ("messages", "token_count")

    def __init__(self, messages: list[dict[str, Any]], token_count: int) -> None:
        self.messages = messages
        self.token_count = token_count


class PersistentContextManager:
    """An Amplifier context manager whose source of truth is an append-only event log on disk.

    Open with ``await PersistentContextManager.open(storage_path=..., session_id=...)`` (or
    ``async with``). Every change is an event appended to ``<storage_path>/<session_id>/events.jsonl``;
    every view is rebuilt from those events. See docs/architecture.md.
    """

    def __init__(self, *, storage_path: Path, session_id: str, log: EventLog, config: dict[str, Any],
                 hooks: Any = None) -> None:
        self.storage_path = storage_path
        self.session_id = session_id
        self.hooks = hooks
        self.config = config
        self._log = log
        self._state = Projection()
        self._counter = TokenCounter(config["tokenizer"])
        self._fsync = config["fsync"]
        #: File appends with fsync always/never complete without suspending: no queue needed.
        self._inline_appends = isinstance(log, FileEventLog) and self._fsync != "batch"
        self._readonly = log.readonly
        self._closed = False
        self._loaded_from_file = False
        self._pending: list[tuple[str, Any, bytes, asyncio.Future[dict[str, Any]]]] = []
        self._flush_task: asyncio.Task[None] | None = None
        self.recovered: Any = None
        self._replay: ReplayRecogniser | None = None
        self._compactor: Any = None  # set by _setup_compaction (compaction issue)

    # -- opening ------------------------------------------------------------------------------------
    @classmethod
    async def open(cls, *, storage_path: str | os.PathLike[str], session_id: str, hooks: Any = None,
                   readonly: bool = False, **config: Any) -> "PersistentContextManager":
        """Open (creating if needed) a session's store and replay its log.

        Raises SessionLockedError if another writer holds it, LogCorruptedError if a record before the end
        fails verification, ValueError for a bad session id or configuration.
        """
        validate_session_id(session_id)
        cfg = cls.check_config(config)
        directory = session_dir(storage_path, session_id)
        log = FileEventLog(directory, session_id, readonly=readonly, fsync=cfg["fsync"])
        store = cls(storage_path=Path(storage_path), session_id=session_id, log=log, config=cfg, hooks=hooks)
        try:
            await store._load()
        except BaseException:
            await log.close()
            raise
        return store

    @staticmethod
    def check_config(config: dict[str, Any]) -> dict[str, Any]:
        known = set(DEFAULTS) | set(COMPACTION_KEYS)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown configuration key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        cfg = {**DEFAULTS, **config}
        if cfg["fsync"] not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}; got {cfg['fsync']!r}")
        if cfg["tokenizer"] is not None and not isinstance(cfg["tokenizer"], str):
            raise ValueError(f"tokenizer must be a tiktoken encoding name or 'chars/4', got {cfg['tokenizer']!r}")
        _positive_int(cfg, "max_tokens")
        _positive_int(cfg, "safety_margin", 0)
        _positive_int(cfg, "checkpoint_every")
        if not isinstance(cfg["recognise_replay"], bool):
            raise ValueError(f"recognise_replay must be true or false, got {cfg['recognise_replay']!r}")
        return cfg

    async def _load(self) -> None:
        log = self._log
        apply = self._state.apply
        async for batch in log.read_batches():
            for rec in batch:
                apply(rec)
        await self._after_load()

    async def _after_load(self) -> None:
        """Recover a torn tail, note what was loaded, start a new log with ``session_started``."""
        log = self._log
        state = self._state
        self._loaded_from_file = state.has_history
        if state.has_history and not self._readonly and self.config["recognise_replay"]:
            self._replay = ReplayRecogniser(state.messages)
            if not self._replay.active:
                self._replay = None
        torn = getattr(log, "torn", None)
        if torn is not None:
            if self._readonly:
                logger.info("%s: ignoring an incomplete last record at byte %d (a writer may be appending)",
                            log.path, torn.offset)
            else:
                log.cut_torn_tail()
                self.recovered = torn
                logger.warning(
                    "%s: cut a torn last record at line %d, byte offset %d (%d bytes; %s); the bytes were saved to %s",
                    log.path, torn.line, torn.offset, torn.length, torn.reason, torn.saved_to,
                )
                await self._emit(EVENT_RECOVERED, {
                    "path": str(log.path), "line": torn.line, "offset": torn.offset, "length": torn.length,
                    "reason": torn.reason, "saved_to": torn.saved_to, "last_seq": state.head_seq,
                })
        if state.head_seq == 0 and not self._readonly:
            await self._commit(ev.SESSION_STARTED, {
                "format": codec.FORMAT_VERSION,
                "tokenizer": self._counter.requested,
                "program": PROGRAM,
                "session_id": self.session_id,
            })

    # -- properties ---------------------------------------------------------------------------------
    @property
    def loaded_from_file(self) -> bool:
        """True when the log held history (a message, a replacement or a clear) when this store opened.

        A log that exists but holds only ``session_started`` counts as fresh (False): there is nothing of
        ours to protect, so ``set_messages`` is accepted. A log that was cleared counts as loaded (True): the
        clear is part of the authoritative history and a stale transcript must not undo it.
        """
        return self._loaded_from_file

    @property
    def path(self) -> Path:
        return self._log.path

    @property
    def head_seq(self) -> int:
        return self._state.head_seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tokenizer(self) -> str:
        return self._counter.name

    # -- writing ------------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the store is closed")
        if self._readonly:
            raise ReadOnlyError(f"session {self.session_id!r} was opened readonly=True; writes are not allowed")

    async def _commit(self, type_: str, data: Any, data_json: bytes | None = None) -> dict[str, Any]:
        """Append one event, apply it once it is durable (per the fsync policy), return the record."""
        self._check_writable()
        if data_json is None:
            data_json = codec.dumps(data)
        if self._inline_appends:
            # The file backend's append does not suspend here, so no other commit can interleave.
            seq = self._state.head_seq + 1
            ts = codec.now_iso()
            await self._log.append((codec.encode(seq, type_, data_json, ts),), seq)
            rec = {"seq": seq, "ts": ts, "type": type_, "data": data}
            self._state.apply(rec)
            self._after_append()
            return rec
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((type_, data, data_json, fut))
        if self._flush_task is None:
            self._flush_task = asyncio.ensure_future(self._flush_pending())
        return await fut

    async def _flush_pending(self) -> None:
        """Group commit: everything queued so far goes out in one append (one write, one sync)."""
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                first = self._state.head_seq + 1
                recs, lines = [], []
                for i, (type_, data, data_json, _) in enumerate(batch):
                    ts = codec.now_iso()
                    lines.append(codec.encode(first + i, type_, data_json, ts))
                    recs.append({"seq": first + i, "ts": ts, "type": type_, "data": data})
                try:
                    await self._log.append(lines, first)
                except Exception as e:
                    for *_, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for rec, (*_, fut) in zip(recs, batch):
                    self._state.apply(rec)
                    if not fut.done():
                        fut.set_result(rec)
                self._after_append()
        finally:
            self._flush_task = None

    def _after_append(self) -> None:
        """Hook for periodic work after appends (checkpoints)."""

    async def add_message(self, message: dict[str, Any]) -> None:
        """Append a message; returns once it is durable (fsync policy). ValueError if it is invalid.

        Right after a resume, messages that replay the loaded history are recognised and not stored twice
        (see replay.py and docs/resume.md).
        """
        self._check_writable()
        msg_json = ev.validate_message(message)
        stored = orjson.loads(msg_json)
        replay = self._replay
        if replay is not None:
            verdict = replay.offer(stored, msg_json)
            if verdict == HELD:
                return
            self._replay = None
            if verdict == COMPLETE:
                payload = b"[" + b",".join(j for _, j in replay.held) + b"]"
                await self._commit(ev.REPLAY_RECOGNISED, {"count": len(replay.held), "digest": ev.digest(payload)})
                logger.info("session %s: %d add_message calls replayed the loaded history; not stored twice",
                            self.session_id, len(replay.held))
                return
            await self._write_held(replay)
        await self._commit(ev.MESSAGE_ADDED, {"message": stored}, b'{"message":%s}' % msg_json)

    async def _write_held(self, replay: ReplayRecogniser | None = None) -> None:
        """Write messages held by the replay recogniser: they turned out not to be a replay."""
        replay = replay or self._replay
        self._replay = None
        if replay is not None:
            for held, held_json in replay.held:
                await self._commit(ev.MESSAGE_ADDED, {"message": held}, b'{"message":%s}' % held_json)

    async def set_messages(self, messages: list[dict[str, Any]]) -> None:
        """Replace the history, unless this store loaded its own log (the resume rule; see docs/resume.md)."""
        self._check_writable()
        parts = ev.validate_messages(messages)
        if self._replay is not None and self._replay.held:
            await self._write_held()
        if len(parts) >= MAX_BATCH:
            raise ValueError(f"set_messages takes at most {MAX_BATCH - 1} messages, got {len(parts)}")
        payload = b"[" + b",".join(parts) + b"]"
        if self._loaded_from_file:
            info = {"count": len(parts), "digest": ev.digest(payload), "bytes": len(payload),
                    "reason": "the store loaded its own log, which is authoritative"}
            logger.info("session %s: set_messages with %d messages ignored (%s)", self.session_id,
                        len(parts), info["reason"])
            await self._commit(ev.TRANSCRIPT_IGNORED, info)
            await self._emit(EVENT_TRANSCRIPT_IGNORED, dict(info))
            return
        await self._commit(ev.MESSAGES_REPLACED, {"messages": orjson.loads(payload)},
                           b'{"messages":%s}' % payload)

    async def clear(self) -> None:
        """Empty the history (an event: it stays empty after a restart)."""
        await self._write_held()
        await self._commit(ev.CLEARED, {})

    def _resolve_key(self, message_index: int | None, seq: int | None) -> int:
        if self._replay is not None and self._replay.held:
            raise ValueError("a replay of the loaded history is in progress; pin/unpin/redact after it ends")
        if (message_index is None) == (seq is None):
            raise ValueError("give exactly one of message_index (position in get_messages()) or seq")
        state = self._state
        if message_index is not None:
            if isinstance(message_index, bool) or not isinstance(message_index, int):
                raise ValueError(f"message_index must be an int, got {message_index!r}")
            n = len(state.keys)
            if not -n <= message_index < n:
                raise ValueError(f"message_index {message_index} is out of range; the history has {n} messages")
            return state.keys[message_index]
        key = make_key(seq) if isinstance(seq, int) and not isinstance(seq, bool) else None
        if key is None or state.index_of(key) is None:
            raise ValueError(f"seq {seq!r} is not a message_added event of the current history")
        return key

    async def pin(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Mark a message that compaction must always keep (survives restarts)."""
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.PINNED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})

    async def unpin(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.UNPINNED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})

    async def redact(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Hide a message from every view and export (a tombstone event; the log keeps its bytes)."""
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.REDACTED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})

    # -- reading ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the store is closed")

    async def get_messages(self) -> list[dict[str, Any]]:
        """The full history since the last clear/replacement, as a copy."""
        self._check_open()
        return _copy(self._state.messages)

    async def get_conversation_view(self) -> list[dict[str, Any]]:
        self._check_open()
        return _copy(conversation_view(self._state.messages))

    async def get_reasoning_view(self) -> list[dict[str, Any]]:
        self._check_open()
        return _copy(reasoning_view(self._state.messages))

    def _token_counts(self) -> list[int]:
        """Per-message counts, tokenising only messages not counted before (cached in the projection)."""
        tokens = self._state.tokens
        if None in tokens:
            count = self._counter.count_message
            msgs = self._state.messages
            for i, t in enumerate(tokens):
                if t is None:
                    tokens[i] = count(msgs[i])
        return tokens  # type: ignore[return-value]

    async def get_token_count(self) -> int:
        """Tokens of the full history under the active counter (see ``stats()['tokenizer']``)."""
        self._check_open()
        return sum(self._token_counts())

    def resolve_budget(self, token_budget: int | None = None, provider: Any = None) -> tuple[int, str]:
        return resolve_budget(token_budget, provider, max_tokens=self.config["max_tokens"],
                              safety_margin=self.config["safety_margin"])

    async def get_messages_for_request(self, token_budget: int | None = None, provider: Any = None
                                       ) -> list[dict[str, Any]]:
        """The history made ready for a provider, fitted to the budget (see docs/compaction.md)."""
        self._check_open()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._request_view(budget, source)
        return _copy(view.messages)

    async def _request_view(self, budget: int, source: str) -> Any:
        return _FullView(self._state.messages, sum(self._token_counts()))

    async def compact(self, token_budget: int | None = None, provider: Any = None) -> int:
        """Tokens the current request view saves against the full history. Stores nothing."""
        self._check_open()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._request_view(budget, source)
        return max(0, sum(self._token_counts()) - view.token_count)

    def stats(self) -> dict[str, Any]:
        """Counts and facts about this session (events, bytes, tokens, tokenizer)."""
        self._check_open()
        st = self._state
        return {
            "session_id": self.session_id,
            "path": str(self._log.path),
            "head_seq": st.head_seq,
            "events": dict(st.counts),
            "bytes": getattr(self._log, "size", None),
            "messages": len(st.messages),
            "pinned": len(st.pinned),
            "tokens": sum(self._token_counts()),
            "tokenizer": self._counter.name,
            "tokenizer_exact": self._counter.exact,
            "fsync": self._fsync,
            "loaded_from_file": self._loaded_from_file,
        }

    # -- hooks --------------------------------------------------------------------------------------
    async def _emit(self, event: str, data: dict[str, Any]) -> None:
        """Emit through the host's hooks; a failing hook is logged and never breaks the store."""
        hooks = self.hooks
        if hooks is None:
            return
        try:
            result = hooks.emit(event, data)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except Exception as e:
            logger.warning("hook handler for %s failed: %s", event, e)

    # -- closing ------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Flush and release the session (idempotent)."""
        if self._closed:
            return
        if self._replay is not None and self._replay.held and not self._closed:
            await self._write_held()  # a partial replay is kept: duplicates are better than loss
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)
        self._closed = True
        await self._log.close()

    async def __aenter__(self) -> "PersistentContextManager":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<PersistentContextManager session={self.session_id!r} seq={self._state.head_seq} path={self._log.path}>"
