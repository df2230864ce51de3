"""The writer lock: an advisory ``flock`` on ``<session>/lock`` holding the writer's pid (I/O)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ..errors import SessionLockedError
from .paths import open_private_file, private_dir, write_all


def _read_lock_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class FileLock:
    """An advisory ``flock`` on ``<session>/lock``; the holder's pid is written into the file.

    ``flock`` locks belong to an open file description, so two stores in one process conflict just like
    two processes; the kernel drops the lock when its holder dies, so a stale lock is simply free.
    """

    def __init__(self, path: Path, session_id: str, dir_fd: int | None = None) -> None:
        self.path = path
        if dir_fd is None:
            with private_dir(path.parent) as dir_fd:
                self.fd = open_private_file(dir_fd, path.name, os.O_RDWR | os.O_CREAT, path.parent)
        else:
            self.fd = open_private_file(dir_fd, path.name, os.O_RDWR | os.O_CREAT, path.parent)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SessionLockedError(session_id, _read_lock_pid(path), f"({path})") from None
            raise
        pid = str(os.getpid()).encode()
        try:
            write_all(self.fd, pid, 0)  # write, then trim: a reader never sees an empty file while we hold it
            os.ftruncate(self.fd, len(pid))
        except BaseException:
            os.close(self.fd)  # (a full disk): closing drops the flock, so the session is not left locked
            self.fd = -1
            raise

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)  # closing drops the flock
            self.fd = -1



def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine may still be running (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["FileLock", "pid_alive"]
