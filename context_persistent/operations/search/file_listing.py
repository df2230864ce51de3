"""Which sessions a file storage holds, and what changed since they were indexed: one directory listing and
one ``stat`` per session (``ls`` at 10,000 sessions spends most of its time here: docs/performance.md).

A session's *signature* is its active log file's inode, size and modification time: an append, a roll, a
repair or an erasure (a new file renamed over the log) changes it. Sessions whose folder holds only sealed
segments (no active file) have the signature None and are always caught up.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...storage.manifest import MANIFEST_NAME
from ...storage.paths import LOG_NAME

_LOG = "/" + LOG_NAME


def signature(folder: Path) -> str | None:
    """What changes when a file session's log changes: its active file's inode, size and modification time."""
    try:
        st = os.stat(folder / LOG_NAME)
    except FileNotFoundError:
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def file_sessions(storage: Path) -> dict[str, str | None]:
    """Every session folder of a storage with its log's signature.

    ``os.listdir`` on the storage's descriptor, then one ``stat`` per entry relative to it (no path to build,
    no symlink of the storage to follow, no DirEntry objects): a file or a non-session folder fails the
    ``stat`` and is passed over; only a folder without an active log is looked at again (sealed segments).
    """
    out: dict[str, str | None] = {}
    try:
        fd = os.open(storage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    stat = os.stat
    try:
        for name in os.listdir(fd):
            if name[0] == ".":
                continue
            try:
                st = stat(name + _LOG, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                if os.path.isfile(os.path.join(storage, name, MANIFEST_NAME)):
                    out[name] = None
                continue
            out[name] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    finally:
        os.close(fd)
    return out
