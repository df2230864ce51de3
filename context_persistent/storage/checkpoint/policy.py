"""When checkpoints are read and written (:class:`Checkpointer`, used by the manager): resume a session from
its checkpoint, write a new one every ``checkpoint_every`` events and on close."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

from ...model import json_lossless
from ..paths import CHECKPOINT_BASE_NAME
from ...model.events import gc_paused
from ...model.projection import LoadRefused, Projection
from ...model.values import replace
from .front import SystemIndex, covers_most, front_section, is_whole, restore_front, slim_front
from .payload import (_TRAILER, Checkpoint, CheckpointError, decode, dump_in_steps, encode, encode_front,
                      mismatch, restore)
from .sections import (HandOff, defer_section, dump_section, keeps_sections, load_section, section_refs,
                       use_section, wants_section)
from .store import CheckpointStore, FileCheckpointStore, first_record_crc, message_reader, read_state
from .replay import replay_from_base, replay_sync, seed_state

logger = logging.getLogger("context_persistent.storage.checkpoint")

#: On close, a checkpoint is written only if at least this many events (or ``checkpoint_every``, if smaller)
#: are not covered yet: replaying a short tail costs less than writing the whole state again.
CLOSE_MIN_EVENTS = 256
#: ... or when the log grew by at least this many bytes (one set_messages can hold a whole long history).
CLOSE_MIN_BYTES = 1 << 20
#: Payloads larger than this are framed (CRC, copy) in a worker thread.
_THREAD_MIN = 1 << 20
#: A store still lazy reuses its checkpoint's state section (copied, not parsed) as long as the log between
#: that section and the new front is at most this many times ``checkpoint_every`` events: loading the rest
#: then replays that much of the log (about 4 µs an event here).
BASE_MAX_FACTOR = 8


def _counted(state: Projection) -> int:
    return len(state.tokens) - state.tokens.count(None)


class _Prepared:
    """A checkpoint as read from the live state in the caller's turn (:meth:`Checkpointer._prepare`)."""

    __slots__ = ("seq", "position", "tokenizer", "last_crc", "captured", "front_json", "counted", "base", "splice",
                 "redactions", "front_full")

    def __init__(self, seq: int, position: int | None, tokenizer: str | None, last_crc: str | None,
                 captured: dict[str, Any] | None, front_json: bytes, counted: int, base: dict[str, Any] | None = None,
                 splice: tuple[int, int, int, int] | None = None, redactions: int = 0,
                 front_full: dict[str, Any] | None = None) -> None:
        self.seq, self.position, self.tokenizer, self.last_crc = seq, position, tokenizer, last_crc
        #: the state to serialise, or None when the state section is copied
        self.captured = captured
        self.front_json = front_json
        self.counted = counted
        self.base = base
        #: (descriptor of the checkpoint file, owned by the write; offset, length, message section's length) of the
        #: state section to copy (with the message section that follows it, if any)
        self.splice = splice
        #: Redactions the state holds (its ``counts``): see :attr:`Checkpointer.redactions`.
        self.redactions = redactions
        #: The front section as it is when ``front_json`` is its whole form (front.slim_front): written instead
        #: if no message section is written with it.
        self.front_full = front_full


def _save_based(store: FileCheckpointStore, fields: dict[str, Any], src: int, offset: int, length: int,
                messages: int = 0) -> int:
    """Store a based checkpoint whose state section is the one in the open file ``src`` (closed here): by
    reference, keeping that file as ``checkpoint.base`` (O(1): nothing of the section is read or written), or,
    where the file system cannot link it, by copying the section after the new front. The message section of
    ``messages`` bytes that follows the state section there (aligned with it) goes with it."""
    try:
        linked = store.keep_as_base(src)
        crc = os.pread(src, 8, offset + length + 1).decode("ascii", "replace") if linked else ""
    except BaseException:
        os.close(src)
        raise
    if not linked:
        prefix = encode_front(state_bytes=length, messages_bytes=messages, **fields)
        count = length + 1 + _TRAILER + (messages + 1 + _TRAILER if messages else 0)
        return store.save_copying(prefix, src, offset, count)  # (closes src)
    try:
        where = {"file": CHECKPOINT_BASE_NAME, "offset": offset, "crc": crc}
        return store.save_front_only(encode_front(state_bytes=length, state_in=where, messages_bytes=messages,
                                                  **fields))
    finally:
        os.close(src)


