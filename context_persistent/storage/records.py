"""Reading a log file's records in order: where its data ends (before a reserved tail), scanning its records
with their CRCs checked, and telling a torn tail from corruption (I/O; shared by the log, its segments and the
operations that read a session's files)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LogCorruptedError
from ..model import codec
from .paths import LOG_NAME

if TYPE_CHECKING:
    from .segments import LogReader


#: With ``reserve_tail`` (and ``fsync="always"``) the writer keeps this much space allocated ahead of its data
#: (at least), so that a durable append does not change the file's size: an fdatasync that has no size to
#: commit costs a quarter to a third less on ext4 here (docs/format.md, "The reserved tail"; docs/performance.md).
RESERVE = 64 << 10
RESERVE_MAX = 1 << 20


def data_end(fd: int, size: int | None = None) -> int:
    """Where the data of a log ends: its size less the run of NUL bytes that ends it (the reserved tail).

    No record contains a NUL byte (JSON escapes it), so the trailing NULs are space reserved by a writer
    (``RESERVE``): the log's contents end before them. ``size`` defaults to the file's current size.
    """
    while True:
        end = os.fstat(fd).st_size if size is None else size
        step = 4096
        while end > 0:
            n = min(step, end)
            chunk = os.pread(fd, n, end - n)
            if len(chunk) != n:  # the file shrank meanwhile (a writer closing): look again
                break
            kept = len(chunk.rstrip(b"\0"))
            if kept:
                return end - n + kept
            end -= n
            step = min(step * 4, 1 << 20)
        else:
            return 0
        size = None


def data_size(path: Path) -> int:
    """The size of the log at ``path`` without its reserved tail (see ``data_end``)."""
    with open(path, "rb") as f:
        return data_end(f.fileno())


def line_at(path: Path, offset: int) -> int:
    """The 1-based line number of the byte at ``offset`` (counts newlines; used only to report errors)."""
    count = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count + 1


def _valid_record_ahead(lines: Iterator[bytes], bad_line: bytes, end: int, size: int) -> bool:
    """True if a valid record is merged into ``bad_line`` or follows it (within ``size``).

    A crash only ever leaves an incomplete write at the end, never a complete record after garbage; so bad
    bytes with nothing valid after them are a torn tail, and bad bytes before a valid record are corruption.
    """
    if any(rec is not None for _, _, rec, _ in codec.split_records(bad_line[:-1])):
        return True
    for line in lines:
        end += len(line)
        if end > size or line[-1:] != b"\n":
            return False
        if any(rec is not None for _, _, rec, _ in codec.split_records(line[:-1])):
            return True
    return False


def crash_leaves(line: bytes) -> bool:
    """Whether a crash can leave ``line`` (a bad line with no valid record after it) at the end of a log.

    A write cut short leaves a line without its newline, and space the file system had not written yet
    reads as NUL bytes; a complete, newline-terminated line without NUL bytes that fails its checksum was
    written whole and then changed (a flipped bit, an edit): corruption, not a torn tail. Applies where the
    records before it were synced (``fsync`` ``always`` and ``batch``; docs/format.md).
    """
    return line[-1:] != b"\n" or line.find(b"\0") >= 0


def scan(path: Path | LogReader, start_offset: int = 0, start_line: int | None = 1, limit: int | None = None,
         strict_tail: bool = False) -> Iterator[tuple[dict[str, Any], int]]:
    """Yield ``(record, end_offset)`` for each valid record from ``start_offset`` up to ``limit`` bytes.

    Raises LogCorruptedError (naming file, line and byte offset) for a bad record that a valid record
    follows. Bad or unterminated lines with no valid record after them (a torn tail) end the scan without
    an error; the caller compares the last end offset with the size. With ``strict_tail``, a bad last line
    that no crash can leave (:func:`crash_leaves`) is corruption too. ``start_line`` None: unknown (it is
    computed if an error needs it).
    """
    opened = (open(path, "rb") if isinstance(path, (str, os.PathLike))
              else os.fdopen(os.dup(path.active_fd), "rb"))  # a LogReader: its active segment
    if not isinstance(path, (str, os.PathLike)):
        path = path.directory / LOG_NAME
    with opened as f:
        size = data_end(f.fileno()) if limit is None else limit
        f.seek(start_offset)
        offset = start_offset
        lineno = start_line
        decode = codec.decode
        for line in f:
            end = offset + len(line)
            if end > size:
                break
            if line[-1:] != b"\n":
                break  # unterminated last line: torn tail
            try:
                rec = decode(line)
            except codec.RecordError as e:
                if _valid_record_ahead(f, line, end, size):
                    raise LogCorruptedError(str(path), lineno or line_at(path, offset), offset, str(e)) from None
                if strict_tail and not crash_leaves(line):
                    raise LogCorruptedError(
                        str(path), lineno or line_at(path, offset), offset,
                        f"{e}; it is the last record, but complete (newline-terminated, no NUL bytes), which no "
                        "crash leaves behind: it was changed after it was written") from None
                break  # nothing valid after it: torn tail
            yield rec, end
            offset = end
            if lineno:
                lineno += 1


__all__ = ["RESERVE", "RESERVE_MAX", "crash_leaves", "data_end", "data_size", "line_at", "scan"]
