"""The running SHA-256 of the active segment, so that sealing it needs no re-read of the file.

The writer feeds every acknowledged write to :meth:`RunningHash.wrote` (the bytes exactly as written at their
offset; reserved-tail NULs are never fed, as they are not data). A write that failed and was rolled back is
never fed, so the hash always covers a prefix of the acknowledged data.

A segment that already held data when the writer opened it (or that an erase replaced) starts with a prefix
nobody has hashed yet. :meth:`start_catch_up` (called by the writer once the segment nears its roll:
log.py, ``CATCH_UP_SHIFT``) hashes it in a background thread from a duplicate of the file
descriptor, in chunks, and then the bytes appended meanwhile, until it reaches the hash's own position:
appends never wait for it. :meth:`digest` (at seal time) finishes whatever is left on the calling thread.
While it reads that prefix back it also checks its records (each a whole line whose checksum holds, seqs
increasing), as sealing always has: an open with a checkpoint does not read the records before it, and a
damaged one must not be sealed with a checksum that vouches for it. :meth:`digest` raises the first problem.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from ..model import codec
from ..errors import LogCorruptedError

#: Bytes read per step while catching up on a prefix.
CHUNK = 4 << 20


class RunningHash:
    """SHA-256 of the first ``end`` bytes of one file, fed as the writer writes and caught up from the file."""

    def __init__(self, fd: int, known: int, where: Path | None = None, after_seq: int = 0) -> None:
        """``known``: bytes the file holds already (to read back and check: records after seq ``after_seq``;
        ``where`` names the file in errors); the writer appends after them."""
        self._where = str(where)
        self._known = known
        self._last_seq = after_seq
        self._partial = b""
        self._lineno = 0
        self._checked = 0
        self.error: LogCorruptedError | None = None
        self._lock = threading.Lock()
        self._sha = hashlib.sha256()
        self._fd = os.dup(fd) if known else -1
        #: Bytes hashed so far, and the acknowledged data size (the hash covers it once caught up).
        self.end = 0
        self.size = known
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Bytes read back from the file (tests check that a fresh segment is never read back).
        self.read_back = 0

    def wrote(self, start: int, data: bytes) -> None:
        """``data`` was written and acknowledged at offset ``start`` (the previous data end)."""
        with self._lock:
            if self.end == start:
                self._sha.update(data)
                self.end = start + len(data)
            self.size = start + len(data)  # else: the catch-up reads it from the file

    def start_catch_up(self) -> None:
        """Hash the not-yet-hashed bytes in a background thread (no-op when there are none)."""
        with self._lock:
            if self.end >= self.size or self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._background, name="context-persistent-hash", daemon=True)
            self._thread.start()

    def _background(self) -> None:
        with contextlib.suppress(OSError):  # (digest() reads on and raises it, at the next roll)
            self._catch_up()

    def _catch_up(self) -> None:
        while True:
            with self._lock:
                pos, size, fd = self.end, self.size, self._fd
                if pos >= size or self._closed:
                    return
            chunk = os.pread(fd, min(CHUNK, size - pos), pos)
            if not chunk:
                raise OSError(f"the active segment ends at byte {pos}, before its data end {size}")
            with self._lock:
                if self._closed:
                    return
                if self.end == pos:
                    self._sha.update(chunk)
                    self.end = pos + len(chunk)
                    self.read_back += len(chunk)
                    if pos < self._known and self.error is None:
                        self._check(chunk[:self._known - pos])

    def _check(self, data: bytes) -> None:
        """Check the whole records in ``self._partial + data`` (bytes of the known prefix, in order)."""
        buf = self._partial + data
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl + 1]
            self._lineno += 1
            try:
                seq, _ = codec.checked_seq(line)
                if seq <= self._last_seq:
                    raise codec.RecordError(f"seq {seq} does not follow seq {self._last_seq}")
            except codec.RecordError as e:
                self.error = LogCorruptedError(self._where, self._lineno, self._checked,
                                               f"{e}; the segment was not sealed")
                return
            self._last_seq = seq
            self._checked += len(line)
            start = nl + 1
        self._partial = buf[start:]
        if self._checked + len(self._partial) >= self._known and self._partial:
            self.error = LogCorruptedError(self._where, self._lineno + 1, self._checked,
                                           "the line has no newline (a record cut short); the segment was not sealed")

    def digest(self) -> str:
        """``sha256:<hex>`` of the whole acknowledged data; finishes any catch-up on this thread first."""
        self._catch_up()
        with self._lock:
            if self.error is not None:
                raise self.error
            if self.end != self.size:
                raise OSError(f"the running hash covers {self.end} bytes, not the {self.size} of the data")
            return "sha256:" + self._sha.hexdigest()

    def close(self) -> None:
        """Stop a catch-up (it ends at its next chunk) and release the descriptor once it has."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


__all__ = ["RunningHash"]