def _redactions(cp: Checkpoint) -> int:
    """The redactions the state ``cp`` holds had folded (its ``counts``; 0 if it does not say)."""
    facts = (cp.front or {}).get("meta") if cp.state is None else cp.state
    counts = facts.get("counts") if isinstance(facts, dict) else None
    redacted = counts.get("redacted", 0) if isinstance(counts, dict) else 0
    return redacted if type(redacted) is int else 0


async def anchor_mismatch(cp: Checkpoint, log: Any) -> str | None:
    """Why ``cp`` is not anchored in ``log`` (another log, or one shorter or rewritten), or None."""
    first = await first_record_crc(log)
    if first != cp.first_crc:
        return (f"its first-record fingerprint {cp.first_crc} does not match the log's ({first}): "
                "it was written for another log under this session id")
    record_before = getattr(log, "record_before", None)
    if record_before is not None:
        if not isinstance(cp.position, int):
            return f"its position {cp.position!r} is not a byte offset"
        anchors = [(cp.seq, cp.position, cp.last_crc, "its")]
        if cp.base is not None:
            anchors.append((cp.base["seq"], cp.base["position"], cp.base["last_crc"], "its state section's"))
        for seq, position, crc, whose in anchors:
            rec = record_before(position)
            if rec is None or rec["seq"] != seq or rec.get("crc") != crc:
                found = "no record" if rec is None else f"seq {rec['seq']} (crc {rec.get('crc')})"
                return (f"the log does not hold {whose} seq {seq} (crc {crc}) at byte {position} "
                        f"(found {found}): the log is shorter or was rewritten")
    elif cp.base is not None:
        return "it is based on an older state section, which only a file log can bring up to date"
    return None


def _front_json(front: dict[str, Any], pager: Any, store: Any) -> tuple[bytes, dict[str, Any] | None]:
    """A front section's JSON, and the front itself when that JSON is its whole form (front.slim_front: it
    holds most of the history, and a message section can be written beside it; ``_write`` writes the front as
    it is instead if none is)."""
    if covers_most(front) and keeps_sections(pager) and isinstance(store, FileCheckpointStore):
        return json_lossless.dumps(slim_front(front)), front
    return json_lossless.dumps(front), None


def _splice_base_of(source: Any, state: Projection, store: Any, tokenizer: Callable[[], str], every: int
                    ) -> dict[str, Any] | None:
    """The base a new checkpoint of a lazy history can copy its state section from, or None.

    Possible while the state section opened lazily (``source``: file, offset, length, checkpoint) is still on
    disk (not loaded), its token counts were made by the current tokenizer (or it holds none), and the log
    since its seq is short enough."""
    if source is None or not state.is_lazy or not isinstance(store, FileCheckpointStore):
        return None
    cp = source[3]
    if not isinstance(cp.position, int) or cp.last_crc is None:
        return None
    if cp.tokenizer is not None and cp.tokenizer != tokenizer():  # (no name asked, no encoding loaded, else)
        return None
    base = cp.base or {"seq": cp.seq, "position": cp.position, "last_crc": cp.last_crc}
    if state.head_seq - base["seq"] > BASE_MAX_FACTOR * every:
        return None
    return dict(base)


