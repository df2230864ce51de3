"""PersistentContextManager: wires the log, the projection, token counting and the views together."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from . import codec
from . import events as ev
from .backends import BACKENDS, open_log
from .budget import resolve_budget
from .errors import InvalidRecordError, ReadOnlyError, StoreClosedError
from .eventlog import EventLog
from .log import FSYNC_MODES, FileEventLog
from .paths import validate_session_id
from .replay import MISMATCH, TRANSCRIPT_SKIPS, ReplayRecogniser
from .projection import MAX_BATCH, LazyList, Projection, make_key, split_key
from .tokens import DEFAULT_ENCODING, PIECE, TokenCounter, message_text, resolve_tokenizer
from .views import conversation_view, reasoning_view

if TYPE_CHECKING:  # compaction, checkpoints and snapshots load on first use: `import context_persistent` stays cheap
    from .compaction import CompactionConfig, RequestView
    from .compaction.incremental import Anchor

logger = logging.getLogger("context_persistent")

#: Messages with at least this many characters of text are tokenised in a worker thread (see
#: ``_count_large_off_loop``): about 10-50 ms of tiktoken at this size, and seconds for megabytes.
LARGE_TEXT = PIECE

PROGRAM = "context-persistent"
EVENT_RECOVERED = "context:recovered"
EVENT_PRE_COMPACT = "context:pre_compact"
EVENT_POST_COMPACT = "context:post_compact"
EVENT_COMPACTION = "context:compaction"
EVENT_TRANSCRIPT_IGNORED = "context:transcript_ignored"
EVENT_SECRET_REDACTED = "context:secret_redacted"

#: Every configuration key the store understands, with its default (see docs/configuration.md).
DEFAULTS: dict[str, Any] = {
    "fsync": "always",
    "reserve_tail": False,
    "tokenizer": DEFAULT_ENCODING,
    "max_tokens": 200_000,
    "safety_margin": 1000,
    "checkpoint_every": 10_000,
    "recognise_replay": False,  # the Amplifier mount turns it on (mount.py)
    "resume_rule": "recognise",
    "copy_request_view": False,
    "export_on_compact": False,
    "export_on_compact_every": 100,
    "backend": "file",
    "dsn": None,
    "pg_schema": None,
    "secret_scanner": None,
    "retention": None,
}

#: What set_messages does once the store loaded its own log (docs/resume.md).
RESUME_RULES = ("recognise", "strict")

#: Keys validated and used by the compaction layer (docs/compaction.md, docs/configuration.md).
COMPACTION_KEYS = ("auto_compact", "compact_threshold", "compaction_threshold", "target_usage", "strategy",
                   "compaction_strategy", "keep_recent", "keep_head", "mask_min_tokens", "custom",
                   "custom_strategy", "summarizer", "export_on_compact", "export_on_compact_every",
                   "copy_request_view")


#: Every key open() accepts (mount() ignores the others with a warning).
KNOWN_KEYS = frozenset(DEFAULTS) | frozenset(COMPACTION_KEYS)


_ATOMIC = frozenset((str, int, float, bool, type(None)))


def _copy(value: Any) -> Any:
    """A deep copy of JSON-shaped data: new dicts and lists; str, numbers, bools and None are immutable, so shared.

    The cost follows the number of containers, not the bytes: 2.5x faster than an orjson round trip for
    300-byte messages, 30x for 4 KB ones (docs/performance.md), and far faster than ``copy.deepcopy``.
    """
    t = type(value)
    if t is list:
        return [v if type(v) in _ATOMIC else _copy(v) for v in value]
    if t is dict:
        out = value.copy()
        for k, v in out.items():
            if type(v) not in _ATOMIC:
                out[k] = _copy(v)  # replacing a value while iterating is allowed (the size does not change)
        return out
    if t in _ATOMIC:
        return value
    return orjson.loads(orjson.dumps(value))  # anything else (a tuple, a subclass): convert as JSON does


def _is_prompt(message: dict[str, Any]) -> bool:
    """A system message that can be the system prompt (a hook's injection, ``metadata.source == "hook"``, is
    conversation content)."""
    if message.get("role") != "system":
        return False
    meta = message.get("metadata")
    return not (isinstance(meta, dict) and meta.get("source") == "hook")


class _Flags:
    """``flags[i]``: whether index ``i`` is in a set (pinned flags without a list as long as the history)."""

    __slots__ = ("_set",)

    def __init__(self, indices: set[int]) -> None:
        self._set = indices

    def __getitem__(self, i: int) -> bool:
        return i in self._set


def _positive_int(config: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


async def _apply_retention(storage_path: Path, session_id: str, cfg: dict[str, Any]) -> None:
    """``retention.apply_on_open``: apply the policy to the other sessions before this one opens
    (docs/operations.md, "Retention")."""
    if cfg["backend"] == "postgres":
        from .pg.retention import apply_on_open as apply_pg

        report = await apply_pg(cfg["dsn"], cfg["pg_schema"], cfg["retention"], session_id)
    else:
        from .trash import apply_on_open

        report = await apply_on_open(storage_path, cfg["retention"], session_id)
    if report is None:
        logger.info("retention on open skipped: another process is applying retention to %s", storage_path)
    elif report["trashed"]:
        logger.info("retention on open moved %d session(s) to the trash: %s", len(report["trashed"]),
                    ", ".join(f"{t['session_id']} ({t['rule']})" for t in report["trashed"]))


class PersistentContextManager:
    """An Amplifier context manager whose source of truth is an append-only event log on disk.

    Open with ``await PersistentContextManager.open(storage_path=..., session_id=...)`` (or
    ``async with``). Every change is an event appended to ``<storage_path>/<session_id>/events.jsonl``;
    every view is rebuilt from those events. See docs/architecture.md.

    ``async with await PersistentContextManager.open(...) as store:`` closes the store on leaving the block.
    Attributes: ``session_id``, ``storage_path`` (a Path), ``config`` (the checked configuration),
    ``hooks`` (the host's hooks, or None), ``recovered`` (the torn tail cut at open, or None) and
    ``last_compaction`` (the stats of the last compaction that changed the request view, or None).
    """

    #: A rebuild of a history at least this long reads only the newest messages that can fit the budget
    #: (plus what must be kept): compaction/window.py. Tests lower it.
    WINDOW_MIN_MESSAGES = 4096

    def __init__(self, *, storage_path: Path, session_id: str, log: EventLog, config: dict[str, Any],
                 hooks: Any = None) -> None:
        self.storage_path = storage_path
        self.session_id = session_id
        self.hooks = hooks
        self.config = config
        self._log = log
        #: The ``prev`` of the session's first record (codec.root_crc); later records name their predecessor.
        self._root = codec.root_crc(session_id)
        self._state = Projection()
        self._counter = TokenCounter(config["tokenizer"])
        self._fsync = config["fsync"]
        #: Redacts secrets in messages before they are written (secret_scan.py); None: off, no cost.
        self._scanner = config.get("secret_scanner")
        #: The factory's last text, and its prompt as stored and what the scanner removed (scanned once).
        self._scanned_prompt: tuple[str, dict[str, Any], list[dict[str, Any]] | None] | None = None
        #: What the scanner removed from messages the replay recogniser holds (by id of the held message).
        #: File appends with fsync always/never complete without suspending: no queue needed.
        self._inline_appends = isinstance(log, FileEventLog) and self._fsync != "batch"
        self._readonly = log.readonly
        self._closed = False
        self._loaded_from_file = False
        #: clear() was called by this process: what it loaded is no longer there to protect (docs/resume.md).
        self._cleared_here = False
        #: The host's system prompt factory (set_system_prompt_factory; hooks read and wrap this attribute).
        self._system_prompt_factory: Callable[[], Awaitable[str]] | None = None
        #: System messages added at session start on a resume (the host's fallback for a system prompt): they
        #: replace the history's leading system messages instead of piling up (docs/resume.md).
        self._start_prompts: list[dict[str, Any]] | None = None
        self._pending: list[tuple[str, Any, bytes, asyncio.Future[int]]] = []
        self._flush_task: asyncio.Task[None] | None = None
        self.recovered: Any = None
        self._replay: ReplayRecogniser | None = None
        self._compaction: CompactionConfig = config["compaction"]
        #: (projection version, budget, epoch, anchor, view): the request view is reused while neither version
        #: nor budget changes, and extended (compaction/incremental.py) while only messages were appended.
        self._view_cache: tuple[int, int, int, Anchor | None, RequestView] | None = None
        #: Bumped by every applied event other than message_added and audit events (they can change the view
        #: anywhere, so the request view must be rebuilt rather than extended).
        self._epoch = 0
        #: (epoch, n, token list): the first n counts of that list were complete at that epoch.
        self._count_hint: tuple[int, int, Any] = (-1, 0, None)
        #: (token list, n): messages below n of that list were looked at by _count_large_off_loop.
        self._large_seen: tuple[Any, int] = (None, 0)
        self._large_busy: asyncio.Future[None] | None = None
        #: Stats of the last compaction that changed the view (for stats() and the CLI).
        self.last_compaction: dict[str, Any] | None = None
        self._last_compaction_export_seq = 0
        #: ``compacted`` audit records made by request views: a read never writes or syncs, so they wait here
        #: and go out in the same write as the next appended event (or at close; docs/compaction.md).
        self._deferred: list[tuple[str, Any, bytes]] = []
        #: (budget, warning with its numbers blanked) already logged: a view warning is said once, not per request.
        self._warned: set[tuple[int, str]] = set()
        #: Checkpoints (checkpoint/policy.py): resume from one at open, write one every checkpoint_every events.
        from .checkpoint import Checkpointer, checkpoint_store_for

        self._checkpoints = Checkpointer(checkpoint_store_for(log), session_id, config["checkpoint_every"],
                                         writable=not log.readonly)
        self._checkpoints.front_hints = self._front_hints
        #: The largest request budget seen: a checkpoint's front section keeps the newest messages up to twice
        #: this (and max_tokens), so the first request after the next open reads nothing else.
        self._max_budget = 0

    # -- opening ------------------------------------------------------------------------------------
    @classmethod
    async def open(cls, *, storage_path: str | os.PathLike[str], session_id: str, hooks: Any = None,
                   readonly: bool = False, **config: Any) -> "PersistentContextManager":
        """Open (creating if needed) a session's store and replay its log.

        ``storage_path`` is the root folder (``~`` is expanded; created with mode 0700 if missing) and
        ``session_id`` the session's folder name in it. ``hooks`` receives the store's events (``emit``).
        ``readonly`` True opens without the writer lock (no writes; the session must exist). ``config``
        takes the keys of docs/configuration.md.

        Returns the open store. Raises SessionLockedError if another writer holds it, SessionNotFoundError
        for a read-only open of a session that does not exist, LogCorruptedError if a record before the end
        fails verification, UnsupportedFormatError for a log of a newer format, DatabaseError when the
        PostgreSQL backend cannot be reached, ValueError for a bad session id or configuration.
        """
        validate_session_id(session_id)
        cfg = cls.check_config(config)
        storage_path = Path(storage_path).expanduser()
        if cfg["retention"] is not None and cfg["retention"].apply_on_open and not readonly:
            await _apply_retention(storage_path, session_id, cfg)
        log = await open_log(storage_path, session_id, cfg, readonly=readonly)
        try:  # (whatever fails after the log is open, its writer lock is released)
            store = cls(storage_path=storage_path, session_id=session_id, log=log, config=cfg, hooks=hooks)
            await store._load()
        except BaseException:
            await log.close()
            raise
        return store

    @staticmethod
    def check_config(config: dict[str, Any]) -> dict[str, Any]:
        """Check ``config`` (the keys of docs/configuration.md) without opening anything.

        Returns the complete configuration: defaults filled in, the compaction settings parsed, the backend
        resolved (a ``dsn`` alone selects PostgreSQL). Raises ValueError naming the key and the rule for an
        unknown key or a bad value.
        """
        unknown = sorted(set(config) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown configuration key(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(sorted(KNOWN_KEYS))}")
        cfg = {**DEFAULTS, **config}
        if cfg["fsync"] not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}; got {cfg['fsync']!r}")
        resolve_tokenizer(cfg["tokenizer"])  # ValueError naming what is allowed
        _positive_int(cfg, "max_tokens")
        _positive_int(cfg, "safety_margin", 0)
        _positive_int(cfg, "checkpoint_every")
        for flag in ("recognise_replay", "copy_request_view", "export_on_compact", "reserve_tail"):
            if not isinstance(cfg[flag], bool):
                raise ValueError(f"{flag} must be true or false, got {cfg[flag]!r}")
        _positive_int(cfg, "export_on_compact_every")
        if cfg["resume_rule"] not in RESUME_RULES:
            raise ValueError(f"resume_rule must be one of {', '.join(RESUME_RULES)}; got {cfg['resume_rule']!r}")
        if cfg["retention"] is not None:
            from .retention import RetentionPolicy

            cfg["retention"] = RetentionPolicy.from_config(cfg["retention"])
        if cfg["secret_scanner"] is not None:
            from .secret_scan import make_scanner

            cfg["secret_scanner"] = make_scanner(cfg["secret_scanner"])
        from .compaction import CompactionConfig

        cfg["compaction"] = CompactionConfig.from_config(config)
        if cfg["dsn"] is not None and "backend" not in config:
            cfg["backend"] = "postgres"  # a dsn alone selects the postgres backend
        if cfg["backend"] not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {cfg['backend']!r}")
        if cfg["reserve_tail"] and (cfg["fsync"] != "always" or cfg["backend"] != "file"):
            raise ValueError(f"reserve_tail applies to the file backend with fsync='always' only; got "
                             f"backend={cfg['backend']!r}, fsync={cfg['fsync']!r} (docs/format.md, "
                             "'The reserved tail')")
        if cfg["backend"] == "file" and (cfg["dsn"] is not None or cfg["pg_schema"] is not None):
            raise ValueError("dsn/pg_schema are set but backend is 'file': set backend='postgres' to use them")
        if cfg["backend"] == "postgres":
            from .pg import resolve_dsn, resolve_schema

            cfg["dsn"] = resolve_dsn(cfg["dsn"])
            cfg["pg_schema"] = resolve_schema(cfg["pg_schema"])
        return cfg

    async def _load(self) -> None:
        # Replay allocates millions of objects that all stay alive: the cyclic GC would scan them again and
        # again for nothing (about 40% of a 1M-event open). Records are acyclic, so pause it while we fold.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            # Compare with the *requested* tokenizer: asking the counter for its name would load the encoding
            # (~0.1-0.3 s) on every open; _token_counts checks the loaded one on first use.
            self._state = await self._checkpoints.load(self._log, lambda: self._counter.requested)
        except InvalidRecordError as e:
            e.path = str(self._log.path)
            raise
        finally:
            if gc_was_enabled:
                gc.enable()
        await self._after_load()

    def _tokenizer_name(self) -> str:
        return self._counter.name

    def _front_hints(self) -> tuple[int, int]:
        """What a checkpoint's front section must cover (checkpoint.front_of)."""
        from .checkpoint import FRONT_RECENT_FACTOR

        budget = max(self.config["max_tokens"], self._max_budget)
        return self._compaction.keep_head, FRONT_RECENT_FACTOR * budget

    def _full(self) -> Projection:
        """The state with the whole history in memory (loads the rest of a lazily opened checkpoint)."""
        return self._state.materialise()

    async def _after_load(self) -> None:
        """Recover a torn tail, note what was loaded, start a new log with ``session_started``."""
        log = self._log
        state = self._state
        self._loaded_from_file = state.has_history
        if state.has_history and not self._readonly:
            self._start_prompts = []
        if state.has_history and not self._readonly and self.config["recognise_replay"]:
            self._replay = ReplayRecogniser(state.messages)
            if not self._replay.active:
                self._replay = None
        torn = log.torn if isinstance(log, FileEventLog) else None  # only files can tear
        if isinstance(log, FileEventLog) and torn is not None:
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
        """True when the log held history (a message, a replacement, a clear or a system prompt) when this store
        opened.

        A log that exists but holds only ``session_started`` counts as fresh (False): there is nothing of
        ours to protect, so ``set_messages`` is accepted. A log that was cleared counts as loaded (True): the
        clear is part of the authoritative history and a stale transcript must not undo it.
        """
        return self._loaded_from_file

    @property
    def path(self) -> Any:
        """Where the log lives: ``<storage>/<session>/events.jsonl`` for files, a description for PostgreSQL."""
        return self._log.path

    @property
    def head_seq(self) -> int:
        """The seq of the last event applied (0 for an empty log): what ``at``, ``fork`` and ``follow`` count in."""
        return self._state.head_seq

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    @property
    def tokenizer(self) -> str:
        """The name of the active token counter (a tiktoken encoding, or ``chars/4`` when it fell back)."""
        return self._counter.name

    # -- writing ------------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the store is closed")
        if self._readonly:
            raise ReadOnlyError(f"session {self.session_id!r} was opened readonly=True; writes are not allowed")

    async def _commit(self, type_: str, data: Any, data_json: bytes | None = None) -> int:
        """Append one event and apply it once it is durable (per the fsync policy); returns its seq."""
        self._check_writable()
        if data_json is None:
            data_json = codec.dumps(data)
        if self._inline_appends:
            # The file backend's append does not suspend here, so no other commit can interleave.
            seq = self._state.head_seq + 1
            ts = codec.now_iso()
            if self._deferred:  # audit records of earlier request views ride along in this write
                await self._commit_with_deferred([(type_, data, data_json)])
                return self._state.head_seq  # (the event is the last of that write)
            log = self._log
            await log.append((codec.encode(seq, type_, data_json, ts, log.last_crc or self._root),), seq)
            self._state.apply({"seq": seq, "ts": ts, "type": type_, "data": data})
            if type_ != ev.MESSAGE_ADDED and type_ not in ev.AUDIT_EVENTS:
                self._epoch += 1
            self._after_append()
            return seq
        return await self._enqueue(type_, data, data_json)

    def _encode_run(self, first: int, events: list[tuple[str, bytes]], ts: str) -> list[bytes]:
        """Records for ``events`` (type, data JSON) from seq ``first`` on, each naming the one before it."""
        prev = self._log.last_crc or self._root
        lines = []
        for seq, (type_, data_json) in enumerate(events, first):
            line = codec.encode(seq, type_, data_json, ts, prev)
            lines.append(line)
            prev = line[-11:-3]  # (codec.crc_of, inlined: this is the group-commit path)
        return lines

    async def _commit_with_deferred(self, events: list[tuple[str, Any, bytes]]) -> None:
        """Append the deferred audit records and ``events`` in one write (inline appends, or a store whose group
        commit has drained, as at close).

        If the write fails, nothing was applied and the audit records stay deferred for the next append.
        """
        deferred, self._deferred = self._deferred, []
        batch = deferred + events
        first = self._state.head_seq + 1
        ts = codec.now_iso()
        try:
            await self._log.append(self._encode_run(first, [(t, dj) for t, _, dj in batch], ts), first)
        except BaseException:
            self._deferred = deferred + self._deferred
            raise
        for seq, (t, d, _) in enumerate(batch, first):
            self._state.apply({"seq": seq, "ts": ts, "type": t, "data": d})
            if t != ev.MESSAGE_ADDED and t not in ev.AUDIT_EVENTS:
                self._epoch += 1
        self._after_append()

    def _enqueue(self, type_: str, data: Any, data_json: bytes) -> asyncio.Future[int]:
        """Queue an event for the next group commit; the future is done once it is durable and applied.

        A plain method returning the future (not a coroutine): ``add_message`` awaits it directly, one
        coroutine frame less per message. Each caller has its own future: a future shared by the group would
        be cancelled for all of them when one caller is cancelled.
        """
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((type_, data, data_json, fut))
        if self._flush_task is None:
            self._flush_task = asyncio.ensure_future(self._flush_pending())
        return fut

    async def _flush_pending(self) -> None:
        """Group commit: everything queued so far goes out in one append (one write, one sync).

        The file log syncs on this thread, so the event loop waits for the fdatasync; callers that become ready
        meanwhile queue up and form the next group (docs/performance.md has the measurements).
        """
        try:
            while self._pending:
                pending, self._pending = self._pending, []
                deferred, self._deferred = self._deferred, []
                # audit records of earlier request views (no caller waits on them) go out with this group
                batch: list[tuple[str, Any, bytes, asyncio.Future[int] | None]] = [
                    (t, d, dj, None) for t, d, dj in deferred]
                batch += pending
                state = self._state
                first = state.head_seq + 1
                ts = codec.now_iso()  # one write, one time: the records of a group commit share it
                try:
                    lines = self._encode_run(first, [(type_, data_json) for type_, _, data_json, _ in batch], ts)
                    await self._log.append(lines, first)
                except Exception as e:  # nothing of this group was applied: each of its callers gets the error
                    self._deferred = deferred + self._deferred
                    for *_, fut in batch:
                        if fut is not None and not fut.done():
                            fut.set_exception(e)
                    continue
                apply = state.apply
                for seq, (type_, data, _, fut) in enumerate(batch, first):
                    apply({"seq": seq, "ts": ts, "type": type_, "data": data})
                    if type_ != ev.MESSAGE_ADDED and type_ not in ev.AUDIT_EVENTS:
                        self._epoch += 1
                    if fut is not None and not fut.done():  # (a cancelled caller's record is written all the same)
                        fut.set_result(seq)
                self._after_append()
        finally:
            self._flush_task = None

    def _after_append(self) -> None:
        """Periodic work after appends: a checkpoint every ``checkpoint_every`` events (in the background).

        The records are durable by now: nothing here may fail the append (or kill a batch's flush task)."""
        try:
            self._checkpoints.maybe_write(self._state, self._log, self._tokenizer_name)
        except Exception as e:
            logger.warning("session %s: work after an append failed (%s); the records are stored", self.session_id, e)

    async def add_message(self, message: dict[str, Any]) -> None:
        """Append ``message`` (a dict with a ``role``; JSON values only); returns once it is durable (the
        ``fsync`` policy, docs/operations.md).

        Every call that returns has written its message. With ``recognise_replay`` (the Amplifier mount), a
        host replaying the loaded history right after a resume is recognised and the repetition folded out
        of the views by a later event (see replay.py and docs/resume.md).

        Raises ValueError if the message is invalid (nothing is stored); StoreClosedError after
        ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk
        refuses the write (nothing was recorded); DatabaseError on PostgreSQL when the server fails.
        """
        self._check_writable()
        msg_json = ev.validate_message(message)
        # Our own copy (the caller may change its dict later). Validated, the message holds only JSON types, so
        # _copy gives what orjson.loads(msg_json) would, faster (docs/performance.md).
        stored = _copy(message)
        found = None
        if self._scanner is not None:
            hit = self._scanner.redact(stored, msg_json)
            if hit is not None:
                stored, msg_json, found = hit
        if self._start_prompts is not None:
            if _is_prompt(stored):
                # Session start on a resume: the host's fallback re-adds the system prompt; it replaces the
                # leading system messages (an event: the log keeps what the model saw when).
                prompts = [*self._start_prompts, stored]
                await self._set_prompts(prompts, "add_message", found)
                self._start_prompts = prompts
                return
            self._start_prompts = None
        replay = self._replay
        if replay is not None and replay.complete:
            # The next message after a complete replay confirms it: fold the repetition out, then go on.
            self._replay = None
            await self._commit_replay(replay)
            replay = None
        data, data_json = {"message": stored}, b'{"message":%s}' % msg_json
        if found is not None:  # what kinds were removed, never the secret (docs/operations.md, "Secrets")
            data["secrets"] = found
            data_json = b'{"message":%s,"secrets":%s}' % (msg_json, codec.dumps(found))
        if replay is None:
            if self._inline_appends:
                seq = await self._commit(ev.MESSAGE_ADDED, data, data_json)
            else:
                seq = await self._enqueue(ev.MESSAGE_ADDED, data, data_json)  # (writability is checked above)
        else:
            seq = await self._commit(ev.MESSAGE_ADDED, data, data_json)
            if self._replay is replay and stored.get("role") not in TRANSCRIPT_SKIPS:
                if replay.offer(stored, make_key(seq), msg_json) == MISMATCH:
                    self._replay = None
        if found is not None:
            await self._emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": found})

    async def add_messages(self, messages: list[dict[str, Any]]) -> None:
        """Append several ``messages``, one ``message_added`` event each; returns once all are durable.

        Every message is validated first: if one is invalid, none is stored. On files they go out in one write
        (one sync): a crash during the call can keep a prefix of them (each record is checked on its own), never
        a part of one. With ``reserve_tail: true`` each record is its own durable append instead (the reserve
        covers single records, docs/format.md). Right after a resume (a replay may be under way, or the host
        may re-add its system prompt) and with a ``secret_scanner`` they are added one by one as
        ``add_message`` would.

        Raises ValueError naming the index of an invalid message (nothing is stored); StoreClosedError after
        ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk refuses
        the write; DatabaseError on PostgreSQL when the server fails.
        """
        self._check_writable()
        parts = ev.validate_messages(messages)
        if not parts:
            return
        if self._replay is not None or self._start_prompts is not None or self._scanner is not None:
            for message in messages:
                await self.add_message(message)
            return
        batch = [(ev.MESSAGE_ADDED, {"message": _copy(m)}, b'{"message":%s}' % j) for m, j in zip(messages, parts)]
        if self._inline_appends and self.config["reserve_tail"]:
            for type_, data, j in batch:
                await self._commit(type_, data, j)
        elif self._inline_appends:
            await self._commit_with_deferred(batch)  # (with the audit records of earlier request views, if any)
        else:  # queued together before the flush task runs: one group commit
            await asyncio.gather(*[self._enqueue(type_, data, j) for type_, data, j in batch])

    async def _commit_replay(self, replay: ReplayRecogniser) -> None:
        """Write the ``replay_recognised`` event that folds a confirmed replay out of the views."""
        payload = b"[" + b",".join(replay.digests) + b"]"
        await self._commit(ev.REPLAY_RECOGNISED, {"count": len(replay.keys), "keys": list(replay.keys),
                                                  "digest": ev.digest(payload)})
        logger.info("session %s: %d add_message calls replayed the loaded history; folded out of the views",
                    self.session_id, len(replay.keys))

    def _end_replay(self) -> None:
        """Any other write, a request for the model or close() ends a replay recognition (nothing is held),
        and the session start (system messages added from then on are conversation messages)."""
        self._replay = None
        self._start_prompts = None

    async def set_system_prompt_factory(self, factory: Callable[[], Awaitable[str]] | None) -> None:
        """Register the host's system prompt factory (Amplifier: foundation's bundle prompt, an agent's
        instruction; hooks wrap it by reading ``_system_prompt_factory`` and setting a new one).

        Called before every request for the model (``get_messages_for_request``): its text is the history's
        system prompt. When it differs from the prompt the history opens with, a ``system_prompt_set`` event
        replaces the leading system messages, so every request carries exactly one system prompt, the log
        keeps what the model saw when, and nothing is written while the prompt stays the same. ``None``
        unregisters it.

        Raises ValueError if ``factory`` is not callable. (A factory that returns something other than a str
        makes the next ``get_messages_for_request`` raise ValueError.)
        """
        if factory is not None and not callable(factory):
            raise ValueError(f"the system prompt factory must be an async callable returning a str, got {factory!r}")
        self._system_prompt_factory = factory

    async def _refresh_system_prompt(self) -> None:
        factory = self._system_prompt_factory
        if factory is None or self._readonly or self._closed:
            return
        result = factory()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        if not isinstance(result, str):
            raise ValueError(f"the system prompt factory returned {type(result).__name__}, expected a str")
        prompt: dict[str, Any] = {"role": "system", "content": result}
        found = None
        if self._scanner is not None:  # the prompt is stored like any message: never with its secrets
            cached = self._scanned_prompt
            if cached is not None and cached[0] == result:
                prompt, found = cached[1], cached[2]
            else:
                hit = self._scanner.redact(prompt, codec.dumps(prompt))
                if hit is not None:
                    prompt, _, found = hit
                self._scanned_prompt = (result, prompt, found)
        state = self._state
        n = state.leading_system_count()
        if n == 1 and state.messages[0] == prompt:
            return
        await self._set_prompts([prompt], "factory", found)

    async def _set_prompts(self, prompts: list[dict[str, Any]], source: str,
                           secrets: list[dict[str, Any]] | None) -> None:
        """One ``system_prompt_set`` event (with what kinds the scanner removed, never the secrets)."""
        data: dict[str, Any] = {"messages": prompts, "source": source}
        if secrets:
            data["secrets"] = secrets
        seq = await self._commit(ev.SYSTEM_PROMPT_SET, data)
        if secrets:
            await self._emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": secrets})

    async def set_messages(self, messages: list[dict[str, Any]], *, reason: str | None = None) -> None:
        """Replace the history with ``messages``, as the resume rule allows (docs/resume.md).

        A fresh store, or one this process cleared, accepts it. A store that loaded its own log ignores (and
        audits) a filtered transcript of its history and anything it does not recognise; it accepts the
        host's repair (applied to the complete history) and an explicit replacement (``reason`` given, e.g.
        ``reason="undo last turn"``). With ``resume_rule: strict`` it ignores every call once loaded.
        An ignored call is recorded as a ``transcript_ignored`` audit event and changes nothing.

        Raises ValueError if a message is invalid, ``reason`` is not a non-empty string, or there are too many
        messages for one event (nothing is stored); StoreClosedError after ``close()``; ReadOnlyError on a
        store opened ``readonly=True``; LogWriteError when the disk refuses the write (nothing was recorded);
        DatabaseError on PostgreSQL when the server fails.
        """
        self._check_writable()
        parts = ev.validate_messages(messages)
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise ValueError(f"reason must be a non-empty string saying why the history is replaced, got {reason!r}")
        self._end_replay()
        if len(parts) >= MAX_BATCH:
            raise ValueError(f"set_messages takes at most {MAX_BATCH - 1} messages, got {len(parts)}")
        parts, secrets = self._redact_all(messages, parts)
        payload = b"[" + b",".join(parts) + b"]"
        if self._loaded_from_file and self.config["resume_rule"] == "strict":
            await self._ignore(len(parts), payload, "strict", "resume_rule is strict: the store loaded its own log, "
                               "which is authoritative")
            return
        if not self._loaded_from_file or self._cleared_here:
            why = reason or ("after clear() in this process" if self._cleared_here else None)
            await self._replace(payload, why, secrets)
            return
        if reason is not None:
            await self._replace(payload, reason, secrets)
            return
        from .resume import FILTERED, REPAIR, classify

        offered = orjson.loads(payload)
        kind, merged = classify(self._full().messages, offered)
        if kind == REPAIR:
            assert merged is not None
            merged_payload = b"[" + b",".join(codec.dumps(m) for m in merged) + b"]"
            logger.warning("session %s: set_messages repaired the history (%d -> %d messages); accepted",
                           self.session_id, len(self._state.messages), len(merged))
            if secrets:  # the scanner's note, for the messages the repair added (at their places in merged)
                where = {id(m): i for i, m in enumerate(merged)}
                secrets = [{**e, "index": where[id(offered[e["index"]])]} for e in secrets
                           if id(offered[e["index"]]) in where] or None
            await self._replace(merged_payload, REPAIR, secrets)
            return
        if kind == FILTERED:
            await self._ignore(len(parts), payload, FILTERED, "a filtered transcript of the history the store "
                               "loaded from its own log, which is authoritative")
        else:
            await self._ignore(len(parts), payload, kind, "neither a filtered transcript, a repair of the history "
                               "nor an explicit replacement (pass reason=...); the store's own log is kept")

    async def _replace(self, payload: bytes, reason: str | None, secrets: list[dict[str, Any]] | None = None
                       ) -> None:
        """One ``messages_replaced`` event: the history becomes ``payload`` (a JSON array of messages)."""
        data: dict[str, Any] = {"messages": orjson.loads(payload)}
        extra = b""
        if reason is not None:
            data["reason"] = reason
            extra += b',"reason":%s' % codec.dumps(reason)
        if secrets:  # what kinds the scanner removed, never the secrets (docs/operations.md, "Secrets")
            data["secrets"] = secrets
            extra += b',"secrets":%s' % codec.dumps(secrets)
        seq = await self._commit(ev.MESSAGES_REPLACED, data, b'{"messages":%s%s}' % (payload, extra))
        if secrets:
            await self._emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": secrets})

    async def _ignore(self, count: int, payload: bytes, kind: str, reason: str) -> None:
        info = {"count": count, "digest": ev.digest(payload), "bytes": len(payload), "kind": kind, "reason": reason}
        logger.info("session %s: set_messages with %d messages ignored (%s)", self.session_id, count, reason)
        await self._commit(ev.TRANSCRIPT_IGNORED, info)
        await self._emit(EVENT_TRANSCRIPT_IGNORED, dict(info))

    def _redact_all(self, messages: list[dict[str, Any]], parts: list[bytes]
                    ) -> tuple[list[bytes], list[dict[str, Any]] | None]:
        """The messages' JSON with secrets redacted (when a scanner is set), and what was removed (or None)."""
        if self._scanner is None:
            return parts, None
        from .secret_scan import redact_messages

        _, parts, found = redact_messages(self._scanner, messages, parts)
        return parts, found or None


    async def replace_messages(self, messages: list[dict[str, Any]]) -> None:
        """Replace the history with ``messages`` as one ``messages_replaced`` event, whatever was loaded.

        Unlike ``set_messages`` this is not subject to the resume rule: it is the explicit "the history is now
        this list" of a framework adapter (a storage compaction, a ``load_state``). The log keeps every earlier
        event, so the history before the replacement stays readable with ``at(seq)``.

        Raises ValueError if a message is invalid or there are too many for one event (nothing is stored);
        StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL
        when the server fails.
        """
        self._check_writable()
        parts = ev.validate_messages(messages)
        if len(parts) >= MAX_BATCH:
            raise ValueError(f"replace_messages takes at most {MAX_BATCH - 1} messages, got {len(parts)}")
        self._end_replay()
        parts, secrets = self._redact_all(messages, parts)
        await self._replace(b"[" + b",".join(parts) + b"]", None, secrets)

    async def clear(self) -> None:
        """Empty the history (an event: it stays empty after a restart; the log keeps every earlier record).
        Raises StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL
        when the server fails.
        """
        self._check_writable()
        self._end_replay()
        await self._commit(ev.CLEARED, {})
        self._cleared_here = True

    def _resolve_key(self, message_index: int | None, seq: int | None) -> int:
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
        """Mark a message that compaction must always keep (an event: survives restarts).

        Give exactly one of ``message_index`` (its position in ``get_messages()``; negative counts from the
        end) or ``seq`` (the seq of the ``message_added`` event that added it). Raises ValueError if neither
        or both are given, or the index or seq names no message of the current history; StoreClosedError
        after ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk
        refuses the write (nothing was recorded); DatabaseError on PostgreSQL when the server fails.
        """
        self._end_replay()  # any other write ends a replay recognition (docs/resume.md)
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.PINNED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})

    async def unpin(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Undo ``pin`` for a message, named by ``message_index`` or ``seq`` as for ``pin``.

        Raises ValueError if neither or both are given, or they name no message of the current history;
        StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL
        when the server fails.
        """
        self._end_replay()  # any other write ends a replay recognition (docs/resume.md)
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.UNPINNED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})

    async def redact(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Hide a message from every view and export (a tombstone event; the log keeps its bytes).

        The message is named by ``message_index`` or ``seq`` as for ``pin``. Raises ValueError if neither or
        both are given, or they name no message of the current history; StoreClosedError after
        ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk
        refuses the write (nothing was recorded); DatabaseError on PostgreSQL when the server fails.
        """
        self._end_replay()  # any other write ends a replay recognition (docs/resume.md)
        key = self._resolve_key(message_index, seq)
        await self._commit(ev.REDACTED, {"key": key, "seq": split_key(key)[0], "index": split_key(key)[1]})
        if isinstance(self._log, FileEventLog):  # the audit snapshots of export_on_compact must not keep it
            from .snapshot import rewrite_audit_exports

            await rewrite_audit_exports(self, split_key(key)[0])

    async def erase(self, message_index: int | None = None, *, seq: int | None = None, index: int = 0,
                    reason: str = "") -> dict[str, Any]:
        """Remove a message's bytes from everything the store wrote (unlike ``redact``, which hides it).

        Name the message by ``message_index`` (its position in ``get_messages()``) or by ``seq`` (the record
        that added it; ``index`` is its position in a ``messages_replaced`` or ``system_prompt_set`` record,
        0 otherwise): ``seq`` can name a message no longer in the history (before a clear). Every copy of the
        same message bytes in the log is replaced by an ``erased`` tombstone keeping its seq and crc (the
        chain stays valid); the checkpoint is deleted; side files (torn tails, quarantine) and compaction
        exports in the session folder are rewritten without it; on PostgreSQL the rows are updated in one
        transaction. Views then behave as if the message were redacted. ``reason`` is stored in the tombstone. See
        docs/operations.md, "Erasure".

        Returns the receipt (a dict: what was erased, the SHA-256 and size of the removed bytes, where they
        had been) that ``verify_erasure`` and ``context-persistent verify SESSION --receipt FILE`` check later. Raises
        ValueError if the message is not named exactly once or names no message, or ``reason`` is not a
        string; StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses a write (the log is then unchanged); DatabaseError on
        PostgreSQL when the server fails (nothing changed).
        """
        from . import erasure
        from .projection import Projection

        if not isinstance(reason, str):
            raise ValueError(f"reason must be a string, got {type(reason).__name__}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_BATCH:
            raise ValueError(f"index must be an int from 0 to {MAX_BATCH - 1}, got {index!r}")
        self._check_writable()
        self._end_replay()
        while self._flush_task is not None:  # (batch mode: what is queued goes first)
            await asyncio.shield(self._flush_task)
        if (message_index is None) == (seq is None):
            raise ValueError("give exactly one of message_index (position in get_messages()) or seq")
        if message_index is not None:
            seq, index = split_key(self._resolve_key(message_index, None))
        elif isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= self._state.head_seq:
            raise ValueError(f"seq must be an int from 1 to {self._state.head_seq}, got {seq!r}")
        checkpoints = self._checkpoints
        if checkpoints._task is not None:  # a checkpoint being written would bring the message back
            await asyncio.shield(checkpoints._task)
        self._full()  # nothing may be read from the old checkpoint after it is deleted
        if isinstance(self._log, FileEventLog):
            receipt = erasure.erase_file(self, seq, index, reason)
        else:
            receipt = await erasure.erase_postgres(self, seq, index, reason)
        # The history as the new log tells it, from the start (an erase is rare; the next close checkpoints it).
        if checkpoints._lazy_file is not None:
            checkpoints._lazy_file.close()
            checkpoints._lazy_file = None
        checkpoints._lazy_source = None
        checkpoints.seq = checkpoints.position = checkpoints.loaded_seq = checkpoints.counted = 0
        self._state = await checkpoints._replay(self._log, Projection(), 0, None)
        self._epoch += 1
        self._view_cache = None
        self._count_hint = (-1, 0, None)
        logger.info("session %s: erased the message at seq %d index %d (%d record(s))", self.session_id, seq, index,
                    len(receipt["records"]))
        return receipt

    async def verify_erasure(self, receipt: dict[str, Any]) -> list[str]:
        """Check an erasure receipt (from ``erase``) against this session as stored now.

        Every file in the session folder (or every row of the session on PostgreSQL) is searched for the
        erased bytes by their SHA-256 and length, and the log must hold the tombstones the receipt lists.
        Returns the problems found (an empty list: the bytes are nowhere). Raises ValueError if ``receipt``
        is not a receipt, or belongs to another session; StoreClosedError after ``close()``.
        """
        from . import erasure

        self._check_open()
        erasure.check_receipt_shape(receipt)
        if receipt.get("session_id") != self.session_id:
            raise ValueError(f"the receipt is for session {receipt.get('session_id')!r}, not {self.session_id!r}")
        if isinstance(self._log, FileEventLog):
            return erasure.check_receipt(self._log.directory, receipt)
        return await erasure.check_receipt_postgres(self._log, receipt)

    # -- reading ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the store is closed")

    async def get_messages(self, last: int | None = None) -> list[dict[str, Any]]:
        """Returns the full history since the last clear/replacement, as a copy (changing it changes nothing
        stored); ``last=N``: only the newest N messages (a lazily opened store does not load the rest for them).

        Raises ValueError if ``last`` is not None or an integer >= 0; StoreClosedError after ``close()``.
        """
        self._check_open()
        if last is None:
            return _copy(self._full().messages)
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise ValueError(f"last must be None or an integer >= 0, got {last!r}")
        return _copy(self._state.messages[-last:]) if last else []

    async def get_conversation_view(self) -> list[dict[str, Any]]:
        """Returns the thread a person reads: user messages and assistant text only (views.py), as a copy.
        Raises StoreClosedError after ``close()``."""
        self._check_open()
        return _copy(conversation_view(self._full().messages))

    async def get_reasoning_view(self) -> list[dict[str, Any]]:
        """Returns the conversation plus the tool traces, whole: every message but system and developer ones,
        as a copy. Raises StoreClosedError after ``close()``."""
        self._check_open()
        return _copy(reasoning_view(self._full().messages))

    def _token_counts(self) -> list[int]:
        """Per-message counts, tokenising only messages not counted before (cached in the projection).

        Between epochs (only appends) uncounted messages can only be at the end, so the search for them
        starts where the last one stopped: a request after one new message does not scan the history.
        """
        state = self._full()
        tokens = state.tokens
        if state.counted_version != state.version or self._count_hint[2] is None:
            if self._count_hint[2] is None and self._counter.name != self._counter.requested:
                # The requested encoding did not load (estimator instead): counts restored from a checkpoint
                # were made with the real encoding, so count everything again with the active counter.
                tokens[:] = [None] * len(tokens)
            hint = self._count_hint
            start = hint[1] if hint[0] == self._epoch and hint[2] is tokens and hint[1] <= len(tokens) else 0
            try:
                first = tokens.index(None, start)
            except ValueError:
                first = -1
            if first >= 0:
                count = self._counter.count_message
                msgs = state.messages
                for i in range(first, len(tokens)):
                    if tokens[i] is None:
                        tokens[i] = count(msgs[i])
            self._count_hint = (self._epoch, len(tokens), tokens)
            state.counted_version = state.version
        return tokens  # type: ignore[return-value]

    def _count_indices(self, indices: Any) -> list[int | None]:
        """Count only the messages at ``indices`` (cached in the projection); the others stay as they are.

        For rebuilds that must not tokenise the whole history (windowed rebuilds, view extensions).
        """
        state = self._state
        tokens = state.tokens
        if self._count_hint[2] is None and self._counter.name != self._counter.requested:
            # Same rule as _token_counts: counts restored from a checkpoint were made with another encoding.
            tokens[:] = [None] * len(tokens)
            self._count_hint = (self._epoch, 0, tokens)
        count = self._counter.count_message
        msgs = state.messages
        for i in indices:
            if tokens[i] is None:
                tokens[i] = count(msgs[i])
        return tokens

    def _count_one(self, i: int) -> int:
        return self._count_indices((i,))[i]  # type: ignore[return-value]

    async def _count_large_off_loop(self) -> None:
        """Count the uncounted messages whose text is long (``LARGE_TEXT`` characters or more) in a worker
        thread, before a request view or a token count needs them: tokenising megabytes takes seconds, and
        tiktoken releases the GIL, so the event loop stays responsive meanwhile. Each message is looked at
        once, when it is new (``_large_seen``); a lazy history's unloaded part is never read. A second caller
        waits for a count in progress (else it would count the same message on the loop)."""
        while self._large_busy is not None:
            await asyncio.shield(self._large_busy)
        state = self._state
        tokens = state.tokens
        messages = state.messages
        seen, seen_n = self._large_seen
        n = len(tokens)
        first = seen_n if seen is tokens and seen_n <= n else 0
        if first >= n:
            return
        self._large_seen = (tokens, n)
        if self._count_hint[2] is None and self._counter.name != self._counter.requested:
            return  # (_token_counts is about to count everything again with the estimator)
        lazy = type(tokens) is LazyList and not tokens.loaded
        indices: Any = range(first, n)
        if lazy:
            indices = [i for i in tokens.known_indices() if i >= first]  # type: ignore[attr-defined]
        large = []
        for i in indices:
            if lazy:
                if tokens.get_known(i, 0) is not None:  # type: ignore[attr-defined]
                    continue
                message = messages.get_known(i)  # type: ignore[attr-defined]
            else:
                if tokens[i] is not None:
                    continue
                message = messages[i]
            if message is not None and len(message_text(message)) >= LARGE_TEXT:
                large.append((i, message))
        if not large:
            return
        self._counter.name  # noqa: B018 (load the encoding on the loop: a first load in a thread races its counts)
        busy = self._large_busy = asyncio.get_running_loop().create_future()
        try:
            for i, message in large:
                counted = await asyncio.to_thread(self._counter.count_message, message)
                if self._state is state and i < len(state.messages) and state.messages[i] is message:
                    state.tokens[i] = counted  # (unless the history changed meanwhile)
        finally:
            self._large_busy = None
            busy.set_result(None)

    async def get_token_count(self) -> int:
        """Returns the tokens of the full history under the active counter (see ``stats()['tokenizer']``).
        Raises StoreClosedError after ``close()``."""
        self._check_open()
        await self._count_large_off_loop()
        return sum(self._token_counts())

    def resolve_budget(self, token_budget: int | None = None, provider: Any = None) -> tuple[int, str]:
        """The token budget a request view gets: ``token_budget`` if given, else what ``provider`` reports
        (its context window minus its output reserve), else the configured ``max_tokens``; the safety margin
        is taken off.

        Returns ``(budget, source)``, the source being ``explicit``, ``provider`` or ``config``. Raises
        ValueError if ``token_budget`` is not a positive int or None.
        """
        return resolve_budget(token_budget, provider, max_tokens=self.config["max_tokens"],
                              safety_margin=self.config["safety_margin"])

    async def get_messages_for_request(self, token_budget: int | None = None, provider: Any = None
                                       ) -> list[dict[str, Any]]:
        """Returns the history made valid for a provider and, over the threshold, fitted to the budget.

        ``token_budget`` and ``provider`` choose the budget as ``resolve_budget`` does. The view is cached
        until the log or the budget changes, so repeated calls cost O(1). The list is new on
        every call; the message dicts in it belong to the cached view (never to the stored history): treat them
        as read-only, or set ``copy_request_view: true`` to get deep copies (see docs/compaction.md).
        Raises StoreClosedError after ``close()``, ValueError for a bad ``token_budget``.
        """
        self._check_open()
        self._end_replay()  # a request for the model: whatever was added is a real turn, not a replay
        await self._refresh_system_prompt()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._request_view(budget, source)
        if self.config["copy_request_view"]:
            return _copy(view.messages)
        return list(view.messages)

    async def _request_view(self, budget: int, source: str) -> RequestView:
        from . import compaction
        from .compaction.incremental import anchor, extend

        await self._count_large_off_loop()
        state = self._state
        version = state.version
        cached = self._view_cache
        if cached is not None and cached[1] == budget:
            if cached[0] == version:
                return cached[3].view if cached[3] is not None else cached[4]
            if cached[2] == self._epoch and cached[3] is not None:
                # Only messages were appended since: extend the view unless it now needs compacting.
                # Only the tail (from the anchor's user turn) is read: count just that, not the history.
                tokens_now = self._count_indices(range(cached[3].h, len(state.messages)))
                grown = extend(cached[3], state.messages, tokens_now, budget,  # type: ignore[arg-type]
                               self._compaction, self._counter.count_message, _copy)
                if grown is not None:
                    self._view_cache = (version, budget, self._epoch, grown[1], grown[0])
                    return grown[0]
        cfg = self._compaction
        self._max_budget = max(self._max_budget, budget)
        built, window, tokens, total = await self._build_windowed(state.messages, budget)
        messages = state.messages
        if built is None:  # a whole-history build: it reads everything (a lazy state loads the rest)
            messages = self._full().messages
            pinned_keys = state.pinned
            pinned = [k in pinned_keys for k in state.keys] if pinned_keys else [False] * len(messages)
            tokens = self._token_counts()
            total = sum(tokens)
        event_base = {"message_count": len(messages), "token_count": total, "budget": budget,
                      "budget_source": source, "strategy": cfg.strategy}
        if window is not None:
            event_base.update(token_count_exact=False, window={"start": window.start, "omitted": window.omitted})
        over = cfg.auto_compact and total >= cfg.compact_threshold * budget
        if over:
            await self._emit(EVENT_PRE_COMPACT, dict(event_base))
        if built is None:
            built = await compaction.build_request_view(messages, tokens, pinned, budget, cfg,
                                                        self._counter.count_message)
        stats = {**built.stats, "budget_source": source}
        if window is not None:
            # Only part of the history was counted: its total is a lower bound (before_tokens_exact False).
            stats.update(before_tokens=total, before_tokens_exact=False, before_messages=len(messages),
                         window={"start": window.start, "omitted": window.omitted})
        # The view's dicts share nested values with the history: copy once per change, so nothing a caller does
        # to a request view can reach the stored history.
        view = compaction.RequestView(_copy(built.messages), built.token_count, built.compacted, stats)
        base = anchor(view, messages, tokens, cfg, self._counter.count_message, history_tokens=total)
        self._view_cache = (version, budget, self._epoch, base, view)
        if stats.get("warning"):
            said = (budget, re.sub(r"\d[\d,]*", "N", stats["warning"]))
            level = logging.DEBUG if said in self._warned else logging.WARNING  # once per budget and kind
            self._warned.add(said)
            logger.log(level, "session %s: request view: %s", self.session_id, stats["warning"])
        if over or view.compacted:
            await self._emit(EVENT_POST_COMPACT, {**event_base, **stats})
        if view.compacted:
            self.last_compaction = {**stats, "at_seq": state.head_seq, "ts": codec.now_iso()}
            await self._emit(EVENT_COMPACTION, {
                "before_tokens": stats["before_tokens"], "after_tokens": stats["after_tokens"],
                "before_messages": stats["before_messages"], "after_messages": stats["after_messages"],
                "budget": budget, "budget_source": source, "strategy": stats.get("strategy_used") or cfg.strategy,
                **({"before_tokens_exact": False, "window": stats["window"]} if "window" in stats else {}),
            })
            await self._record_compaction(stats)
            await self._maybe_export_on_compact(stats)
        return view

    async def _build_windowed(self, messages: list[dict[str, Any]], budget: int
                              ) -> tuple[RequestView | None, Any, Any, int]:
        """A windowed rebuild (compaction/window.py) when the history is long and far over the budget.

        Returns (view, window, tokens, counted total), or (None, None, tokens, 0) for a whole-history build:
        a short history, a walk that reached the start, a group the window cannot see whole, or a windowed
        view over the budget (or truncated) although the kept-always part fits (the note can tip it over).
        """
        from . import compaction
        from .compaction.window import plan_window, reduced_input

        tokens: Any = self._state.tokens
        if len(messages) < self.WINDOW_MIN_MESSAGES:
            return None, None, tokens, 0
        pins = self._pinned_indices()
        window = plan_window(messages, self._count_one, pins, budget, self._compaction, self.WINDOW_MIN_MESSAGES)
        if window is None:
            return None, None, tokens, 0
        count = self._counter.count_message
        pinned = set(pins)
        msgs, toks, flags = reduced_input(messages, tokens, _Flags(pinned), window, count)
        built = await compaction.build_request_view(msgs, toks, flags, budget, self._compaction, count)
        if built.token_count > budget or built.stats.get("truncated"):
            # Over the budget or truncated to fit: fine when the kept-always part alone is over it (the whole
            # build would be too); otherwise the note tipped it over, so build from the whole history.
            request, _ = compaction._request(msgs, toks, flags, budget, self._compaction, count)
            if request.protected_tokens - toks[window.note_at] <= budget:
                return None, None, tokens, 0
        total = sum(toks) - toks[window.note_at]
        return built, window, tokens, total

    def _pinned_indices(self) -> list[int]:
        """History indices of the pinned messages, in order (a lazy state is searched in memory first)."""
        state = self._state
        if not state.pinned:
            return []
        keys = state.keys
        if type(keys) is LazyList and not keys.loaded:
            where = {keys.get_known(i): i for i in keys.known_indices()}
            if all(k in where for k in state.pinned):
                return sorted(where[k] for k in state.pinned)
            keys = self._full().keys  # a message pinned outside what the front section kept
        return [i for i, k in enumerate(keys) if k in state.pinned]

    async def _record_compaction(self, stats: dict[str, Any]) -> None:
        """Record a ``compacted`` audit event (what the view left out, and why), for `stats` and operators.

        Made only when a compaction changed the view. A request view is a read: it does not write or sync, so
        the record waits in memory and is appended in the same write as the next event (a message, a pin, ...)
        or at close. A crash before then loses the audit record only, never history (docs/compaction.md).
        """
        if self._readonly or self._closed:
            return
        record = {k: stats.get(k) for k in (
            "budget", "budget_source", "strategy_used", "before_tokens", "after_tokens", "before_messages",
            "after_messages", "groups_dropped", "outputs_masked", "truncated", "summarized", "warning")}
        if "window" in stats:
            record.update(before_tokens_exact=False, window=stats["window"])
        self._deferred.append((ev.COMPACTED, record, codec.dumps(record)))

    async def _maybe_export_on_compact(self, stats: dict[str, Any]) -> None:
        """With ``export_on_compact``: snapshot the reasoning view when a compaction dropped something, at most
        once per ``export_on_compact_every`` new events."""
        if not self.config["export_on_compact"] or self._readonly:
            return
        dropped = stats.get("groups_dropped", 0) or stats.get("outputs_masked", 0) or stats.get("truncated", 0)
        seq = self._state.head_seq
        if not dropped or (self._last_compaction_export_seq
                           and seq - self._last_compaction_export_seq < self.config["export_on_compact_every"]):
            return
        from .snapshot import export

        path = self._log_dir() / f"compaction-{seq:010d}.jsonl"
        try:
            await export(self, path, format="jsonl", view="reasoning")
        except Exception as e:  # an audit snapshot must never break a request
            logger.warning("session %s: export_on_compact to %s failed: %s", self.session_id, path, e)
            return
        self._last_compaction_export_seq = seq
        logger.info("session %s: compaction dropped content; reasoning view saved to %s", self.session_id, path)

    def _log_dir(self) -> Path:
        return self.storage_path / self.session_id

    async def compact(self, token_budget: int | None = None, provider: Any = None) -> int:
        """Returns the tokens the request view (at the budget ``token_budget`` and ``provider`` give, as for
        ``get_messages_for_request``) saves against the full history. Stores nothing.

        Raises StoreClosedError after ``close()``, ValueError for a bad ``token_budget``.
        """
        self._check_open()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._request_view(budget, source)
        return max(0, sum(self._token_counts()) - view.token_count)

    def _should_compact(self, token_count: int | None = None, budget: int | None = None) -> bool:
        """Whether a request view would be compacted (Amplifier's optional internal check)."""
        if token_count is None:
            token_count = sum(self._token_counts())
        if budget is None:
            budget = self.config["max_tokens"]
        return bool(self._compaction.auto_compact and token_count >= self._compaction.compact_threshold * budget)

    def stats(self) -> dict[str, Any]:
        """Returns counts and facts about this session: ``session_id``, ``path``, ``head_seq``, ``events``
        (count per event type), ``bytes`` (the log's size; None on PostgreSQL), ``messages``, ``pinned``,
        ``tokens``, ``tokenizer``, ``tokenizer_exact``, ``fsync``, ``loaded_from_file``, ``last_compaction``
        (None, or the last compaction that changed the request view: ``at_seq``, ``ts``, ``budget``,
        ``budget_source``, ``strategy_used``, tokens and messages before and after, what was dropped, masked
        or truncated) and ``checkpoint``. Raises StoreClosedError after ``close()``.
        """
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
            "tokenizer_requested": self._counter.asked,
            "tokens_bounded": self._counter.bounded,
            "fsync": self._fsync,
            "reserve_tail": self.config["reserve_tail"],
            "loaded_from_file": self._loaded_from_file,
            "last_compaction": None if self.last_compaction is None else {
                k: self.last_compaction.get(k) for k in (
                    "at_seq", "ts", "budget", "budget_source", "strategy_used", "before_tokens", "after_tokens",
                    "before_messages", "after_messages", "groups_dropped", "outputs_masked", "truncated", "warning",
                    *(("before_tokens_exact", "window") if "window" in self.last_compaction else ()))},
            "checkpoint": {"loaded_seq": self._checkpoints.loaded_seq, "seq": self._checkpoints.seq,
                           "ignored": self._checkpoints.ignored, "error": self._checkpoints.error},
        }

    # -- snapshots, forks, live tail (snapshot.py, follow.py; docs/snapshots.md) --------------------
    async def export(self, path: str | os.PathLike[str], *, format: str | None = None, view: str = "full",
                     at_seq: int | None = None, token_budget: int | None = None, progress: Any = None
                     ) -> dict[str, Any]:
        """Write a snapshot of a view, at the head or right after ``at_seq``, to ``path`` atomically.

        ``format`` is ``jsonl``, ``json`` or ``markdown`` (None: from the file name, ``.md``/``.markdown``
        markdown, ``.json`` json, else jsonl); ``view`` is ``full``, ``conversation``, ``reasoning`` or
        ``request`` (with ``token_budget``); ``progress`` (``progress(done, total)``) is called as it writes. The snapshot
        format is in docs/snapshots.md.

        Returns the header it wrote. Raises ValueError for a bad format, view or ``at_seq``, or a
        ``token_budget`` with a view other than ``request``; FileNotFoundError if the target folder does
        not exist; StoreClosedError after ``close()``.
        """
        from .snapshot import export

        return await export(self, path, format=format, view=view, at_seq=at_seq, token_budget=token_budget,
                            progress=progress)

    async def fork(self, new_session_id: str, *, at_seq: int | None = None) -> dict[str, Any]:
        """Create the new session ``new_session_id`` with this history and pins as of ``at_seq`` (default: the
        head); its ``session_started`` names this session and the seq as its parent. This session is only read.

        Returns a summary (``session_id``, ``parent``, ``seq``, ``messages``, ``pinned``, ``head_seq``,
        ``path``). Raises SessionExistsError if the new session exists, ValueError for a bad id or
        ``at_seq``.
        """
        from .snapshot import fork

        return await fork(self, new_session_id, at_seq=at_seq)

    async def at(self, seq: int) -> "PersistentContextManager":
        """Returns a read-only store showing this session as it was right after event ``seq`` (close it after
        use); it has every read method. Raises ValueError if ``seq`` is not between 1 and ``head_seq``,
        StoreClosedError after ``close()``."""
        from .snapshot import open_at

        self._check_open()
        return await open_at(self, seq)

    def follow(self, after_seq: int | None = None) -> Any:
        """Returns an async iterator over the records (dicts: ``seq``, ``ts``, ``type``, ``data``) appended by
        any process after ``after_seq`` (default: this store's head), as they arrive; none is missed or
        repeated (docs/snapshots.md). Raises StoreClosedError after ``close()``; iterating raises
        LogChangedError if records already reported are rewritten.
        """
        self._check_open()
        return self._log.follow(self._state.head_seq if after_seq is None else after_seq)

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
        """Flush pending writes, write a checkpoint if due and release the session's lock (idempotent).

        Raises LogWriteError or DatabaseError if the pending writes cannot be flushed.
        """
        if self._closed:
            return
        self._end_replay()  # an unconfirmed replay stays as written: duplicates are better than loss
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)
        if self._deferred and not self._readonly:
            try:  # the audit records of the last request views (close syncs the log)
                await self._commit_with_deferred([])  # (no group commit is pending by now)
            except Exception as e:
                logger.warning("session %s: could not record %d compaction audit event(s): %s", self.session_id,
                               len(self._deferred), e)
        self._closed = True
        try:
            await self._checkpoints.close(self._state, self._log, self._tokenizer_name)
        finally:
            await self._log.close()

    async def __aenter__(self) -> "PersistentContextManager":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<PersistentContextManager session={self.session_id!r} seq={self._state.head_seq} path={self._log.path}>"
