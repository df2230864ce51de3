"""The torn tail of a file log: what a write cut short by a crash leaves after the last valid record, found
by the read path (log_reading.py), described (:func:`tail_reason`) and, by a writer at open, moved to a side
file ``events.jsonl.torn-<offset>-<pid>-<random>`` before the log is cut to its valid prefix
(:func:`save_torn_tail`; docs/format.md). Nothing it held is lost: the side file keeps its bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..model import codec
from ..model.values import Value
from ..errors import LogWriteError
from .paths import FILE_MODE, LOG_NAME, NOFOLLOW, fsync_dir, write_all


class TornTail(Value):
    """What open found after the last valid record and cut off (writer) or ignored (reader)."""

    __slots__ = ("offset", "length", "line", "reason", "saved_to")
    offset: int
    length: int
    line: int
    reason: str
    saved_to: str | None

    def __init__(self, offset: int, length: int, line: int, reason: str, saved_to: str | None = None) -> None:
        self.offset = offset
        self.length = length
        self.line = line
        self.reason = reason
        self.saved_to = saved_to


def tail_reason(path: Path, start: int, end: int) -> str:
    """Why the bytes ``start..end`` of the active file ``path`` hold no valid record (a torn tail's reason)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    nl = data.find(b"\n")
    if nl < 0:
        return f"unterminated last record ({len(data)} bytes, no newline): a write cut short by a crash"
    try:
        codec.decode(data[: nl + 1])
        reason = "trailing bytes after the last record"
    except codec.RecordError as e:
        reason = f"last record fails verification: {e}"
    if nl + 1 < len(data):
        reason += f"; the {len(data) - nl - 1} bytes after it hold no valid record either"
    return reason


def save_torn_tail(directory: Path, path: Path, log_fd: int, torn: TornTail) -> Path:
    """Move the torn bytes of the active file ``path`` (open as ``log_fd``) to a side file in ``directory``, then
    truncate the file to the valid prefix, fsyncing both; returns the side file. LogWriteError says what failed."""
    with open(path, "rb") as f:
        f.seek(torn.offset)
        data = f.read(torn.length)
    side = directory / f"{LOG_NAME}.torn-{torn.offset}-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, FILE_MODE)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(directory)  # the side file is durable before the log loses the bytes
    except OSError as e:
        side.unlink(missing_ok=True)
        raise LogWriteError(str(side), "save the torn tail of the log to", e,
                            "the log was not changed (free space or fix permissions, then open again)") from e
    try:
        os.ftruncate(log_fd, torn.offset)
        os.fsync(log_fd)
    except OSError as e:
        raise LogWriteError(str(path), "cut the torn tail of", e,
                            f"its bytes are saved in {side}; open the session again to retry") from e
    return side


__all__ = ["TornTail", "save_torn_tail", "tail_reason"]