class Checkpointer(HandOff):
    """Resumes a session from its checkpoint and writes new ones every ``every`` events and on close.

    At most one write is in flight; a failed write is logged and never affects the log or the caller.
    ``loaded_seq`` is the seq of the checkpoint used at open (0: full replay); ``ignored`` says why a
    stored checkpoint was not used; ``seq`` is the newest seq covered by a stored checkpoint.
    """

    def __init__(self, store: CheckpointStore | None, session_id: str, every: int, *, writable: bool) -> None:
        self.store, self.session_id, self.every, self.writable = store, session_id, every, writable
        self.seq = 0
        self.position = 0  # log position covered by the stored checkpoint (when the backend has positions)
        self.loaded_seq = 0
        self.ignored: str | None = None
        self.first_crc: str | None = None
        self.counted = 0  # messages with a token count in the stored checkpoint
        #: Why the last checkpoint attempt failed (None once one succeeds): stats() shows it. A failed attempt
        #: is retried after another ``every`` events (``_failed_seq``), never on every append.
        self.error: str | None = None
        self._failed_seq = 0
        self._task: asyncio.Future[None] | None = None
        #: Set by the manager: ``() -> (keep_head, recent_tokens)`` for the front section; None: no front
        #: section is written (every open then loads the whole state).
        self.front_hints: Callable[[], tuple[int, int]] | None = None
        self._lazy_file: Any = None  # the checkpoint file the rest is read from (closed by close())
        #: While the history is lazy: (file, offset, length, checkpoint) of the state section not loaded yet,
        #: which a new checkpoint can copy instead of loading and serialising the whole history.
        self._lazy_source: tuple[Any, int, int, Checkpoint] | None = None
        self._system = SystemIndex()
        #: Where the log's messages are read from (pages.py, pg/pages.py; set by the manager): the states this
        #: loads keep refs to the log instead of messages. None: messages are held (a log without a pager).
        self.pager: Any = None
        #: Set by the manager: ``() -> (n, total)``, the first n messages' token counts summing to total (known
        #: without reading the history), or None. A front section records it, so stats() after the next open
        #: counts only the messages after those n.
        self.token_total: Callable[[], tuple[int, int] | None] | None = None
        #: Set by the manager: ``() -> dict | None``, the request view's clean prefix (store/view_bound.py),
        #: kept in the front section as ``view_prefix``; ``loaded_view_prefix`` is the one the load found. The
        #: same for the usage meter's ``usage_at`` (store/usage.py): ``() -> list[int] | None``.
        self.view_prefix: Callable[[], dict[str, Any] | None] | None = None
        self.usage_at: Callable[[], list[int] | None] | None = None
        self.loaded_view_prefix = self.loaded_usage_at = None  # type: Any
        #: The clean prefix's length in the stored checkpoint (0: none).
        self.prefix_h = 0
        #: ``(n, total)`` of the checkpoint loaded at open, when it recorded one, else None.
        self.loaded_total: tuple[int, int] | None = None
        #: How many messages of the history the checkpoint's message section put in the pager's cache when the
        #: history was loaded, or handed to the first get_messages() (0: none; read from the log). docs/format.md.
        self.section_messages = 0
        #: The loaded checkpoint's message section failed verification: the next close writes a new checkpoint.
        self.section_damaged = False
        #: Redactions the stored checkpoint's state had folded (None: no checkpoint stored, or one not loaded): a
        #: close after more writes a new checkpoint, so
        #: that no checkpoint keeps a redacted message's text in its front or message section longer than the
        #: process that redacted it (its log keeps the bytes: docs/operations.md, "Erasure").
        self.redactions: int | None = None

    # -- loading --------------------------------------------------------------------------------------
    async def load(self, log: Any, tokenizer: Callable[[], str]) -> Projection:
        """Checkpoint + tail replay when a valid checkpoint exists, else a full replay."""
        cp, state = await self._usable(log, tokenizer)
        if cp is None or state is None:
            return await self._replay(log, self.fresh(log), 0, None)
        if cp.base is not None and cp.state is not None:  # read whole: the state section is at the base
            tail = await self._replay(log, state, cp.base["seq"], cp.base["position"])
        else:
            tail = await self._replay(log, state, cp.seq, cp.position)
        if log.last_seq < cp.seq:  # the log ends before the checkpoint (a backend that cannot check the anchor)
            await self._reject(f"it is at seq {cp.seq} but the log ends at seq {log.last_seq}")
            return await self._replay(log, self.fresh(log), 0, None)
        self.seq = self.loaded_seq = cp.seq
        self.position = cp.position if isinstance(cp.position, int) else 0
        self.first_crc = cp.first_crc
        front = cp.front if isinstance(cp.front, dict) else {}
        self.loaded_view_prefix, self.loaded_usage_at = front.get("view_prefix"), front.get("usage_at")
        self.redactions = _redactions(cp)
        h = self.loaded_view_prefix.get("h") if isinstance(self.loaded_view_prefix, dict) else None
        self.prefix_h = h if type(h) is int and h > 0 else 0
        if cp.state is None:  # the front was read first: it says how many counts the stored state holds
            counted = front.get("counted")
            self.counted = (_counted(state) if not state.is_lazy  # (a whole front: the state was read at open)
                            else counted if isinstance(counted, int) and cp.tokenizer == tokenizer() else 0)
            summed, n = front.get("tokens_total"), front.get("n")
            if (isinstance(summed, list) and len(summed) == 2 and all(type(v) is int and v >= 0 for v in summed)
                    and type(n) is int and summed[0] <= n and cp.tokenizer == tokenizer()):
                self.loaded_total = (summed[0], summed[1])
        else:
            self.counted = _counted(state)
        logger.debug("session %s: resumed from the checkpoint at seq %d, replayed %d newer events",
                     self.session_id, cp.seq, tail.head_seq - cp.seq)
        return tail

    async def _usable(self, log: Any, tokenizer: Callable[[], str]) -> tuple[Checkpoint | None, Projection | None]:
        """The stored checkpoint and its projection if it fits this session and log, else (None, None).

        A file checkpoint beside a file log, and a PostgreSQL checkpoint of a paged history, are opened lazily:
        only its front section is read now (the projection holds the rest as :class:`LazyList`); other stores,
        and payloads without a front section, are read whole.
        """
        if self.store is None:
            return None, None
        from ..log import FileEventLog

        opened: tuple[Checkpoint, Any, int, int] | None = None
        try:
            if isinstance(self.store, FileCheckpointStore) and isinstance(log, FileEventLog):
                opened = self.store.open_front()
                payload = None
                if opened is not None and opened[0].front is None:
                    opened[1].close()  # written without a front section: read it whole
                    opened = None
                    payload = await self.store.load()
            elif getattr(self.store, "reads_front", False) and getattr(self.pager, "refs_are_keys", False):
                opened = await self.store.open_front(self.pager)  # type: ignore[attr-defined]
                payload = None
                if opened is not None and opened[0].front is None:
                    opened = None  # (written without a front section: read it whole)
                    payload = await self.store.load()
            else:
                payload = await self.store.load()
        except OSError as e:
            logger.info("session %s: checkpoint unreadable (%s); replaying the whole log", self.session_id, e)
            return None, None
        except CheckpointError as e:
            await self._reject(str(e))
            return None, None
        if opened is None and payload is None:
            logger.debug("session %s: no checkpoint; replaying the whole log", self.session_id)
            return None, None
        try:
            if opened is not None:
                cp, f, offset, length = opened
                state_loader = functools.partial(self._load_rest, f, offset, length, cp, tokenizer, log)
            else:
                cp = decode(payload, packed=True)  # type: ignore[arg-type]
            reason = mismatch(cp, session_id=self.session_id) or await anchor_mismatch(cp, log)
            if reason is None:
                if opened is None:
                    state = restore(cp, tokenizer, self.pager)
                    if (cp.messages_section is not None
                            and wants_section(self.pager, cp, len(state.messages), self.session_id)):
                        section = memoryview(cp.messages_section)
                        self._seed(section_refs(state), load_section(
                            lambda at, count: bytes(section[at:at + count]), 0, cp, len(state.messages)), cp)
                    return cp, state
                if is_whole(cp.front):  # (layout 6: the front holds no message; the sections are read now)
                    return cp, self._load_whole(f, offset, length, cp, tokenizer, log)
                state = restore_front(cp, tokenizer, state_loader, self.pager)
                self._system.seed(state)
                self._lazy_file = f
                self._lazy_source = (f, offset, length, cp)
                return cp, state
        except CheckpointError as e:
            reason = str(e)
        if opened is not None:
            opened[1].close()
        await self._reject(reason)
        return None, None

    def _load_rest(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                   log: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """The whole state of a lazily opened checkpoint: its state section, or, if that fails verification,
        the log replayed up to the checkpoint's seq (the log is the source of truth)."""
        gc_was_enabled = gc.isenabled()
        gc.disable()  # (as in the manager's open: millions of long-lived acyclic objects, nothing to collect)
        try:
            return self._read_rest(f, offset, length, cp, tokenizer, log)
        finally:
            self._lazy_source = None  # (the file is closed: a checkpoint can no longer copy its state section)
            if gc_was_enabled:
                gc.enable()

    def _load_whole(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                    log: Any) -> Projection:
        """The state of a checkpoint whose front section is whole (front.slim_front), read at open: the state
        section and the message section, each parsed once (the collector paused, as in ``_load_rest``)."""
        with gc_paused():
            state = self._read_whole(f, offset, length, cp, tokenizer, log)
        self._system.seed_front(cp.front or {}, state, cp.seq)
        return state

    def _read_rest(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                   log: Any) -> tuple[list[Any], list[Any], list[Any]]:
        state = self._read_whole(f, offset, length, cp, tokenizer, log)
        return state.messages, state.keys, state.tokens

    def _read_whole(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                    log: Any) -> Projection:
        """The whole state at ``cp.seq`` from its state and message sections (the file ``f`` is closed here),
        or, if the state section fails verification, from the log replayed up to ``cp.seq``."""
        messages: Any = None
        try:
            try:
                section = f.read_state(offset, length) if hasattr(f, "read_state") else read_state(f, offset, length)
                state = restore(replace(cp, state=section), tokenizer, self.pager)
                if wants_section(self.pager, cp, len(state.messages), self.session_id):
                    messages = load_section(message_reader(f), offset + length + 1 + _TRAILER, cp,
                                            len(state.messages), keep=self.hand_off)
            finally:
                f.close()
            refs = section_refs(state) if messages is not None else None
            if cp.base is not None:
                replay_from_base(log, state, cp)
            if refs is not None and messages is not None:
                self.handed = defer_section(self, refs, messages, cp)
            logger.debug("session %s: loaded the rest of the checkpoint at seq %d", self.session_id, cp.seq)
        except (CheckpointError, OSError, ValueError) as e:  # (ValueError: the file was closed by a failed try)
            self.ignored = f"state section: {e}"
            logger.warning("session %s: the checkpoint's state section cannot be used (%s); rebuilding the "
                           "history from the log instead", self.session_id, e)
            if self.writable and isinstance(self.store, FileCheckpointStore):
                try:
                    self.store.discard_sync()  # a cache we cannot use (the next checkpoint replaces it anyway)
                except OSError as err:
                    logger.info("session %s: could not remove the unusable checkpoint: %s", self.session_id, err)
            state = replay_sync(log, cp, self.pager)
        return state

    def _seed(self, refs: list[int], loaded: tuple[list[Any] | None, str | None, Any], cp: Checkpoint) -> None:
        """Put the message section's messages in the pager's cache; one that fails verification is reported
        (``ignored``, a warning: sections.use_section) and the messages are read from the log instead."""
        self.section_messages, error = use_section(self.pager, refs, loaded, cp, self.session_id)
        if error is not None:
            self.ignored, self.section_damaged = f"message section: {error}", True

    def fresh(self, log: Any) -> Projection:
        """The state a replay from the log's first record starts from: empty, or, when the log's oldest segments
        expired, seeded from the ``expired`` record the manifest's boundary names (retention.py)."""
        return seed_state(log, self.pager)

    async def _reject(self, reason: str) -> None:
        self.ignored = reason
        logger.info("session %s: ignoring the checkpoint: %s; replaying the whole log", self.session_id, reason)
        if self.writable and self.store is not None:
            try:
                await self.store.discard()  # a cache we cannot use: remove it so it is not read again
            except OSError as e:
                logger.info("session %s: could not remove the unusable checkpoint: %s", self.session_id, e)

    async def _replay(self, log: Any, state: Projection, after_seq: int, position: int | None) -> Projection:
        apply = state.apply
        paged = self.pager is not None and state.pager is not None
        # A replay of the log into a loaded history caches only the messages of about the log's last
        # cache_bytes: the others would be evicted before it ends (a lazy history reads each appended message).
        floor = paged and not state.is_lazy and type(getattr(log, "position", None)) is int
        if floor:
            self.pager.keep_from(max(0, log.position - self.pager.cache_bytes))
        try:
            async for batch in log.read_batches(after_seq, position):
                if after_seq == 0 and batch and self.first_crc is None:
                    self.first_crc = batch[0].get("crc")
                spans = getattr(log, "batch_spans", None) if paged else None
                sizes = getattr(log, "batch_sizes", None) if paged else None
                if spans is not None and len(spans) == len(batch):  # (the file log: where each record is)
                    for rec, (start, end) in zip(batch, spans):
                        apply(rec, start, end - start)
                elif sizes is not None and len(sizes) == len(batch):  # (PostgreSQL: a record is found by its seq)
                    for rec, size in zip(batch, sizes):
                        apply(rec, rec["seq"], size)
                else:
                    for rec in batch:
                        apply(rec)
        finally:
            if floor:
                self.pager.keep_from(0)
        return state

    # -- writing --------------------------------------------------------------------------------------
    def maybe_write(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        """After an append: start a background write if ``every`` events are not covered and none is running."""
        if (self._task is not None or not self.writable or self.store is None
                or state.head_seq - max(self.seq, self._failed_seq) < self.every):
            return
        try:
            prep = self._prepare(state, log, tokenizer)
        except Exception as e:  # the record is durable: a cache that cannot be written must not fail its append
            self._failed(state.head_seq, e)
            return
        self._task = asyncio.ensure_future(self._write(prep, log))

    def _failed(self, seq: int, error: Exception) -> None:
        self.error = f"seq {seq}: {type(error).__name__}: {error}"
        self._failed_seq = seq
        logger.warning("session %s: could not write a checkpoint at seq %d (%s); the log is unaffected, the next "
                       "open replays more of it, and another attempt follows after %d more events",
                       self.session_id, seq, error, self.every)

    async def close(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        """Wait for a write in flight, then write a final checkpoint if enough events (or token counts) are
        not covered yet."""
        try:
            await self._close(state, log, tokenizer)
        finally:
            if self._lazy_file is not None:
                self._lazy_file.close()

    async def _close(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)
        if not self.writable or self.store is None or state.head_seq == 0:
            return
        try:
            await self._close_write(state, log, tokenizer)
        except Exception as e:  # a cache: closing the log must not fail for it
            self._failed(state.head_seq, e)

    async def _close_write(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        enough = min(self.every, CLOSE_MIN_EVENTS)
        grown = log.position - self.position if isinstance(log.position, int) else 0
        if state.is_lazy:
            # Counting tokens would load the history: the rule is events and bytes. A checkpoint that cannot
            # copy the state section would load and write it all, which only a long uncovered tail is worth.
            if self._splice_base(state, tokenizer) is None:
                enough, grown = self.every, 0
            if state.head_seq - self.seq >= enough or grown >= CLOSE_MIN_BYTES:
                await self._write(self._prepare(state, log, tokenizer), log)
            return
        if (state.head_seq - self.seq >= enough or _counted(state) - self.counted >= enough
                or grown >= CLOSE_MIN_BYTES or self._prefix_gain() >= enough or self.section_damaged
                or self.redactions is not None and state.counts.get("redacted", 0) > self.redactions):
            await self._write(self._prepare(state, log, tokenizer), log)

    def _prefix_gain(self) -> int:
        """How many more messages the request view's clean prefix covers than the stored checkpoint's does
        (a resumed process analyses only the messages after it: store/view_bound.py)."""
        prefix = self.view_prefix() if self.view_prefix is not None else None
        if prefix is None:
            return 0
        return int(prefix["h"]) - self.prefix_h

    def _splice_base(self, state: Projection, tokenizer: Callable[[], str]) -> dict[str, Any] | None:
        """The base a new checkpoint of this lazy history can copy its state section from, or None
        (:func:`_splice_base_of`)."""
        return _splice_base_of(self._lazy_source, state, self.store, tokenizer, self.every)

    def _prepare(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> _Prepared:
        """What must be read from the live state now (this runs in the caller's turn; the rest is in the
        background): the anchor, the front section and either the captured state (serialised later, in steps)
        or, for a history still lazy, the state section to copy from the checkpoint it was opened from."""
        last = getattr(log, "record_before", None)
        position = log.position
        last_crc = None
        if last is not None:
            rec = last(position)
            last_crc = rec.get("crc") if rec is not None and rec["seq"] == state.head_seq else None
        base = self._splice_base(state, tokenizer) if self.front_hints is not None else None
        if base is not None and last_crc is not None:
            try:
                with state.loads_refused():  # only what is in memory: else load it all (below)
                    front, front_counts = self._front(state, counted=self.counted)
            except LoadRefused:
                pass
            else:
                assert self._lazy_source is not None
                f, offset, length, source = self._lazy_source
                # The counts in the copied section were made by source.tokenizer (checked: the current one).
                name = tokenizer() if source.tokenizer is not None or front_counts else None
                try:
                    # Our own descriptor, taken now: a read of the rest (get_messages) before the background
                    # write runs closes the file the section is copied from.
                    src = os.dup(f.fileno())
                except (OSError, ValueError):
                    pass  # (no descriptor left): capture the whole state instead, below
                else:
                    return _Prepared(state.head_seq, position, name, last_crc, None, front, self.counted, base,
                                     (src, offset, length, 0 if self.section_damaged else source.messages_bytes))
        state.materialise()
        counted = _counted(state)
        front_json, full = b"null", None
        if self.front_hints is not None and (isinstance(self.store, FileCheckpointStore)
                                             or getattr(self.store, "reads_front", False)):  # (read lazily only there)
            front_json, full = _front_json(self._front_of(state, counted=counted), self.pager, self.store)
        return _Prepared(state.head_seq, position, tokenizer() if counted else None, last_crc, state.capture(),
                         front_json, counted, redactions=state.counts.get("redacted", 0), front_full=full)

    def _front(self, state: Projection, *, counted: int) -> tuple[bytes, bool]:
        """The front section's JSON, and whether it holds any token count."""
        front = self._front_of(state, counted=counted)
        return json_lossless.dumps(front), any(t is not None for t in front["tokens"])

    def _front_of(self, state: Projection, *, counted: int) -> dict[str, Any]:
        """The front section (front.front_of) with what the checkpointer adds: counts, total, clean prefix."""
        assert self.front_hints is not None
        front = front_section(state, self.front_hints(), self._system.of(state), counted,
                              self.token_total() if self.token_total is not None else None,
                              self.view_prefix() if self.view_prefix is not None else None)
        if "view_prefix" in front:
            self.prefix_h = front["view_prefix"]["h"]
        if (at := self.usage_at() if self.usage_at is not None else None) is not None:
            front["usage_at"] = at
        return front

    async def _write(self, prep: _Prepared, log: Any) -> None:
        store = self.store
        assert store is not None
        seq = prep.seq
        splice = prep.splice
        try:
            if self.first_crc is None:
                self.first_crc = await first_record_crc(log)
            fields = dict(session_id=self.session_id, seq=seq, position=prep.position, first_crc=self.first_crc,
                          last_crc=prep.last_crc, tokenizer=prep.tokenizer, front_json=prep.front_json,
                          base=prep.base)
            if splice is not None:
                src, offset, length, section = splice
                assert isinstance(store, FileCheckpointStore)
                splice = None  # _save_based closes src
                size = await asyncio.to_thread(_save_based, store, fields, src, offset, length, section)
            else:
                assert prep.captured is not None
                state_json = await dump_in_steps(prep.captured)
                messages_json = (await dump_section(self.pager, prep.captured["messages"])
                                 if isinstance(store, FileCheckpointStore) else None)
                if prep.front_full is not None and messages_json is None:  # (no message section: a lazy front)
                    fields["front_json"] = json_lossless.dumps(prep.front_full)
                prep.front_full = None
                prep.captured = None  # (the copies of the lists are not needed any more)
                framing = functools.partial(encode, state_json=state_json, messages_json=messages_json,
                                            **fields)  # type: ignore[arg-type]
                large = sum(map(len, state_json)) + sum(map(len, messages_json or ())) >= _THREAD_MIN
                payload = await asyncio.to_thread(framing) if large else framing()
                await store.save(payload, seq)
                size = len(payload)
            self.section_damaged = False
            if prep.splice is None and prep.captured is None:  # (a whole state written: its redactions)
                self.redactions = prep.redactions
            if seq >= self.seq:
                self.seq = seq
                self.position = prep.position if isinstance(prep.position, int) else 0
            self.counted = prep.counted
            logger.debug("session %s: checkpoint written at seq %d (%d bytes%s)", self.session_id, seq, size,
                         "" if prep.base is None else f", state section of seq {prep.base['seq']} copied")
        except Exception as e:  # a checkpoint is a cache: never let it break the store
            self._failed(seq, e)
        else:
            self.error = None
        finally:
            if splice is not None:  # (failed before the copy began)
                os.close(splice[0])
            self._task = None
