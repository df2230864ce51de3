"""The one way events reach the log: encode, append, apply once durable; inline or by group commit.

Every event is serialised by its caller once (``data_json``); the record line embeds those bytes as they are
(codec.encode). The file backend with fsync ``always`` or ``never`` appends inline (its append does not
suspend, so no other commit can interleave); fsync ``batch`` and PostgreSQL queue events and write each
group in one append. Audit records of request views (``defer``) ride along in the next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from ..model import codec
from ..model import events as ev
from ..storage.log import FileEventLog
from .session import Session

logger = logging.getLogger("context_persistent")

#: Event types that change no view, or only by appending a message: the request view can be extended.
_KEEPS_EPOCH = frozenset({ev.MESSAGE_ADDED, *ev.AUDIT_EVENTS})


class Writer:
    """Appends events for one session; ``commit`` returns once the event is durable and applied."""

    def __init__(self, session: Session) -> None:
        self._s = session
        #: File appends with fsync always/never complete without suspending: no queue needed.
        self.inline = isinstance(session.log, FileEventLog) and session.config["fsync"] != "batch"
        #: ``compacted`` audit records made by request views: a read never writes or syncs, so they wait here
        #: and go out in the same write as the next appended event (or at close; docs/compaction.md).
        self.deferred: list[tuple[str, Any, bytes]] = []
        self._pending: list[tuple[str, Any, bytes, asyncio.Future[int]]] = []
        self._flush_task: asyncio.Task[None] | None = None
        #: Events ever queued, and settled (written or failed): ``drain`` waits for a count, not for an empty
        #: queue, so a task that keeps appending cannot starve it.
        self._queued = 0
        self._settled = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: Set while :meth:`exclusive` holds the log: commits wait on it, queued events are not flushed.
        self._gate: asyncio.Future[None] | None = None
        #: Told the position of each ``usage_reported`` record once applied (the usage meter: store/usage.py).
        self.on_usage: Any = None

    async def commit(self, type_: str, data: Any, data_json: bytes | None = None) -> int:
        """Append one event and apply it once it is durable (per the fsync policy); returns its seq."""
        s = self._s
        s.check_writable()
        if data_json is None:
            data_json = codec.dumps(data)
        if not self.inline:
            return await self.enqueue(type_, data, data_json)
        while self._gate is not None:  # an erase is rewriting the log: append after it
            await asyncio.shield(self._gate)
            s.check_writable()
        if self.deferred:  # audit records of earlier request views ride along in this write
            await self.commit_with_deferred([(type_, data, data_json)])
            return s.state.head_seq  # (the event is the last of that write)
        seq = s.state.head_seq + 1
        ts = codec.now_iso()
        log = s.log
        line = codec.encode(seq, type_, data_json, ts, log.last_crc or s.root)
        start = s.ref_positions(seq, (line,))[0]
        await log.append((line,), seq)
        s.state.apply({"seq": seq, "ts": ts, "type": type_, "data": data}, start, len(line))
        if type_ not in _KEEPS_EPOCH:
            s.epoch += 1
        elif type_ == ev.USAGE_REPORTED and self.on_usage is not None:
            self.on_usage(start)
        self._after_append()
        return seq

    def defer(self, type_: str, data: dict[str, Any]) -> None:
        """Keep an audit record for the next write (a request view is a read: it does not write or sync)."""
        self.deferred.append((type_, data, codec.dumps(data)))

    def _encode_run(self, first: int, events: list[tuple[str, bytes]], ts: str) -> list[bytes]:
        """Records for ``events`` (type, data JSON) from seq ``first`` on, each naming the one before it."""
        prev = self._s.log.last_crc or self._s.root
        lines = []
        for seq, (type_, data_json) in enumerate(events, first):
            line = codec.encode(seq, type_, data_json, ts, prev)
            lines.append(line)
            prev = line[-11:-3]  # (codec.crc_of, inlined: this is the group-commit path)
        return lines

    async def commit_with_deferred(self, events: list[tuple[str, Any, bytes]]) -> None:
        """Append the deferred audit records and ``events`` in one write (inline appends, or a store whose group
        commit has drained, as at close).

        If the write fails, nothing was applied and the audit records stay deferred for the next append.
        """
        s = self._s
        deferred, self.deferred = self.deferred, []
        batch = deferred + events
        first = s.state.head_seq + 1
        ts = codec.now_iso()
        lines = self._encode_run(first, [(t, dj) for t, _, dj in batch], ts)
        starts = s.ref_positions(first, lines)
        try:
            await s.log.append(lines, first)
        except BaseException:
            self.deferred = deferred + self.deferred
            raise
        apply = s.state.apply
        for seq, (t, d, _), line, start in zip(range(first, first + len(batch)), batch, lines, starts):
            apply({"seq": seq, "ts": ts, "type": t, "data": d}, start, len(line))
            if t not in _KEEPS_EPOCH:
                s.epoch += 1
            elif t == ev.USAGE_REPORTED and self.on_usage is not None:
                self.on_usage(start)
        self._after_append()

    def enqueue(self, type_: str, data: Any, data_json: bytes) -> asyncio.Future[int]:
        """Queue an event for the next group commit; the future is done once it is durable and applied.

        A plain method returning the future (not a coroutine): ``add_message`` awaits it directly, one
        coroutine frame less per message. Each caller has its own future: a future shared by the group would
        be cancelled for all of them when one caller is cancelled.
        """
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((type_, data, data_json, fut))
        self._queued += 1
        if self._flush_task is None and self._gate is None:
            self._flush_task = asyncio.ensure_future(self._flush_pending())
        return fut

    async def drain(self) -> None:
        """Wait until every event queued before this call is written (or failed); events queued meanwhile are
        not waited for (a task that keeps appending does not starve ``erase`` or ``close``)."""
        target = self._queued
        while self._settled < target and self._flush_task is not None:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((target, fut))
            await asyncio.shield(fut)

    def _wake(self, done: bool = False) -> None:
        keep = []
        for target, fut in self._waiters:
            if done or self._settled >= target:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the log for a rewrite (an erase): wait for the group being written, then keep every commit
        waiting (queued events stay queued) until the block ends, so the state rebuilt from the new log is not
        overtaken by an append made meanwhile."""
        if self._gate is not None:
            raise RuntimeError("the log is already held for a rewrite")
        self._gate = asyncio.get_running_loop().create_future()
        try:
            while self._flush_task is not None:
                await asyncio.shield(self._flush_task)
            yield
        finally:
            gate, self._gate = self._gate, None
            if gate is not None and not gate.done():
                gate.set_result(None)
            if self._pending and self._flush_task is None:
                self._flush_task = asyncio.ensure_future(self._flush_pending())

    async def _flush_pending(self) -> None:
        """Group commit: everything queued so far goes out in one append (one write, one sync).

        The file log syncs on this thread, so the event loop waits for the fdatasync; callers that become ready
        meanwhile queue up and form the next group (docs/performance.md has the measurements).
        """
        s = self._s
        try:
            while self._pending and self._gate is None:
                pending, self._pending = self._pending, []
                deferred, self.deferred = self.deferred, []
                # audit records of earlier request views (no caller waits on them) go out with this group
                batch: list[tuple[str, Any, bytes, asyncio.Future[int] | None]] = [
                    (t, d, dj, None) for t, d, dj in deferred]
                batch += pending
                state = s.state
                first = state.head_seq + 1
                ts = codec.now_iso()  # one write, one time: the records of a group commit share it
                try:
                    lines = self._encode_run(first, [(type_, data_json) for type_, _, data_json, _ in batch], ts)
                    starts = s.ref_positions(first, lines)
                    await s.log.append(lines, first)
                except Exception as e:  # nothing of this group was applied: each of its callers gets the error
                    self.deferred = deferred + self.deferred
                    for *_, fut in batch:
                        if fut is not None and not fut.done():
                            fut.set_exception(e)
                    self._settled += len(pending)
                    self._wake()
                    continue
                apply = state.apply
                for seq, (type_, data, _, fut), line, start in zip(range(first, first + len(batch)), batch, lines,
                                                                    starts):
                    apply({"seq": seq, "ts": ts, "type": type_, "data": data}, start, len(line))
                    if type_ not in _KEEPS_EPOCH:
                        s.epoch += 1
                    elif type_ == ev.USAGE_REPORTED and self.on_usage is not None:
                        self.on_usage(start)
                    if fut is not None and not fut.done():  # (a cancelled caller's record is written all the same)
                        fut.set_result(seq)
                self._settled += len(pending)
                self._after_append()
                self._wake()
        finally:
            self._flush_task = None
            self._wake(done=True)

    def _after_append(self) -> None:
        """Periodic work after appends: a checkpoint every ``checkpoint_every`` events (in the background).

        The records are durable by now: nothing here may fail the append (or kill a batch's flush task)."""
        s = self._s
        try:
            s.checkpoints.maybe_write(s.state, s.log, s.tokenizer_name)
            if s.indexer is not None:
                self._notify_index()
        except Exception as e:
            logger.warning("session %s: work after an append failed (%s); the records are stored", s.session_id, e)

    def _notify_index(self) -> None:
        """Hand the search index's thread the session (and, after a change of the history, its keys: a copy of
        the packed array; not for a history still lazy, whose keys the thread folds from the log instead)."""
        from ..operations.search.snapshot import keys_snapshot

        s = self._s
        snapshot = None
        if s.epoch != s.indexed_epoch:
            s.indexed_epoch = s.epoch
            if not s.state.is_lazy:
                snapshot = keys_snapshot(s.state.head_seq, s.state.keys)
        s.indexer.notify(s.session_id, snapshot)

    async def close(self) -> None:
        """Wait for the group commit, then write the deferred audit records (close syncs the log); a failure to
        write them is logged (they are audit records only, never history). New writes are refused from here on
        (StoreClosedError), so the queue empties: every event queued before is written or failed, none is left
        in flight when the log closes."""
        self._s.closing = True
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)
        s = self._s
        if self.deferred and not s.readonly:
            try:
                await self.commit_with_deferred([])
            except Exception as e:
                logger.warning("session %s: could not record %d deferred audit event(s) (compaction, usage): %s", s.session_id,
                               len(self.deferred), e)
