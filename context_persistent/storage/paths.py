"""Session ids, folders and private file creation."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import UnsafeStorageError

MAX_SESSION_ID = 128
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*")
LOG_NAME = "events.jsonl"
LOCK_NAME = "lock"
CHECKPOINT_NAME = "checkpoint.json"
#: An earlier checkpoint file whose state section the current checkpoint refers to (checkpoint/store.py).
CHECKPOINT_BASE_NAME = "checkpoint.base"
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


#: Flags every file the store writes is opened with: never through a symbolic link.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _check_folder_stat(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStorageError(errno.ENOTDIR, f"{path} is not a folder; the store writes only into folders "
                                 "it owns (remove or rename it)", str(path))
    if st.st_uid != os.geteuid():
        raise UnsafeStorageError(errno.EPERM, f"{path} is owned by uid {st.st_uid}, not by this user "
                                 f"(uid {os.geteuid()}); the store writes only into folders owned by the user "
                                 "running it", str(path))
    if st.st_mode & 0o022:
        raise UnsafeStorageError(errno.EPERM, f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                                 "the store writes only into folders that only their owner can write to "
                                 f"(chmod 700 {path})", str(path))


def open_private_dir(path: Path) -> int:
    """A descriptor of the folder ``path`` once verified safe to write into: a real folder (not a symbolic
    link), owned by this user, writable by nobody else. UnsafeStorageError names the folder and the rule."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafeStorageError(errno.ELOOP, f"{path} is a symbolic link; the store never writes through "
                                     "one (use the real folder as the storage path)", str(path)) from None
        raise
    try:
        _check_folder_stat(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_storage_root(path: Path) -> None:
    """The storage folder (where session folders and temp folders are made) must be safe to write into too;
    it may be reached through a symbolic link (a storage on another disk), but must be ours and private."""
    _check_folder_stat(path, os.stat(path))


@contextlib.contextmanager
def private_dir(path: Path) -> Iterator[int]:
    """:func:`open_private_dir` as a context manager (the descriptor is closed at the end)."""
    fd = open_private_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def open_private_file(dir_fd: int, name: str, flags: int, folder: Path) -> int:
    """Open ``name`` inside the verified folder ``dir_fd`` for writing, never through a symbolic link, and
    refuse a file that is not a regular file or has other names (a hard link): writing it would modify a file
    elsewhere. Creates it with mode 0600."""
    where = folder / name
    try:
        fd = os.open(name, flags | NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeStorageError(errno.ELOOP, f"{where} is a symbolic link; the store never writes through "
                                     "one (remove it; the store recreates what it needs)", str(where)) from None
        # (openat names only ``name`` in its error: say where, e.g. "Permission denied: '/s/sess/lock'")
        raise type(e)(e.errno, e.strerror, str(where)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStorageError(errno.EPERM, f"{where} is not a regular file; remove it", str(where))
        if st.st_nlink > 1:
            raise UnsafeStorageError(errno.EPERM, f"{where} has {st.st_nlink} names (a hard link): writing it would "
                                     "change a file outside the session folder; remove the other names or this "
                                     "one", str(where))
        if st.st_uid != os.geteuid():
            raise UnsafeStorageError(errno.EPERM, f"{where} is owned by uid {st.st_uid}, not by this user; remove "
                                     "it", str(where))
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private_file(folder: Path, name: str, flags: int = os.O_WRONLY) -> int:
    """A NEW private file ``name`` in the verified folder (a leftover of that name, a link included, is
    removed first, never written through): for temp files the store writes and renames."""
    with private_dir(folder) as dir_fd:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return open_private_file(dir_fd, name, flags | os.O_CREAT | os.O_EXCL, folder)
