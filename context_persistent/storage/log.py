"""The file event log: one append-only JSONL file per session (I/O only; it decides no policy).

That file, ``events.jsonl``, is the log's active segment: once it reaches ``segment_bytes`` (or on ``roll()``)
it is sealed into an immutable segment listed in the manifest and a new one starts (manifest.py,
segment_store.py; docs/format.md, "Segments"). Positions are global across segments; a log that never rolled
is a single file, as every log was before segments.

This module holds the writer: open, append, roll, replace, close. Reading and verifying the records is
log_reading.py (``read_batches``, ``record_before``), what a crash leaves after the last record torn_tail.py.

Blocking system calls live in plain methods. Appending runs the write and the ``fdatasync`` directly on the
caller's thread, in every fsync mode: a thread hop costs more than the sync itself on fast disks (about
0.1-0.25 ms per hop on the benchmark host, see docs/performance.md), agent turns are seconds apart, and with
``fsync="batch"`` callers that arrive during a sync simply join the next group.

By default every record is a plain append at the end of the file, so the live file is valid JSONL at every
instant. With ``reserve_tail=True`` (opt-in, ``fsync="always"`` only) records are written with ``pwrite`` at
the data end, over NUL bytes written ahead of time (the reserved tail, ``RESERVE``), so the ``fdatasync`` has
no new file size to commit; every reader ends the data at the last non-NUL byte (``data_end``), and ``close``
truncates the zeros (docs/format.md). Logs written either way are read the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..model import codec
from ..errors import (ConcurrencyError, LogCorruptedError, LogWriteError, SessionNotFoundError, SessionTrashedError,
                      UnsafeStorageError)
from . import log_reading
from .paths import (LOCK_NAME, LOG_NAME, check_storage_root, fsync_dir, make_private_dirs, open_private_dir,
                    open_private_file, write_all)
from .running_hash import RunningHash
from .segment_store import SealSummary, compress_segment, recover, replace_segments, seal_active
from .lockfile import FileLock
from .records import RESERVE, RESERVE_MAX, crash_leaves, data_end, data_size, line_at, scan
from .manifest import MIN_SEGMENT_BYTES, SEGMENT_BYTES, Manifest, Segment, check_segment_bytes
from .segments import LogReader, read_line_at
from .torn_tail import TornTail, save_torn_tail

logger = logging.getLogger("context_persistent")

FSYNC_MODES = ("always", "batch", "never")


def _check_not_moved(directory: Path, dir_fd: int, session_id: str, lock: FileLock) -> None:
    """After taking the lock: the folder must still be at ``directory``. Retention (trash.py) moves a session
    folder while holding its lock; a writer that opened the folder just before that would otherwise write into
    the trash entry. SessionTrashedError (or an OSError) then, with the lock released."""
    try:
        here = os.stat(directory, follow_symlinks=False)
    except FileNotFoundError:
        here = None
    held = os.fstat(dir_fd)
    if here is not None and (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
        return
    lock.release()
    from .trash_folder import check_not_trashed

    check_not_trashed(directory.parent, session_id)
    raise FileNotFoundError(errno.ENOENT, "the session folder was moved while it was being opened", str(directory))


#: A reopened active segment's prefix is hashed (and its records checked) in the background only once the
#: segment is within ``segment_bytes >> CATCH_UP_SHIFT`` (a quarter) of its roll, or a roll is asked for: a
#: process that will not roll it (the Amplifier CLI's, one per turn) never reads it back, and a seal that
#: comes sooner (``roll()``) catches up on its own thread (running_hash.py). It was read back by every writer,
#: 0.4-0.5 s of CPU in a thread that holds the GIL for a 50 MB segment (docs/performance.md).
CATCH_UP_SHIFT = 2

class FileEventLog:
    """The file backend of :class:`~context_persistent.storage.eventlog.EventLog`: ``<session>/events.jsonl`` and the
    sealed segments before it.

    The constructor takes the writer lock (unless ``readonly``) and creates the file with mode 0600,
    fsyncing it into its folder. Not thread-safe; one owner per instance.
    """

    def __init__(self, directory: Path, session_id: str, *, readonly: bool = False, fsync: str = "always",
                 create: bool = True, reserve_tail: bool = False, segment_bytes: int | None = None,
                 compress_sealed: bool = False) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}; got {fsync!r}")
        self.segment_bytes = check_segment_bytes(segment_bytes)
        if not isinstance(compress_sealed, bool):
            raise ValueError(f"compress_sealed must be true or false, got {compress_sealed!r}")
        self.compress_sealed = compress_sealed
        #: The sealed segments (manifest.py); None for a single-file log (no manifest).
        self._manifest: Manifest | None = None
        #: The running SHA-256 of the active segment (running_hash.py), and its first record's seq and crc
        #: once known: what sealing it needs, without reading it back.
        self._hash: RunningHash | None = None
        self._active_first: tuple[int, str] | None = None
        #: The compression of the segment sealed last, running in a worker thread (``compress_sealed``).
        self._compressing: threading.Thread | None = None
        #: The global position where the active segment (``events.jsonl``) starts.
        self.base = 0
        #: What open did to finish or roll back a roll, compression or rewrite a killed writer left midway.
        self.recovered: list[str] = []
        self._reader: LogReader | None = None
        self._roll_error: Exception | None = None
        self._roll_next = False
        self.directory = directory
        self.session_id = session_id
        self.path = directory / LOG_NAME
        self.readonly = readonly
        self.fsync_mode = fsync
        self.existed = self.path.exists()
        self.last_seq = 0
        #: The crc of the record at ``last_seq`` (the next record's ``prev``; codec.Links), once known.
        self.last_crc: bytes | None = None
        self.torn: TornTail | None = None
        #: ``(start, end)`` byte offsets of each record of the batch ``read_batches`` yielded last (the same
        #: order): where a paged history finds its messages again (pages.py).
        self.batch_spans: list[tuple[int, int]] = []
        self._lock: FileLock | None = None
        self._fd = -1
        self.size = 0
        #: The file's size: ``size`` plus the reserved tail (NUL bytes) while the writer reserves.
        self._reserved = 0
        self._reserving = reserve_tail and fsync == "always"
        self._lines = 0
        #: Set when a failed write could not be rolled back: appends are refused until the log is reopened.
        self._broken: OSError | None = None
        if readonly:
            try:
                self._reader = LogReader(directory, session_id)
            except FileNotFoundError:
                raise SessionNotFoundError(f"session {session_id!r} not found: no {self.path}") from None
            self.existed = True
            if self._reader.segments or self._reader.manifest.boundary is not None:
                self.manifest = self._reader.manifest
            self.base = self._reader.base
            self.size = self._reader.active_size()  # a consistent prefix: what was there at open
            return
        if not self.existed and not create:
            raise SessionNotFoundError(f"session {session_id!r} not found: no {self.path}")
        dir_fd = -1
        try:
            make_private_dirs(directory)
            check_storage_root(directory.parent)
            # Every file is opened relative to the verified folder, never through a symbolic link.
            dir_fd = open_private_dir(directory)
            self._lock = FileLock(directory / LOCK_NAME, session_id, dir_fd)
            _check_not_moved(directory, dir_fd, session_id, self._lock)
        except (UnsafeStorageError, SessionTrashedError):
            if dir_fd >= 0:
                os.close(dir_fd)
            raise
        except OSError as e:
            if dir_fd >= 0:
                os.close(dir_fd)
            raise LogWriteError(str(directory), "open the session folder", e, "nothing was written") from e
        try:
            self.manifest, self.recovered = recover(directory, session_id)
            if self.manifest is not None:
                self.base = self.manifest.base
            self.existed = os.path.lexists(self.path) or self.manifest is not None
            # Not O_APPEND: records are written at ``self.size``, which may be inside the reserved tail.
            self._fd = open_private_file(dir_fd, LOG_NAME, os.O_RDWR | os.O_CREAT, directory)
            if not self.existed:
                os.fsync(self._fd)
                os.fsync(dir_fd)
            self._reserved = os.fstat(self._fd).st_size
            self.size = data_end(self._fd, self._reserved)
            if self._reserved > self.size and not self._reserving:
                # A reserved tail left by a writer that crashed: without reserving, the live file ends with its
                # last record from the start (plain JSONL), so cut the zeros now rather than at the first append.
                os.ftruncate(self._fd, self.size)
                os.fdatasync(self._fd)
                self._reserved = self.size
            self._new_hash(self.size)
        except BaseException as e:
            self._release()
            if isinstance(e, OSError) and not isinstance(e, UnsafeStorageError):
                raise LogWriteError(str(self.path), "open for writing", e, "nothing was written") from e
            raise
        finally:
            os.close(dir_fd)

    @property
    def manifest(self) -> Manifest | None:
        """The manifest of the segmented log (None for a single-file log). While the segment sealed last is
        being compressed in the background, reading this waits for that to finish, so that what it lists is on
        disk."""
        self._wait_compressing()
        return self._manifest

    @manifest.setter
    def manifest(self, value: Manifest | None) -> None:
        self._manifest = value

    @property
    def position(self) -> int:
        """The global position after the last valid record (manifest.py: positions)."""
        return self.base + (self.size if self.torn is None else self.torn.offset)

    def first_crc(self) -> str | None:
        """The first record's crc as the manifest recorded it when its segment was sealed (None for a log
        without sealed segments: read the record)."""
        return self.manifest.segments[0].first_crc if self.manifest is not None and self.manifest.segments else None

    def reader(self) -> LogReader:
        """A :class:`~context_persistent.storage.segments.LogReader` of this log (the caller closes it). Read-only, the
        files the log was opened on: an erasure or expiry meanwhile changes nothing this log reads."""
        if self._reader is not None:
            return self._reader.copy()
        return LogReader(self.directory, self.session_id)

    # -- reading (log_reading.py) ------------------------------------------------------------------
    def record_before(self, position: int) -> dict[str, Any] | None:
        """The valid record that ends exactly at global byte ``position``, else None (checkpoint anchor check)."""
        return log_reading.record_before(self, position)

    def read_batches(self, after_seq: int = 0, position: int | None = None,
                     batch: int = 4096) -> AsyncIterator[list[dict[str, Any]]]:
        """Valid records with ``seq > after_seq`` in lists of up to ``batch`` (eventlog.py); records the torn
        tail found after the last valid one in ``torn``, each batch's byte spans in ``batch_spans``."""
        return log_reading.read_batches(self, after_seq, position, batch)

    def _records(self, start: int) -> Iterator[tuple[dict[str, Any], int]]:
        """``(record, global end)`` of every valid record from global ``start``, across segments."""
        return log_reading.records(self, start)

    def cut_torn_tail(self) -> TornTail | None:
        """Move the torn bytes to a side file, truncate the log to the valid prefix, fsync both."""
        torn = self.torn
        if torn is None or self.readonly:
            return None
        side = save_torn_tail(self.directory, self.path, self._fd, torn)
        self.size = self._reserved = torn.offset
        self._new_hash(torn.offset)
        torn.saved_to = str(side)
        self.torn = None
        return torn

    # -- writing ------------------------------------------------------------------------------------
    async def append(self, lines: Sequence[bytes], first_seq: int) -> None:
        if self.readonly or self._fd < 0:
            raise LogWriteError(str(self.path), "append to", OSError(errno.EBADF, "log is not open for writing"))
        if first_seq != self.last_seq + 1:
            raise ConcurrencyError(
                f"{self.path}: expected to append seq {self.last_seq + 1}, got {first_seq}"
            )
        if self._broken is not None:
            raise LogWriteError(str(self.path), "append to", self._broken,
                                "an earlier failed write could not be rolled back, so this store refuses to "
                                "append; close it and open the session again (open recovers the log)")
        data = lines[0] if len(lines) == 1 else b"".join(lines)
        start = self.size
        self._write(data, len(lines) == 1)
        if self.fsync_mode != "never":
            self._sync(start)
        if start == 0:
            self._active_first = (first_seq, lines[0][-11:-3].decode())
        if self._hash is not None:  # acknowledged: the running hash takes exactly these bytes
            self._hash.wrote(start, data)
            if self._roll_next or self.segment_bytes and self.size >= self.segment_bytes - (
                    self.segment_bytes >> CATCH_UP_SHIFT):
                self._hash.start_catch_up()
        self.last_seq = first_seq + len(lines) - 1
        self.last_crc = data[-11:-3]  # (codec.crc_of of the last record)
        if (self._roll_next or self.segment_bytes and self.size >= self.segment_bytes) and self._roll_error is None:
            self._roll_next = False
            self._roll_after_append()

    def roll_after_next_append(self) -> None:
        """Seal the active segment right after the next append (``roll_on_compaction``: the manager asks this
        when it records a compaction, whose audit record goes out with the next append)."""
        self._roll_next = True
        if self._hash is not None:
            self._hash.start_catch_up()

    def _roll_after_append(self) -> None:
        """Roll once the active segment has reached ``segment_bytes``. The records are already acknowledged:
        a roll that fails is logged and not retried by this store (the log stays correct, only longer)."""
        try:
            self.roll()
        except (OSError, LogCorruptedError, ValueError) as e:
            self._roll_error = e
            logger.warning("%s: could not seal the active segment (%s); it grows on until the session is opened "
                           "again", self.path, e)

    def roll(self) -> Segment | None:
        """Seal the active segment (it becomes the next sealed segment, listed in the manifest with its
        checksum) and start a new, empty one. Returns the sealed segment, or None if the active segment holds
        no record. With ``compress_sealed``, the sealed segment is then compressed. See docs/operations.md."""
        if self.readonly or self._fd < 0:
            raise LogWriteError(str(self.path), "roll", OSError(errno.EBADF, "log is not open for writing"))
        self._wait_compressing()
        if self._broken is not None or self.torn is not None or self.size == 0:
            return None
        try:
            if self._reserved > self.size:
                os.ftruncate(self._fd, self.size)
                self._reserved = self.size
            os.fsync(self._fd)
            summary = self._seal_summary()
        except LogCorruptedError:
            raise
        except (OSError, codec.RecordError) as e:
            raise LogWriteError(str(self.path), "sync before sealing", OSError(errno.EIO, str(e))
                                if isinstance(e, codec.RecordError) else e, "the log is unchanged") from e
        manifest = self.manifest if self.manifest is not None else Manifest(self.session_id)
        try:
            manifest, seg, fd = seal_active(self.directory, manifest, self.size, summary)
        except OSError as e:
            self._broken = e  # the next open finishes or undoes the roll (segment_store.recover)
            raise LogWriteError(str(self.path), "seal", e, "the records are safe; appends are refused until the "
                                "session is opened again, which finishes the roll") from e
        os.close(self._fd)
        self._fd = fd
        self.manifest = manifest
        self.base = manifest.base
        self.size = self._reserved = 0
        self._new_hash(0)
        if self.compress_sealed:
            self._compressing = threading.Thread(target=self._compress, args=(manifest, len(manifest.segments) - 1),
                                                 name="context-persistent-compress", daemon=True)
            self._compressing.start()
        return seg

    def _compress(self, manifest: Manifest, index: int) -> None:
        """Compress sealed segment ``index`` (a worker thread, after the seal is committed; appends go on
        meanwhile, and every other change of the manifest waits for it: ``_wait_compressing``)."""
        try:
            self._manifest = compress_segment(self.directory, manifest, index)
        except BaseException as e:
            # Perhaps committed and not carried out: the next open finishes it (segment_store.recover).
            self._broken = e if isinstance(e, OSError) else OSError(errno.EIO, str(e))
            logger.warning("%s: could not compress %s (%s); appends are refused until the session is opened "
                           "again, which finishes or undoes the compression", self.path,
                           manifest.segments[index].name, e)

    def _wait_compressing(self) -> None:
        thread = self._compressing
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._compressing = None

    def _new_hash(self, known: int) -> None:
        """Start a running hash for the active file as it is now (``known`` bytes of data in it)."""
        if self._hash is not None:
            self._hash.close()
        segments = self._manifest.segments if self._manifest is not None else ()
        self._hash = RunningHash(self._fd, known, self.path, segments[-1].last_seq if segments else 0)
        self._active_first = None

    def _seal_summary(self) -> SealSummary:
        """What the manifest records of the active segment when it is sealed, from what the writer tracked:
        only its first record is read back (when the segment held data before this writer opened it)."""
        assert self._hash is not None
        first = self._active_first
        if first is None:
            line = b""
            while not line.endswith(b"\n"):
                chunk = os.pread(self._fd, 1 << 16, len(line))
                if not chunk:
                    raise codec.RecordError("the active segment's first record has no newline")
                line += chunk
                if b"\n" in chunk:
                    line = line[:line.index(b"\n") + 1]
            seq, crc = codec.checked_seq(line)
            first = (seq, crc.decode())
        if self.last_crc is None:
            raise codec.RecordError("the crc of the last record is not known")
        return SealSummary(first[0], first[1], self.last_seq, self.last_crc.decode(), self._hash.digest())

    def _write(self, data: bytes, one_record: bool = True) -> None:
        start = self.size
        end = start + len(data)
        fd = self._fd
        try:
            if self._reserving and one_record:
                if end > self._reserved:
                    self._reserve(end)
            elif self._reserved > start:
                # Several records in one write go to the end of the file, never into reserved space: after a
                # power loss, reserved space may hold the later pages of a write without the earlier ones,
                # and a complete record after a hole would read as corruption (docs/format.md).
                os.ftruncate(fd, start)
                self._reserved = start
            write_all(fd, data, start)
        except OSError as e:
            raise self._failed(start, "append to", e) from e
        self.size = end
        if end > self._reserved:
            self._reserved = end

    def _reserve(self, end: int) -> None:
        """Write NUL bytes past ``end``, so that the next appends overwrite space that is allocated and written.

        Written zeros, not ``posix_fallocate``: a fallocated extent is "unwritten", and the first write into
        each of its blocks converts it, a metadata change the fdatasync must commit (4 KB records became
        slower than a plain append; measured, docs/performance.md). If the zeros cannot be written (a full
        disk), the record is appended without reserved space: the reservation saves time, it never fails an
        append.
        """
        target = end + min(max(RESERVE, end >> 4), RESERVE_MAX)  # 1/16 of the log ahead, within bounds
        try:
            write_all(self._fd, bytes(target - self._reserved), self._reserved)
            self._reserved = target
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)  # drop the zeros that did land
            self._reserved = max(self.size, os.fstat(self._fd).st_size)

    def _sync(self, rollback_to: int) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise self._failed(rollback_to, "fsync", e) from e

    def _failed(self, size: int, op: str, cause: OSError) -> LogWriteError:
        """Roll the file back to ``size`` (the last acknowledged record) and describe the failure."""
        try:
            os.ftruncate(self._fd, size)
            restored = os.fstat(self._fd).st_size == size
        except OSError:
            restored = False
        self.size = self._reserved = size
        if restored:
            return LogWriteError(str(self.path), op, cause)
        self._broken = cause
        return LogWriteError(str(self.path), op, cause,
                             "the record was not acknowledged, and the log could not be rolled back, so this "
                             "store refuses further appends; open the session again to recover the log")

    def swap_in(self, new: Path, size: int) -> None:
        """Replace the log by the complete, fsynced file ``new`` (``size`` bytes, same records up to edits
        that keep every seq and crc: erasure.py) with one atomic rename, and continue writing to it."""
        if self.readonly or self._fd < 0:
            raise LogWriteError(str(self.path), "replace", OSError(errno.EBADF, "log is not open for writing"))
        try:
            fd = os.open(new, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise LogWriteError(str(new), "open", e, "the log was not changed") from e
        try:
            os.replace(new, self.path)  # the commit point: readers see the old file or the new one
        except OSError as e:
            os.close(fd)
            raise LogWriteError(str(self.path), "replace", e, "the log was not changed") from e
        os.close(self._fd)
        self._fd = fd
        self.size = self._reserved = size
        self._new_hash(size)
        fsync_dir(self.directory)

    def replace_segments(self, new_data: dict[int, bytes], active_tmp: str | None) -> None:
        """Replace sealed segments' contents (index -> new bytes of the same length and records) and, with
        ``active_tmp``, the active segment by that complete, fsynced temp file in the session folder, in one
        commit (segment_store.replace_segments), and continue writing to the new active file."""
        if self.readonly or self._fd < 0 or self.manifest is None:
            raise LogWriteError(str(self.path), "replace", OSError(errno.EBADF, "log is not open for writing"))
        fd = -1
        if active_tmp is not None:
            fd = os.open(self.directory / active_tmp, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.manifest = replace_segments(self.directory, self.manifest, new_data, active_tmp)
            self.base = self.manifest.base
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            self._broken = e if isinstance(e, OSError) else OSError(errno.EIO, str(e))  # (reopen recovers)
            raise
        if fd >= 0:
            os.close(self._fd)
            self._fd = fd
            self.size = self._reserved = os.fstat(fd).st_size
            self._new_hash(self.size)

    # -- following ----------------------------------------------------------------------------------
    async def follow(self, after_seq: int = 0) -> AsyncIterator[dict[str, Any]]:
        from .follow import follow_file

        async for rec in follow_file(self.path, after_seq):
            yield rec

    # -- closing ------------------------------------------------------------------------------------
    async def close(self) -> None:
        if self._compressing is not None:  # wait for a background compression without stalling the loop
            await asyncio.to_thread(self._wait_compressing)
        self._release()

    def _release(self) -> None:
        self._wait_compressing()  # before the lock goes: no other writer may open while it runs
        if self._hash is not None:
            self._hash.close()
            self._hash = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        error: OSError | None = None
        if self._fd >= 0:
            try:
                if self._reserved > self.size and self._broken is None:
                    with contextlib.suppress(OSError):  # (if not, readers still stop at the zeros)
                        os.ftruncate(self._fd, self.size)  # a closed log ends with its last record
                if self.fsync_mode != "always" and self._broken is None:
                    os.fdatasync(self._fd)
            except OSError as e:
                error = e
            finally:
                os.close(self._fd)
                self._fd = -1
        if self._lock is not None:
            self._lock.release()  # always: a failed flush must not leave the session locked
            self._lock = None
        if error is not None:
            raise LogWriteError(str(self.path), "flush", error,
                                f"records appended with fsync={self.fsync_mode!r} may not all be durable")


#: Reading the log by global position across its segments (segments.py), importable from here too:
#: ``read_line_at(folder, position)`` for one record, ``LogReader(folder)`` for many (``lines``, ``read_line_at``).
__all__ = ["FSYNC_MODES", "MIN_SEGMENT_BYTES", "RESERVE", "RESERVE_MAX", "SEGMENT_BYTES", "FileEventLog", "FileLock",
           "LogReader", "TornTail", "check_segment_bytes", "crash_leaves", "data_end", "data_size", "line_at",
           "read_line_at", "scan"]
