"""What the parts of one open store share: its identity, configuration, log, projection, token counter,
checkpoints and flags, with the checks every part makes and the hooks it reports through."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ..model import codec
from ..errors import ReadOnlyError, StoreClosedError
from ..storage.eventlog import EventLog
from ..storage.backends import pager_for
from ..model.projection import Projection
from ..model.tokens import TokenCounter

if TYPE_CHECKING:
    from ..model.compaction import CompactionConfig

logger = logging.getLogger("context_persistent")

PROGRAM = "context-persistent"
EVENT_RECOVERED = "context:recovered"
EVENT_PRE_COMPACT = "context:pre_compact"
EVENT_POST_COMPACT = "context:post_compact"
EVENT_COMPACTION = "context:compaction"
EVENT_TRANSCRIPT_IGNORED = "context:transcript_ignored"
EVENT_SECRET_REDACTED = "context:secret_redacted"

#: The fields of a compaction's stats that ``stats()['last_compaction']`` shows.
_COMPACTION_FIELDS = ("at_seq", "ts", "budget", "budget_source", "strategy_used", "before_tokens", "after_tokens",
                      "before_messages", "after_messages", "groups_dropped", "outputs_masked", "truncated", "warning")


class Session:
    """One open session as every part of the store sees it.

    ``state`` is the projection (replaced whole at load and after an erase), ``epoch`` counts the applied
    events that can change a view anywhere (everything but ``message_added`` and audit events), ``closed``,
    ``readonly``, ``loaded_from_file`` and ``cleared_here`` are the flags the parts decide by.
    """

    def __init__(self, *, storage_path: Path, session_id: str, log: EventLog, config: dict[str, Any],
                 hooks: Any = None) -> None:
        from ..storage.checkpoint import Checkpointer, checkpoint_store_for

        self.storage_path = storage_path
        self.session_id = session_id
        self.hooks = hooks
        self.config = config
        self.log = log
        #: The ``prev`` of the session's first record (codec.root_crc); later records name their predecessor.
        self.root = codec.root_crc(session_id)
        #: The history keeps refs to the log's records, not the messages: they are read back through this (a
        #: bounded cache, then the log; pages.py, pg/pages.py, docs/architecture.md "Bounded memory"). None for
        #: a log that has no pager: the history then holds the messages.
        self.pager = pager_for(log, config["page_cache_bytes"])
        self.state = Projection(self.pager)
        self.counter = TokenCounter(config["tokenizer"])
        self.compaction: CompactionConfig = config["compaction"]
        #: Redacts secrets in messages before they are written (secret_scan.py); None: off, no cost.
        self.scanner = config.get("secret_scanner")
        self.readonly = log.readonly
        self.closed = False
        self.loaded_from_file = False
        #: clear() was called by this process: what it loaded is no longer there to protect (docs/resume.md).
        self.cleared_here = False
        self.epoch = 0
        #: close() has begun: no new write is accepted (what was queued before is written).
        self.closing = False
        #: Erasures made by this store (each rewrote records in place: positions read before it are stale).
        self.rewrites = 0
        #: Held by an erase and by an export_on_compact snapshot: one never runs inside the other.
        self.rewriting = asyncio.Lock()
        #: The torn tail cut at open (log.TornTail), or None.
        self.recovered: Any = None
        #: Stats of the last compaction that changed the request view (for stats() and the CLI).
        self.last_compaction: dict[str, Any] | None = None
        #: Checkpoints (checkpoint/policy.py): resume from one at open, write one every checkpoint_every events.
        self.checkpoints = Checkpointer(checkpoint_store_for(log), session_id, config["checkpoint_every"],
                                        writable=not log.readonly)
        self.checkpoints.pager = self.pager
        #: (epoch, n, token list, total): the first n counts of that list were complete at that epoch and sum to
        #: total: the whole history's count without reading it (stats(), checkpoints; ledger.TokenLedger).
        self.token_total_hint: tuple[int, int, Any, int] | None = None
        #: Keeps the storage's search index current after appends (operations/search/background.py); None for
        #: a reader or with ``search_index: false`` (readers then catch up what it did not do).
        self.indexer: Any = None
        #: The close leaves the indexer's work not begun to readers (``BackgroundIndexer.leave``) instead of
        #: waiting for it: the Amplifier mount, whose CLI starts a process per turn (docs/search.md).
        self.index_left_to_readers = False
        #: The ``epoch`` the indexer last saw: a change hands it the history's keys (search/indexer.Snapshot).
        self.indexed_epoch = -1
        #: The dicts the last ``get_messages()`` handed out (history_copy), by place.
        self.handed_out: list[dict[str, Any]] = []
        #: (id of the state, epoch) when they were handed out: the same pair means only appends since.
        self.handed_mark: tuple[int, int] | None = None
        #: Up to how many messages the handed-out dicts are kept without looking at the memory again.
        self.handed_limit = 0
        #: The Amplifier mount (HostContext): a request view takes the dicts ``get_messages()`` hands out for
        #: the history's messages it holds unchanged, instead of copying them again (view_copy).
        self.share_views = False
        if config.get("search_index", True) and not log.readonly:
            from ..operations.search.background import BackgroundIndexer

            if type(log).__name__ == "FileEventLog":
                self.indexer = BackgroundIndexer.for_storage(storage_path)
            elif type(log).__name__ == "PostgresEventLog":
                pg: Any = log
                self.indexer = BackgroundIndexer.for_postgres(pg.dsn, pg.schema)

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever the history may have: an event applied (the head seq) or an erase (which rewrites
        records in place and appends none)."""
        return self.state.head_seq, self.rewrites

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"session {self.session_id!r}: the store is closed")

    def check_writable(self) -> None:
        if self.closed or self.closing:
            raise StoreClosedError(f"session {self.session_id!r}: the store is "
                                   + ("closed" if self.closed else "closing"))
        if self.readonly:
            raise ReadOnlyError(f"session {self.session_id!r} was opened readonly=True; writes are not allowed")

    def full(self) -> Projection:
        """The state with the whole history in memory (loads the rest of a lazily opened checkpoint)."""
        return self.state.materialise()

    def history_copy(self, shared: bool = False) -> list[dict[str, Any]]:
        """``get_messages()``: the whole history as a new list of dicts that are never the history's own.

        A message equal to the one handed out at its place by the previous call is that same dict again (the
        Amplifier CLI asks three times a turn): a C-level comparison instead of a copy, so a caller's change to
        a dict it was given shows in the next caller's list only while it leaves the dict equal to the stored
        message, and never reaches the history. ``shared`` (the Amplifier mount: context-simple's contract,
        whose ``get_messages`` is ``list(self.messages)``): while only messages were appended since the
        previous call, its dicts are handed out again without comparing them, and only the new messages are
        copied, so a change a caller made to one shows in later results (never in the history, the log or
        the request view). What was handed out is kept only while the whole history is in memory anyway (a
        plain list, or a paged one the page cache holds whole): a paged history beyond its budget is copied
        every time. The list is the caller's: a later call never changes it."""
        out, kept = self._hand_out(shared)
        return out.copy() if kept else out  # (the kept list grows in place with later appends)

    def _hand_out(self, shared: bool) -> tuple[list[dict[str, Any]], bool]:
        """The dicts ``get_messages()`` hands out now, and whether that list is the one kept as ``handed_out``
        (which later calls extend in place: the caller gets a copy of it). view_copy calls this for the dicts
        alone: no list is made for a caller who is not there."""
        from ..model.events import gc_paused

        checkpoints = self.checkpoints
        # (the first call of a lazily opened history: the message section's messages are parsed for the caller
        # and seeded in the page cache only when it is next used: no copy of them here; _handed)
        checkpoints.hand_off = not shared and self.state.is_lazy and self.pager is not None
        try:
            messages: Any = self.full().messages
        finally:
            checkpoints.hand_off = False
        handed, checkpoints.handed = checkpoints.handed, None
        with gc_paused():  # (up to a whole history of new dicts: docs/performance.md)
            if handed is not None and handed[1] is not None:
                out = self._handed(messages, handed[0], handed[1])
                if out is not None:
                    return out, False
            return self._history_copy(messages, shared)

    def _handed(self, messages: Any, refs: list[int], parsed: list[Any]) -> list[dict[str, Any]] | None:
        """The history as the first ``get_messages()`` after a lazy open hands it out: the checkpoint's message
        section as parsed for it (``parsed``, aligned with the section's ``refs``: the caller's own dicts, which
        nothing else holds), then copies of what the history holds beyond them; None (copy as usual) if the
        history does not begin with the section's refs any more (a change other than appends since)."""
        from ..model.events import copy_json
        from ..model.history_lists import PagedList, Refs

        k = len(refs)
        items = messages.items if type(messages) is PagedList else None
        if items is None or len(items) < k or len(parsed) != k:
            return None
        head = items.a[:k].tolist() if type(items) is Refs else [v if type(v) is int else -1 for v in items[:k]]
        if head != refs:
            return None
        out = parsed
        if parsed.count(None):  # (messages the state holds itself, not by ref: null in the section)
            for i in [i for i, m in enumerate(parsed) if m is None]:
                out[i] = copy_json(messages[i])
        if len(messages) > k:  # (the log's tail after the checkpoint, read without seeding the section yet)
            assert self.pager is not None
            with self.pager.seed_kept_deferred():
                out += copy_json(messages[k:])
        self.handed_out, self.handed_mark = [], None
        return out

    def _history_copy(self, messages: Any, shared: bool) -> tuple[list[dict[str, Any]], bool]:
        """The dicts to hand out for ``messages``, and whether they are kept as ``handed_out`` (then the caller
        gets a copy of that list: later calls extend it in place)."""
        from ..model.events import copy_json

        prev = self.handed_out
        mark = (id(self.state), self.epoch)
        # (only appends since, and the history grew by at most a quarter since the memory was looked at: the
        # same dicts, the new messages copied)
        appended = shared and self.handed_mark == mark and len(prev) <= len(messages) <= self.handed_limit
        if appended:
            n, out = len(prev), prev
        else:
            n = min(len(prev), len(messages))
            out = [h if h == m else copy_json(m) for h, m in zip(prev[:n], messages)] if n else []
        if len(messages) > n:
            out += copy_json(messages[n:])  # (a slice is a list: of the dicts a paged history's pager holds)
        if appended or type(messages) is list:
            held = True
        else:
            held = _in_memory(messages)
            self.handed_limit = len(messages) + len(messages) // 4 + 64
        self.handed_out, self.handed_mark = (out, mark) if held else ([], None)
        return out, held

    def view_copy(self, out: list[dict[str, Any]], history: Any, start: int = 0) -> list[dict[str, Any]]:
        """A request view's messages ``out`` (built from ``history``) made the caller's: copies, so nothing a
        caller does to a view reaches the stored history. With ``share_views`` (the Amplifier mount) a message
        of ``history`` the view holds as it is (the same dict) is the copy ``get_messages()`` hands out for
        its place (made here first when none is held), so a turn copies the history once; messages the build
        made (compaction, repairs, a system prompt) are copied. ``history`` is the list the build read: the
        history's messages from ``start`` on (anything else than a list: copied)."""
        from ..model.events import copy_json, gc_paused

        if not self.share_views or type(history) is not list or not out:
            return copy_json(out)
        mark = (id(self.state), self.epoch)
        if self.handed_mark != mark or len(self.handed_out) != start + len(history):
            if not _in_memory(self.state.messages):
                return copy_json(out)  # (they would not be kept: a paged history beyond the cache's budget)
            self._hand_out(shared=True)  # (the host asks for them after the turn: made once, here)
            if self.handed_mark != mark or len(self.handed_out) != start + len(history):
                return copy_json(out)  # (not held: a paged history beyond the page cache's budget)
        shared = self.handed_out
        n = len(history)
        where: dict[int, int] | None = None
        j = 0
        with gc_paused():
            view = []
            for m in out:
                if j < n and history[j] is m:
                    view.append(shared[start + j])
                    j += 1
                    continue
                if where is None:
                    where = {id(h): i for i, h in enumerate(history)}
                i = where.get(id(m))
                if i is None:
                    view.append(copy_json(m))
                else:
                    view.append(shared[start + i])
                    j = i + 1
            return view

    async def iter_messages(self, chunk: int) -> AsyncIterator[dict[str, Any]]:
        """The history as of now, one copy at a time; messages a paged history refers to are read in runs of
        ``chunk`` (``PersistentContextManager.iter_messages``)."""
        from ..model.events import copy_json
        from ..model.history_lists import PagedList, _resolve

        self.check_open()
        state = self.full()
        messages: Any = state.messages  # (a lazy history loads its refs, never its messages)
        pager = messages.pager if type(messages) is PagedList else None
        # refs or messages: a snapshot (a paged history's packed refs copied), so later changes are not seen
        items = messages.items.copy() if pager is not None else list(messages)
        keys = list(state.keys)
        rewrites = self.rewrites
        for start in range(0, len(items), chunk):
            if start:
                await asyncio.sleep(0)
                self.check_open()
            if self.rewrites != rewrites:
                # An erase rewrote the log: the snapshot's positions point into the old file. Go on with the
                # same messages read from the new one, less the erased ones (they are in no view any more).
                pairs, pager = self._after_rewrite(keys[start:])
                keys = keys[:start] + [k for k, _ in pairs]
                items = [None] * start + [r for _, r in pairs]
                rewrites = self.rewrites
            part = items[start:start + chunk]
            for v in (_resolve(part, pager) if pager is not None else part):
                yield copy_json(v)

    def _after_rewrite(self, keys: list[Any]) -> tuple[list[tuple[Any, Any]], Any]:
        """``(key, ref or message)`` in the current history of each of ``keys`` still in it, and its pager."""
        from ..model.projection import PagedList

        state = self.full()
        messages: Any = state.messages
        paged = type(messages) is PagedList
        current = messages.items if paged else list(messages)
        where = {k: i for i, k in enumerate(state.keys)}
        return [(k, current[where[k]]) for k in keys if k in where], messages.pager if paged else None

    def tokenizer_name(self) -> str:
        """The counter the history's counts were made by, for a checkpoint: loads no encoding (a process that
        counted nothing writes the requested name, which the counts it restored carry)."""
        return self.counter.current

    def ref_positions(self, first_seq: int, lines: Sequence[bytes]) -> list[int | None]:
        """Where a paged history finds each of ``lines`` (the records from ``first_seq`` on, about to be
        appended) again: its byte position in a file log, its seq in PostgreSQL; None where the history holds
        the messages (no pager)."""
        pager = self.pager
        if pager is None:
            return [None] * len(lines)
        if getattr(pager, "refs_are_keys", False):
            return list(range(first_seq, first_seq + len(lines)))
        out: list[int | None] = []
        at: int = self.log.position  # type: ignore[attr-defined]
        for line in lines:
            out.append(at)
            at += len(line)
        return out

    def log_dir(self) -> Path:
        return self.storage_path / self.session_id

    async def emit(self, event: str, data: dict[str, Any]) -> None:
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

    def stats(self, tokens: int) -> dict[str, Any]:
        """The facts ``PersistentContextManager.stats`` returns, with ``tokens`` the history's token count."""
        st = self.state
        counter = self.counter
        last = self.last_compaction
        checkpoints = self.checkpoints
        return {
            "session_id": self.session_id,
            "path": str(self.log.path),
            "head_seq": st.head_seq,
            "events": dict(st.counts),
            "bytes": None if getattr(self.log, "size", None) is None  # (a file log: every segment, uncompressed)
            else self.log.size + getattr(self.log, "base", 0),  # type: ignore[attr-defined]
            "messages": len(st.messages),
            "pinned": len(st.pinned),
            "tokens": tokens,
            "tokenizer": counter.name,
            "tokenizer_exact": counter.exact,
            "tokenizer_requested": counter.asked,
            "tokens_bounded": counter.bounded,
            "fsync": self.config["fsync"],
            "reserve_tail": self.config["reserve_tail"],
            "loaded_from_file": self.loaded_from_file,
            "last_compaction": None if last is None else {
                k: last.get(k) for k in (
                    *_COMPACTION_FIELDS, *(("before_tokens_exact", "window") if "window" in last else ()))},
            "checkpoint": {"loaded_seq": checkpoints.loaded_seq, "seq": checkpoints.seq,
                           "ignored": checkpoints.ignored, "error": checkpoints.error},
        }


def _in_memory(messages: Any) -> bool:
    """Whether a history is all in memory: a plain list, or a paged one in its page cache (once read, while it
    fits the cache's budget; the newest messages may not be there yet: nine in ten held means it fits)."""
    from ..model.history_lists import PagedList

    return type(messages) is list or (
        type(messages) is PagedList and getattr(messages.pager, "held_messages", 0) >= len(messages) * 0.9)
