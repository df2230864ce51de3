"""Live tail of a session's log file: every record appended by any process, exactly once, in order.

Correctness never depends on the file watcher. A cursor remembers the byte offset after the last record it
reported and, on every wake-up, reads from there to the end of the file, reporting only complete, verified
records. watchfiles (``awatch``) only decides *when* to look: right after the log changes, and at least
every ``poll_interval`` seconds in any case (so a notification lost or raised before the watcher started
costs latency, never an event).

What the cursor handles:
- growth: reads from the remembered offset; a record the writer is still writing (no newline yet, or a
  final line that does not verify) is waited for, not reported as corruption; the NUL bytes a writer
  reserves after its data (docs/format.md, "The reserved tail") end the data, like the end of the file;
- a writer restart: the new writer cuts a torn tail, so the file may shrink (never below what we reported)
  and grow again; if it ever shrinks below our offset or is replaced (new inode), the cursor re-reads from
  the start and re-synchronises by seq, checking that the last record it reported is still there unchanged
  (LogChangedError otherwise: records were removed or rewritten, which appending never does);
- other files written in the folder (checkpoints, lock): filtered out of the watch;
- a log (or folder) that does not exist yet: the nearest existing parent folder is watched until it appears.

A bad record followed by more data is corruption: LogCorruptedError names the line, as on open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..model import codec
from ..errors import LogChangedError, LogCorruptedError
from .segments import LogReader

logger = logging.getLogger("context_persistent")

#: Default upper bound, in seconds, between two looks at the file when no change is notified.
POLL_INTERVAL = 1.0
_READ_LIMIT = 8 << 20


class _Cursor:
    """Where a follower is in one log file (blocking reads; small, fast, called from the event loop)."""

    def __init__(self, path: Path, after_seq: int) -> None:
        self.path = path
        self.last_seq = after_seq
        self.last_crc: str | None = None
        self.offset = 0
        #: The line number of ``offset`` in its file, for messages (None: not counted, found when needed).
        self.line: int | None = 1
        self.ino: int | None = None
        #: The global position where the active segment started when last read (segments.py).
        self.base = 0
        #: The sealed segments (name, checksum) when the active file was last read: a roll only adds to them.
        self.sealed: tuple[tuple[str, str], ...] = ()
        #: True until the first record after ``last_seq`` is reached: records up to it are skipped.
        self.syncing = True
        self._expect: str | None = None
        self._limit = _READ_LIMIT

    def _restart(self) -> None:
        self.offset = 0
        self.ino = None
        self.line = 1
        self.syncing = True
        #: The last reported record must be found again, unchanged, before anything newer is reported.
        self._expect = self.last_crc

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """Complete, verified records after the cursor, and whether more may be readable right away."""
        try:
            reader = LogReader(self.path.parent)
        except FileNotFoundError:
            return [], False
        with reader:
            sealed = tuple((seg.name, seg.sha256) for seg in reader.segments)
            if sealed[:len(self.sealed)] != self.sealed:
                self._restart()  # a sealed segment was rewritten (an erasure): read it all again
                self.sealed = sealed
                return [], True
            if self.offset == 0 and self.syncing and self._expect is None and self.last_seq > 0:
                # The first read: start at the record after_seq (or shortly before it), found by its seq
                # without reading the log before it (segments.py, LogReader.anchor_for).
                anchor = reader.anchor_for(self.last_seq)
                if anchor is not None:
                    self.offset, self.line = anchor[1], None
            base = reader.base
            if self.offset < base:  # behind the active segment: read on through the sealed ones
                return self._read_sealed(reader, base)
            fd = reader.active_fd
            if fd < 0 or reader.active_is_sealed:
                return [], False  # (a roll between its steps: the next look sees the new active segment)
            st = os.fstat(fd)
            rel = self.offset - base
            # A new active file after a roll is expected; with the same sealed segments, it was rewritten.
            if self.ino is not None and ((st.st_ino != self.ino and sealed == self.sealed) or st.st_size < rel):
                self._restart()  # the file was replaced or cut below what we reported: read it all again
                return [], True
            self.ino, self.base, self.sealed = st.st_ino, base, sealed
            want = st.st_size - rel
            if want <= 0:
                return [], False
            raw = os.pread(fd, min(want, self._limit), rel)
        # A reserve_tail writer keeps NUL bytes reserved after its data (log.data_end): they end it.
        data = raw.rstrip(b"\0") if raw.endswith(b"\0") else raw
        data_end = st.st_size if len(data) == len(raw) else rel + len(data)
        more = len(raw) < want and data_end == st.st_size  # more of the file than this read holds
        end = data.rfind(b"\n") + 1
        if end == 0:
            if more:  # one record longer than the read limit: read more next time
                self._limit *= 2
                return [], True
            return [], False  # a record being written: wait for its newline
        self._limit = _READ_LIMIT
        out = self._parse(data, end, at_eof=rel + end >= data_end)
        return out, more

    def _read_sealed(self, reader: LogReader, base: int) -> tuple[list[dict[str, Any]], bool]:
        """Records of the sealed segments from the cursor on (up to about the read limit)."""
        parts: list[bytes] = []
        n = 0
        for _, line in reader.lines(self.offset, base):
            parts.append(line)
            n += len(line)
            if n >= self._limit:
                break
        data = b"".join(parts)
        return self._parse(data, len(data), at_eof=False), True

    def _parse(self, data: bytes, n: int, at_eof: bool) -> list[dict[str, Any]]:
        """Records in ``data[:n]`` (whole lines); stops before a bad last line when it ends the file."""
        out: list[dict[str, Any]] = []
        pos = 0
        decode = codec.decode
        while pos < n:
            nl = data.find(b"\n", pos, n)
            line = data[pos:nl + 1]
            try:
                rec = decode(line)
            except codec.RecordError as e:
                if at_eof and not _valid_record_after(data, pos, nl, n):
                    break  # a torn tail (no valid record after it) that the next writer will cut: wait
                raise self._corrupt(str(e)) from None
            seq = rec["seq"]
            if seq <= self.last_seq:
                if not self.syncing:
                    raise self._corrupt(f"seq {seq} does not follow seq {self.last_seq}")
                if seq == self.last_seq and self._expect is not None:
                    if rec.get("crc") != self._expect:
                        raise LogChangedError(f"{self.path}: the record at seq {seq} changed after it was "
                                              "reported (the log was rewritten, not appended to); follow again "
                                              "from a known seq")
                    self._expect = None
            else:
                if self._expect is not None:
                    raise LogChangedError(f"{self.path}: the record at seq {self.last_seq} that was already "
                                          "reported is no longer in the log (it was rewritten, not appended "
                                          "to); follow again from a known seq")
                self.syncing = False
                self.last_seq = seq
                self.last_crc = rec.get("crc")
                out.append(rec)
            pos = nl + 1
            self.offset += len(line)
            if self.line is not None:
                self.line += 1
        return out

    def _corrupt(self, reason: str) -> LogCorruptedError:
        """LogCorruptedError for the record at the cursor (its line number counted now if it was not)."""
        if self.line is not None:
            return LogCorruptedError(str(self.path), self.line, self.offset, reason)
        with LogReader(self.path.parent) as reader:
            path, offset = reader.where(self.offset)
            return LogCorruptedError(str(path), reader.line_number(self.offset), offset, reason)


def _valid_record_after(data: bytes, pos: int, nl: int, n: int) -> bool:
    """Whether a valid record follows the bad line ``data[pos:nl]``, inside it (a lost newline merged two
    records) or on a later line up to ``n``: then the bad bytes are corruption, not a torn tail (the rule
    the log applies on open, docs/operations.md)."""
    if any(rec is not None for _, _, rec, _ in codec.split_records(data[pos:nl])[1:]):
        return True
    start = nl + 1
    while start < n:
        end = data.find(b"\n", start, n)
        try:
            codec.decode(data[start:end + 1])
            return True
        except codec.RecordError:
            start = end + 1
    return False


class _Watch:
    """An ``awatch`` on the log's folder (or its nearest existing parent until the folder exists).

    The watcher runs in its own task so that cancelling the follower is immediate: on close, a
    thread-safe stop event ends the watcher thread within ``step`` ms and the task is awaited, so nothing
    is left running.
    """

    def __init__(self, path: Path, poll_interval: float) -> None:
        self.path = path
        self.poll_ms = max(1, int(poll_interval * 1000))
        self._gen: Any = None
        self._watched: Path | None = None
        self._stop: threading.Event | None = None
        self._task: asyncio.Future[Any] | None = None

    def _target(self) -> Path:
        d = self.path.parent
        while not d.is_dir() and d != d.parent:
            d = d.parent
        return d

    async def _start(self) -> None:
        from watchfiles import awatch

        target = self._target()
        name = self.path.name
        self._watched = target
        self._stop = threading.Event()
        watch_filter = (lambda _c, p: os.path.basename(p) == name) if target == self.path.parent else None
        self._gen = awatch(target, watch_filter=watch_filter, debounce=50, step=10, stop_event=self._stop,
                           rust_timeout=self.poll_ms, yield_on_timeout=True, recursive=False)

    async def wait(self, stop_event: asyncio.Event | None) -> None:
        """Return after a change in the watched folder, a poll interval, or ``stop_event`` being set."""
        if self._gen is None or self._watched != self._target():
            await self.close()
            await self._start()
        if self._task is None:
            self._task = asyncio.ensure_future(self._gen.__anext__())
        waiters: set[asyncio.Future[Any]] = {self._task}
        stopper = asyncio.ensure_future(stop_event.wait()) if stop_event is not None else None
        if stopper is not None:
            waiters.add(stopper)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopper is not None:
                stopper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stopper
        if self._task.done():
            task, self._task = self._task, None
            try:
                task.result()
            except StopAsyncIteration:  # the watcher ended (its folder went away): start again next time
                await self.close()
            except (OSError, RuntimeError) as e:  # the watcher failed; reads stay correct, so poll instead
                logger.debug("watching %s failed (%s); polling every %d ms", self._watched, e, self.poll_ms)
                await self.close()
                await asyncio.sleep(self.poll_ms / 1000)

    async def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(StopAsyncIteration, asyncio.CancelledError, OSError, RuntimeError):
                await task
        gen, self._gen = self._gen, None
        if gen is not None:
            with contextlib.suppress(OSError, RuntimeError):
                await gen.aclose()
        self._stop = None


async def follow_file(path: str | os.PathLike[str], after_seq: int = 0, *,
                      stop_event: asyncio.Event | None = None,
                      poll_interval: float = POLL_INTERVAL) -> AsyncIterator[dict[str, Any]]:
    """Records of the log at ``path`` with ``seq > after_seq``, as they are appended, until cancelled.

    Each record is the parsed envelope (``v``, ``seq``, ``ts``, ``type``, ``data``, ``crc``). Ends after a
    last read when ``stop_event`` is set. Use ``contextlib.aclosing`` when breaking out early, so the
    watcher stops at once rather than when the generator is collected.
    """
    if isinstance(after_seq, bool) or not isinstance(after_seq, int) or after_seq < 0:
        raise ValueError(f"after_seq must be an integer >= 0, got {after_seq!r}")
    if poll_interval <= 0:
        raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
    cursor = _Cursor(Path(path), after_seq)
    watch = _Watch(Path(path), poll_interval)
    try:
        while True:
            records, more = cursor.read()
            for rec in records:
                yield rec
            if more:
                await asyncio.sleep(0)
                continue
            if stop_event is not None and stop_event.is_set():
                return
            await watch.wait(stop_event)
    finally:
        await watch.close()
