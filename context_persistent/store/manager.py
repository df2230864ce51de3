"""PersistentContextManager: the store's public face, delegating to its parts (docs/architecture.md).

The parts, each in its own module: ``session.Session`` (what they share), ``writer.Writer`` (events to the
log), ``appends.Appends`` (messages coming in), ``system_prompt.SystemPrompt``, ``edits.HistoryEdits``,
``ledger.TokenLedger`` (token counts), ``request_views.RequestViews`` and ``lifecycle.Lifecycle`` (open, load,
close) load with the first store, so ``import context_persistent`` stays cheap; ``erase.Eraser`` with the first erase.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model import events as ev
from ..model.budget import resolve_budget
from .config import COMPACTION_KEYS, DEFAULTS, KNOWN_KEYS, RESUME_RULES, check_config
from .delegation import _kept, _Limit
from .opening import Opening, open_store
from ..storage.eventlog import EventLog

if TYPE_CHECKING:  # (the parts are imported where the store is built: they load with the first store)
    from ..model.projection import Projection

__all__ = ["COMPACTION_KEYS", "DEFAULTS", "KNOWN_KEYS", "RESUME_RULES", "PersistentContextManager"]


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

    if TYPE_CHECKING:  # what the properties below hold, for type checkers
        session_id: str
        storage_path: Path
        config: dict[str, Any]
        hooks: Any
        recovered: Any
        last_compaction: dict[str, Any] | None
    else:  # (properties: documented in docs/api.md)
        session_id = _kept("_s", "session_id", "The session's id: its folder name under ``storage_path``.")
        storage_path = _kept("_s", "storage_path", "The root folder of the sessions (a Path).")
        config = _kept("_s", "config", "The checked configuration (what ``check_config`` returns).")
        hooks = _kept("_s", "hooks", "The host's hooks (their ``emit`` receives the store's events), or None.")
        recovered = _kept("_s", "recovered", "The torn last record cut at open (where it was, its length, where "
                          "its bytes were saved), or None.")
        last_compaction = _kept("_s", "last_compaction", "The stats of the last compaction that changed the request "
                                "view (as ``stats()['last_compaction']`` shows them), or None.")
    #: A rebuild of a history at least this long reads only the newest messages that can fit the budget
    #: (plus what must be kept): compaction/window.py. Tests lower it.
    WINDOW_MIN_MESSAGES = _Limit("_views", "window_min", 4096)
    # What hooks, tools and tests reach for: the host's prompt factory (hooks wrap it), the state and the log.
    _system_prompt_factory = _kept("_prompt", "factory")
    _state = _kept("_s", "state")
    _log = _kept("_s", "log")
    _counter = _kept("_s", "counter")
    _checkpoints = _kept("_s", "checkpoints")
    _epoch = _kept("_s", "epoch")
    _loaded_from_file = _kept("_s", "loaded_from_file")
    _view_cache = _kept("_views", "cache")
    _deferred = _kept("_writer", "deferred")

    def __init__(self, *, storage_path: Path, session_id: str, log: EventLog | None = None,
                 config: dict[str, Any] | None = None, hooks: Any = None) -> None:
        if log is None or config is None:  # (the natural spelling of a user who has not read open's docs)
            raise TypeError(
                "a PersistentContextManager is opened, not constructed: use "
                "`store = await PersistentContextManager.open(storage_path=..., session_id=...)` or "
                "`async with PersistentContextManager.open(storage_path=..., session_id=...) as store:` "
                "(open replays the session's log and takes its writer lock)")
        from .appends import Appends
        from .edits import HistoryEdits
        from .ledger import TokenLedger
        from .lifecycle import Lifecycle
        from .request_views import RequestViews
        from .session import Session
        from .system_prompt import SystemPrompt
        from .usage import UsageMeter
        from .writer import Writer

        self._s = s = Session(storage_path=storage_path, session_id=session_id, log=log, config=config, hooks=hooks)
        self._writer = writer = Writer(s)
        self._ledger = TokenLedger(s)
        self._views = RequestViews(s, self._ledger, writer, self._export_reasoning)
        s.checkpoints.front_hints = self._views.front_hints
        s.checkpoints.token_total = self._ledger.summed
        s.checkpoints.view_prefix = self._views.bounds.hint
        self._prompt = SystemPrompt(s, writer)
        self._appends = Appends(s, writer, self._prompt)
        self._edits = HistoryEdits(s, writer, self._appends, self)
        self._usage = UsageMeter(s, writer, self._ledger)
        self._life = Lifecycle(s, writer, self._appends, self._usage.rebuild)

    # -- opening (lifecycle.py)  -------------------------------------------------------------
    @classmethod
    def open(cls, *, storage_path: str | os.PathLike[str], session_id: str, hooks: Any = None,
             readonly: bool = False, **config: Any) -> "Opening":
        """Open (creating if needed) a session's store and replay its log.

        Awaitable and an async context manager: ``store = await PersistentContextManager.open(...)``, or
        ``async with PersistentContextManager.open(...) as store:`` (``async with await ...`` works too), which
        closes the store on leaving the block.

        ``storage_path`` is the root folder (``~`` is expanded; created with mode 0700 if missing) and
        ``session_id`` the session's folder name in it. ``hooks`` receives the store's events (``emit``).
        ``readonly`` True opens without the writer lock (no writes; the session must exist). ``config``
        takes the keys of docs/configuration.md.

        Returns the open store. Raises SessionLockedError if another writer holds it, SessionNotFoundError
        for a read-only open of a session that does not exist, LogCorruptedError if a record before the end
        fails verification, UnsupportedFormatError for a log of a newer format, DatabaseError when the
        PostgreSQL backend cannot be reached, ValueError for a bad session id or configuration.
        """
        return Opening(open_store(cls, storage_path=storage_path, session_id=session_id, hooks=hooks,
                                  readonly=readonly, **config))

    @staticmethod
    def check_config(config: dict[str, Any]) -> dict[str, Any]:
        """Check ``config`` (the keys of docs/configuration.md) without opening anything.

        Returns the complete configuration: defaults filled in, the compaction settings parsed, the backend
        resolved (a ``dsn`` alone selects PostgreSQL). Raises ValueError naming the key and the rule for an
        unknown key or a bad value.
        """
        return check_config(config)

    # -- properties -----------------------------------------------------------------------------------
    @property
    def loaded_from_file(self) -> bool:
        """True when the log held history (a message, a replacement, a clear or a system prompt) when this store
        opened.

        A log that exists but holds only ``session_started`` counts as fresh (False): there is nothing of
        ours to protect, so ``set_messages`` is accepted. A log that was cleared counts as loaded (True): the
        clear is part of the authoritative history and a stale transcript must not undo it.
        """
        return self._s.loaded_from_file

    @property
    def path(self) -> Any:
        """Where the log lives: ``<storage>/<session>/events.jsonl`` for files, a description for PostgreSQL."""
        return self._s.log.path

    @property
    def head_seq(self) -> int:
        """The seq of the last event applied (0 for an empty log): what ``at``, ``fork`` and ``follow`` count in."""
        return self._s.state.head_seq

    @property
    def history_version(self) -> Any:
        """A value that changes whenever the history may have (an event applied, an erase); compare it with
        ``==`` only. ``replace_messages(..., if_version=...)`` replaces only while it is unchanged."""
        return self._s.version

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._s.closed

    @property
    def tokenizer(self) -> str:
        """The name of the active token counter (a tiktoken encoding, or ``chars/4`` when it fell back)."""
        return self._s.counter.name

    # -- writing (appends.py, system_prompt.py, edits.py, erase.py) -------------------------------------
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
        await self._appends.add_message(message)

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
        await self._appends.add_messages(messages)

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
        self._prompt.set_factory(factory)

    async def set_messages(self, messages: list[dict[str, Any]], *, reason: str | None = None) -> None:
        """Replace the history with ``messages``, as the resume rule allows (docs/resume.md).

        A fresh store, or one this process cleared, accepts it. A store that loaded its own log ignores (audits) a
        filtered transcript of its history and anything it does not recognise; it accepts the host's repair (of the
        complete history) and an explicit replacement (a ``reason``, e.g. ``"undo last turn"``). With ``resume_rule:
        strict`` it ignores every call once loaded. An ignored call changes nothing; its ``transcript_ignored`` audit
        record goes out with the next append or the close: a crash first loses it, never a message.

        Raises ValueError if a message is invalid, ``reason`` is not a non-empty string, or there are too many
        messages for one event (nothing is stored); StoreClosedError after ``close()``; ReadOnlyError on a store
        opened ``readonly=True``; LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError
        on PostgreSQL when the server fails.
        """
        await self._edits.set_messages(messages, reason)

    async def replace_messages(self, messages: list[dict[str, Any]], *, if_version: Any = None) -> None:
        """Replace the history with ``messages`` as one ``messages_replaced`` event, whatever was loaded.

        Unlike ``set_messages`` this is not subject to the resume rule: it is the explicit "the history is now
        this list" of a framework adapter (a storage compaction, a ``load_state``). The log keeps every earlier
        event, so the history before the replacement stays readable with ``at(seq)``. ``if_version`` (the
        ``history_version`` read with the history the list was made from): replace only if nothing was appended
        or erased since (compare-and-replace), else raise ConcurrencyError and store nothing.

        Raises ValueError if a message is invalid or there are too many for one event (nothing is stored);
        ConcurrencyError as said; StoreClosedError after ``close()``; ReadOnlyError if ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL.
        """
        await self._edits.replace_messages(messages, if_version)

    async def clear(self) -> None:
        """Empty the history (an event: it stays empty after a restart; the log keeps every earlier record).
        Raises StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL
        when the server fails.
        """
        await self._edits.clear()

    async def pin(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Mark a message that compaction must always keep (an event: survives restarts).

        Give exactly one of ``message_index`` (its position in ``get_messages()``; negative counts from the
        end) or ``seq`` (the seq of the ``message_added`` event that added it). Raises ValueError if neither
        or both are given, or the index or seq names no message of the current history; StoreClosedError
        after ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk
        refuses the write (nothing was recorded); DatabaseError on PostgreSQL when the server fails.
        """
        await self._edits.mark(ev.PINNED, message_index, seq)

    async def unpin(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Undo ``pin`` for a message, named by ``message_index`` or ``seq`` as for ``pin``.

        Raises ValueError if neither or both are given, or they name no message of the current history;
        StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses the write (nothing was recorded); DatabaseError on PostgreSQL
        when the server fails.
        """
        await self._edits.mark(ev.UNPINNED, message_index, seq)

    async def redact(self, message_index: int | None = None, *, seq: int | None = None) -> None:
        """Hide a message from every view and export (a tombstone event; the log keeps its bytes).

        The message is named by ``message_index`` or ``seq`` as for ``pin``. Raises ValueError if neither or
        both are given, or they name no message of the current history; StoreClosedError after
        ``close()``; ReadOnlyError on a store opened ``readonly=True``; LogWriteError when the disk
        refuses the write (nothing was recorded); DatabaseError on PostgreSQL when the server fails.
        """
        await self._edits.mark(ev.REDACTED, message_index, seq)

    async def pop_message(self) -> dict[str, Any] | None:
        """Remove the newest message of the history (a ``redacted`` event: the log keeps it). Returns it, or None
        if the history is empty; concurrent calls each take a different message. Raises as ``redact`` does."""
        return await self._edits.pop()

    async def erase(self, message_index: int | None = None, *, seq: int | None = None, index: int = 0,
                    reason: str = "", vacuum: bool | str = False) -> dict[str, Any]:
        """Remove a message's bytes from everything the store wrote (unlike ``redact``, which hides it).

        Name the message by ``seq`` (the record that added it; ``index`` is its position in a
        ``messages_replaced`` or ``system_prompt_set`` record, 0 otherwise), which names the same message for
        ever, even one no longer in the history (before a clear); or by ``message_index``, its position in
        ``get_messages()`` *now*: each erase or redaction shifts the positions after it, so never erase several
        positions taken from one earlier listing (the receipt's ``seq`` says which message was erased). Every copy of the
        same message bytes in the log is replaced by an ``erased`` tombstone keeping its seq and crc (the
        chain stays valid); the checkpoint is deleted; side files (torn tails, quarantine) and compaction
        exports in the session folder are rewritten without it; on PostgreSQL the rows are updated in one
        transaction; ``vacuum`` (PostgreSQL only): True then runs VACUUM on the tables, ``"full"`` VACUUM FULL
        (the old row versions stay in the tables until one runs). Views then behave as if the message were redacted. ``reason`` is
        stored in the tombstone. See docs/operations.md, "Erasure".

        Returns the receipt (a dict: what was erased, the key and keyed digest of the removed bytes, where they
        had been, what erase does not reach: ``not_covered``) that ``verify_erasure`` and ``context-persistent verify SESSION --receipt FILE`` check later. Raises
        ValueError if the message is not named exactly once or names no message, or ``reason`` is not a
        string; StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``;
        LogWriteError when the disk refuses a write (the log is then unchanged); DatabaseError on
        PostgreSQL when the server fails (nothing changed).
        """
        return await self._eraser.erase(message_index, seq, index, reason, vacuum)

    async def search(self, query: str, *, all_sessions: bool = False, role: str | None = None, since: Any = None,
                     limit: int = 20, all_messages: bool = False, **ranking: Any) -> list[Any]:
        """Full-text search of this session (``all_sessions``: of every session of its storage) through the
        storage's search index, caught up first (docs/search.md).

        ``query`` is in SQLite FTS5's language: words, ``"phrases"``, ``prefix*``, ``AND``/``OR``/``NOT``,
        ``NEAR(a b, N)``, ``tools:NAME``. ``role`` keeps one role's messages, ``since`` those from a time on (a
        datetime, ``2025-01-31``, ``2025-01-31T09:30``, or an age: ``7d``, ``12h``, ``30m``), ``limit`` the best
        ``limit`` hits (1 to 10,000). ``all_messages`` also finds messages the views no longer show (cleared,
        replaced) that the log still holds. On PostgreSQL, the schema's search tables (docs/search.md).
        ``ranking``: ``window=N`` or ``exhaustive=True``, the newest matches ranked (docs/search.md, "Ranking").

        Returns ``SearchResults``: a list of ``SearchHit`` (session id, seq, index, role, time, a snippet with the
        match in brackets, score, whether the views show it), best first, and ``.ranking``.

        Raises ``QueryError`` (a ValueError) for a query that is not valid, ValueError for a bad filter.
        """
        from ..operations.search import search

        self._check_open()
        log: Any = self._s.log
        where = {"dsn": log.dsn, "pg_schema": log.schema} if self._s.config["backend"] != "file" else {}
        return await asyncio.to_thread(asyncio.run, search(
            self._s.storage_path, query, session_id=None if all_sessions else self.session_id, role=role,
            since=since, limit=limit, all_messages=all_messages, **where, **ranking))

    async def verify_erasure(self, receipt: dict[str, Any]) -> list[str]:
        """Check an erasure receipt (from ``erase``) against this session as stored now.

        Every file in the session folder (or every row of the session on PostgreSQL) is searched for the
        erased bytes by their keyed digest and length, and the log must hold the tombstones the receipt lists.
        Returns the problems found (an empty list: the bytes are nowhere). Raises ValueError if ``receipt``
        is not a receipt, or belongs to another session; StoreClosedError after ``close()``.
        """
        return await self._eraser.verify(receipt)

    # -- reading (ledger.py, request_views.py, views.py) ------------------------------------------------
    async def get_messages(self, last: int | None = None) -> list[dict[str, Any]]:
        """Returns the full history since the last clear/replacement, as a copy (changing it changes nothing
        stored; a dict equal to what the previous call gave at its place is given again: session.history_copy);
        ``last=N``: only the newest N messages (a lazily opened store does not load the rest for them).

        Raises ValueError if ``last`` is not None or an integer >= 0; StoreClosedError after ``close()``.
        """
        s = self._s
        s.check_open()
        if last is None:
            return s.history_copy()
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise ValueError(f"last must be None or an integer >= 0, got {last!r}")
        return ev.copy_json(s.state.messages[-last:]) if last else []

    async def iter_messages(self, chunk: int = 256) -> AsyncIterator[dict[str, Any]]:
        """Yields the full history, oldest first, as ``get_messages()`` returns it, one copy at a time.

        Unlike ``get_messages()`` it never holds the history in memory: messages are read from the log (on
        PostgreSQL, its table) as the iteration reaches them (docs/architecture.md, "Bounded memory"), and the event loop runs
        other tasks every ``chunk`` messages. It shows the history as it was when the iteration began (later
        changes are not seen). Raises StoreClosedError after ``close()`` (also when the store is closed while
        iterating).
        """
        async for message in self._s.iter_messages(chunk):
            yield message

    async def get_conversation_view(self) -> list[dict[str, Any]]:
        """Returns the thread a person reads: user messages and assistant text only (views.py), as a copy.
        Raises StoreClosedError after ``close()``."""
        from ..model.views import conversation_view

        self._s.check_open()
        return ev.copy_json(conversation_view(self._s.full().messages))

    async def get_reasoning_view(self) -> list[dict[str, Any]]:
        """Returns the conversation plus the tool traces, whole: every message but system and developer ones,
        as a copy. Raises StoreClosedError after ``close()``."""
        from ..model.views import reasoning_view

        self._s.check_open()
        return ev.copy_json(reasoning_view(self._s.full().messages))

    async def get_token_count(self) -> int:
        """Returns the tokens of the full history under the active counter (see ``stats()['tokenizer']``).
        Messages not counted yet (a history replayed without counting) are counted in worker threads, a run
        at a time, so the event loop stays responsive; the next checkpoint records the counts and their
        total. Raises StoreClosedError after ``close()``."""
        self._s.check_open()
        await self._ledger.count_large_off_loop()
        await self._ledger.count_missing_off_loop()
        self._s.check_open()
        return self._ledger.total()

    def resolve_budget(self, token_budget: int | None = None, provider: Any = None) -> tuple[int, str]:
        """The token budget a request view gets: ``token_budget`` if given, else what ``provider`` reports
        (its context window minus its output reserve), else the configured ``max_tokens``; the safety margin
        is taken off.

        Returns ``(budget, source)``, the source being ``explicit``, ``provider`` or ``config``. Raises
        ValueError if ``token_budget`` is not a positive int or None.
        """
        config = self._s.config
        return resolve_budget(token_budget, provider, max_tokens=config["max_tokens"],
                              safety_margin=config["safety_margin"])

    async def get_messages_for_request(self, token_budget: int | None = None, provider: Any = None
                                       ) -> list[dict[str, Any]]:
        """Returns the history made valid for a provider and, over the threshold, fitted to the budget.

        ``token_budget`` and ``provider`` choose the budget as ``resolve_budget`` does, in the provider's tokens;
        with ``calibrate`` (the default) the view is fitted so that the provider's count of it, as calibrated
        from its reports (``record_usage``), stays inside that budget (docs/tokens.md). The view is cached
        until the log or the budget changes, so repeated calls cost O(1). The list is new on
        every call; the message dicts in it belong to the cached view (never to the stored history): treat them
        as read-only, or set ``copy_request_view: true`` to get deep copies (see docs/compaction.md).
        Raises StoreClosedError after ``close()``, ValueError for a bad ``token_budget``.
        """
        self._s.check_open()
        self._appends.end_replay()  # a request for the model: whatever was added is a real turn, not a replay
        await self._prompt.refresh()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._usage.view_for(self._views, budget, provider, source)
        exact = view.stats.get("token_count_exact", True)
        self._usage.serve(self._s.state.head_seq, view.token_count if exact else self._views.exact_total(view),
                          provider)
        if self._s.config["copy_request_view"]:
            return ev.copy_json(view.messages)
        return list(view.messages)

    async def compact(self, token_budget: int | None = None, provider: Any = None) -> int:
        """Returns the tokens the request view (at the budget ``token_budget`` and ``provider`` give, as for
        ``get_messages_for_request``) saves against the full history. Stores nothing.

        Raises StoreClosedError after ``close()``, ValueError for a bad ``token_budget``.
        """
        self._s.check_open()
        budget, source = self.resolve_budget(token_budget, provider)
        view = await self._usage.view_for(self._views, budget, provider, source, exact=True)
        return max(0, self._ledger.total() - view.token_count)

    def _should_compact(self, token_count: int | None = None, budget: int | None = None) -> bool:
        """Whether a request view would be compacted (Amplifier's optional internal check)."""
        return self._views.should_compact(token_count, budget)

    def stats(self) -> dict[str, Any]:
        """Returns counts and facts about this session: ``session_id``, ``path``, ``head_seq``, ``events``
        (count per event type), ``bytes`` (the log's size; None on PostgreSQL), ``messages``, ``pinned``,
        ``tokens``, ``tokenizer``, ``tokenizer_exact``, ``fsync``, ``loaded_from_file``, ``last_compaction``
        (None, or the last compaction that changed the request view: ``at_seq``, ``ts``, ``budget``,
        ``budget_source``, ``strategy_used``, tokens and messages before and after, what was dropped, masked
        or truncated), ``checkpoint``; and where the numbers come from: ``sources`` (``tokens``: "estimated
        (cl100k_base)" or "exact (...)"; ``budget``: "calibrated x1.38 + 2,100 fixed from 14 reports" or the
        prior in use; ``last_usage``: "reported by the provider"), ``calibration`` (its slope, overhead,
        reports, prior and the budgets of the last request) and ``last_usage`` (the newest report's data, or
        None). Raises StoreClosedError after ``close()``.
        """
        s = self._s
        s.check_open()
        return {**s.stats(self._ledger.total()), **self._usage.stats(s.counter.name, s.counter.exact)}

    async def record_usage(self, usage: Any, *, provider: str | None = None, model: str | None = None,
                           request_seq: int | None = None, estimated_tokens: int | None = None,
                           source: str = "api", id: str | None = None,
                           input_includes_cache: bool | None = None) -> dict[str, Any] | None:
        """Record what a provider reported for a request: a ``usage_reported`` event (docs/format.md).

        ``usage`` is a mapping or an object (amplifier_core ``Usage``, a pydantic model, ...) with
        ``input_tokens`` (or ``prompt_tokens``), ``output_tokens`` (or ``completion_tokens``) and optionally
        ``cache_read_tokens``, ``cache_write_tokens``, ``reasoning_tokens``, ``cost_usd``. ``provider`` and
        ``model`` name who counted (the calibration is kept per provider and model). ``request_seq`` and
        ``estimated_tokens`` default to the request view this store served last (the request the report
        answers; a view made from bounds, not counted yet, is named by the record's ``view`` and its count
        paired when the store next counts: docs/tokens.md). ``id`` (the provider's response id) makes recording the same report again a no-op.
        ``input_includes_cache``: whether ``input_tokens`` already count the cached tokens (OpenAI: yes;
        Anthropic: no; None: by the provider's name). The report calibrates the meter at once; the record is
        written with the next append (or at close, or by the next group commit): never a write of its own on
        the request path, and a kill before then loses this report, never repeats one.

        Returns the event data (None if this ``id`` was recorded already). Raises ValueError for negative or
        non-integer tokens, a negative cost, an unknown ``source``; TypeError if ``usage`` has no token
        fields; StoreClosedError after ``close()``; ReadOnlyError on a store opened ``readonly=True``.
        """
        return self._usage.record(usage, provider=provider, model=model, request_seq=request_seq,
                                  estimated_tokens=estimated_tokens, source=source, id=id,
                                  input_includes_cache=input_includes_cache)

    # -- snapshots, forks, live tail (snapshot.py, follow.py; docs/snapshots.md) ------------------------
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
        from ..transfer.snapshot import export

        return await export(self, path, format=format, view=view, at_seq=at_seq, token_budget=token_budget,
                            progress=progress)

    async def fork(self, new_session_id: str, *, at_seq: int | None = None) -> dict[str, Any]:
        """Create the new session ``new_session_id`` with this history and pins as of ``at_seq`` (default: the
        head); its ``session_started`` names this session and the seq as its parent. This session is only read.

        Returns a summary (``session_id``, ``parent``, ``seq``, ``messages``, ``pinned``, ``head_seq``,
        ``path``). Raises SessionExistsError if the new session exists, ValueError for a bad id or
        ``at_seq``.
        """
        from ..transfer.new_session import fork

        return await fork(self, new_session_id, at_seq=at_seq)

    async def at(self, seq: int) -> "PersistentContextManager":
        """Returns a read-only store showing this session as it was right after event ``seq`` (close it after
        use); it has every read method. Raises ValueError if ``seq`` is not between 1 and ``head_seq``,
        StoreClosedError after ``close()``."""
        from ..transfer.time_travel import open_at

        self._s.check_open()
        return await open_at(self, seq)

    def follow(self, after_seq: int | None = None) -> Any:
        """Returns an async iterator over the records (dicts: ``seq``, ``ts``, ``type``, ``data``) appended by
        any process after ``after_seq`` (default: this store's head), as they arrive; none is missed or
        repeated (docs/snapshots.md). Raises StoreClosedError after ``close()``; iterating raises
        LogChangedError if records already reported are rewritten.
        """
        self._s.check_open()
        return self._s.log.follow(self.head_seq if after_seq is None else after_seq)

    # -- closing (lifecycle.py) -------------------------------------------------------------------------
    async def close(self) -> None:
        """Flush pending writes, write a checkpoint if due and release the session's lock (idempotent).

        Raises LogWriteError or DatabaseError if the pending writes cannot be flushed.
        """
        await self._life.close()

    async def __aenter__(self) -> "PersistentContextManager":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<PersistentContextManager session={self.session_id!r} seq={self.head_seq} path={self.path}>"

    # -- for the modules beside the store (snapshot.py, semantic.py, the CLI) and its parts -------------
    def _check_open(self) -> None:
        self._s.check_open()

    def _full(self) -> Projection:
        return self._s.full()

    def _log_dir(self) -> Path:
        return self._s.log_dir()

    def _token_counts(self) -> list[int]:
        return self._ledger.counts()

    async def _commit(self, type_: str, data: Any) -> int:
        return await self._writer.commit(type_, data)

    async def _export_reasoning(self, path: Path) -> Any:
        from ..transfer.snapshot import export
        return await export(self, path, format="jsonl", view="reasoning")

    @functools.cached_property
    def _eraser(self) -> Any:  # (erase.Eraser: made by the first erase or verify_erasure, which a turn never makes)
        from .erase import Eraser
        return Eraser(self._s, self._writer, self._appends, self._edits, self._forget_derived, self)

    def _forget_derived(self) -> None:
        self._ledger.forget()
        self._views.cache = None
