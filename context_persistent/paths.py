"""Session ids, folders and private file creation."""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_SESSION_ID = 128
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*")
LOG_NAME = "events.jsonl"
LOCK_NAME = "lock"
CHECKPOINT_NAME = "checkpoint.json"
DIR_MODE = 0o700
FILE_MODE = 0o600


def validate_session_id(session_id: object) -> str:
    """Return the id if it is safe to use as a folder name; ValueError says the rule otherwise."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
    if len(session_id) > MAX_SESSION_ID:
        raise ValueError(f"session_id is {len(session_id)} characters; at most {MAX_SESSION_ID} are allowed")
    if session_id.startswith("."):
        raise ValueError(f"session_id {session_id!r} must not start with a dot")
    if ".." in session_id or "/" in session_id or "\\" in session_id or "\x00" in session_id:
        raise ValueError(f"session_id {session_id!r} must not contain '/', '\\\\', '..' or NUL")
    if not _ID_RE.fullmatch(session_id):  # (match with $ would accept a trailing newline)
        raise ValueError(
            f"session_id {session_id!r} has characters that are not allowed; use letters, digits and _ . : @ + = -"
        )
    return session_id


def session_dir(storage_path: str | os.PathLike[str], session_id: str) -> Path:
    return Path(storage_path) / validate_session_id(session_id)


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd`` (at ``offset`` with ``pwrite``, else at the file position), looping
    over short writes."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and missing parents with mode 0700, fsyncing each new entry into its parent."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(d, DIR_MODE)  # umask may have narrowed it; never widened
        fsync_dir(d.parent)
