"""Where a checkpoint is stored (I/O): the :class:`CheckpointStore` protocol, the file store beside a file log,
and the reads of a payload's sections from an open file."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson

from ...model import json_lossless
from ..paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, NOFOLLOW, create_private_file, fsync_dir, write_all
from ..segment_store import _step
from .payload import _TRAILER, Checkpoint, CheckpointError, _check_crc, _checkpoint, _head, parse_state, section_tail


def read_front(f: Any) -> tuple[Checkpoint, int, int]:
    """Read and verify the header and front section from a binary file at offset 0.

    Returns the checkpoint (``state`` None), the offset of the state section and its length (in the file
    ``cp.state_in`` names, when it names one: :func:`open_state_file`).
    """
    line = f.readline(1 << 20)
    if not line.endswith(b"\n"):
        raise CheckpointError(f"truncated ({len(line)} bytes, no header line)")
    head = _head(line[:-1])
    rest = f.read(head["front_bytes"] + 1 + _TRAILER)
    return check_front(line, head, rest, os.fstat(f.fileno()).st_size)


def check_front(line: bytes, head: dict[str, Any], rest: bytes, size: int) -> tuple[Checkpoint, int, int]:
    """:func:`read_front` of a payload of ``size`` bytes whose header ``line`` (parsed: ``head``) and the
    ``rest`` after it (the front section and its CRC line) were read by the caller (any store)."""
    _check_crc(line + rest, "header/front")
    try:
        front = json_lossless.loads(memoryview(rest)[: head["front_bytes"]])
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed front section: {e}") from None
    offset, length = len(line) + len(rest), head["state_bytes"]
    cp = _checkpoint(head, front, None)
    if cp.state_in is not None:  # the state section is in checkpoint.base: this file ends with the front
        if size != offset:
            raise CheckpointError(f"payload is {size} bytes, its header says {offset}: truncated or corrupt")
        return cp, int(cp.state_in["offset"]), length
    if size != offset + section_tail(head):  # a truncated or extended state section, found without reading it
        raise CheckpointError(f"payload is {size} bytes, its header says {offset + section_tail(head)}: "
                              "truncated or corrupt")
    return cp, offset, length


def read_state(f: Any, offset: int, length: int) -> dict[str, Any]:
    """Read, verify and parse the state section (``offset``/``length`` from :func:`read_front`)."""
    return check_state(os.pread(f.fileno(), length + 1 + _TRAILER, offset), length)


def message_reader(f: Any) -> Callable[[int, int], bytes]:
    """``read(offset, count)`` of the open file ``f`` (the message section follows the state section in the
    file that holds it: at ``offset + length + 1 + _TRAILER`` for :func:`read_front`'s offset and length)."""
    fd = f.fileno()

    def read(offset: int, count: int) -> bytes:
        return os.pread(fd, count, offset)

    preadv = getattr(os, "preadv", None)
    if preadv is not None:  # (payload.parse_messages reads the pieces into one buffer: no new bytes per piece)
        read.into = lambda offset, view: preadv(fd, [view], offset)  # type: ignore[attr-defined]
    return read


def check_state(data: bytes, length: int) -> dict[str, Any]:
    """Verify and parse a state section of ``length`` bytes read with its CRC line (``data``, any store)."""
    if len(data) != length + 1 + _TRAILER:
        raise CheckpointError(f"truncated state section ({len(data)} of {length + 1 + _TRAILER} bytes)")
    _check_crc(data, "state")
    return parse_state(data, 0, length)  # (a paged history's lists packed as they are parsed)


@runtime_checkable
class CheckpointStore(Protocol):
    """Where a session's single checkpoint payload lives. Errors may be raised; callers log and go on."""

    async def load(self) -> bytes | None:
        """The stored payload, or None if there is none."""
        ...

    async def save(self, payload: bytes, seq: int) -> None:
        """Replace the stored payload atomically (a reader sees the old one or the new one, whole)."""
        ...

    async def discard(self) -> None:
        """Remove the stored payload (no error if there is none)."""
        ...


class FileCheckpointStore:
    """``<session>/checkpoint.json``: written to a temp file (0600), fsynced, renamed, folder fsynced."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / CHECKPOINT_NAME
        self.tmp = directory / (CHECKPOINT_NAME + ".tmp")
        #: An earlier checkpoint whose state section the current one refers to (a based checkpoint of a lazy
        #: history: see :meth:`keep_as_base`); removed when a checkpoint with its own state section replaces it.
        self.base = directory / CHECKPOINT_BASE_NAME

    async def load(self) -> bytes | None:
        return self.read_sync()

    def read_sync(self) -> bytes | None:
        """The stored payload, or None if there is none (CheckpointError: not a regular file). A payload whose
        state section is in ``checkpoint.base`` comes with that section appended, as if it were inline."""
        f = self._open()
        if f is None:
            return None
        with f:
            data: bytes = f.read()
        nl = data.find(b"\n")
        if nl < 0 or b'"state_in":{' not in data[:nl]:
            return data
        try:
            head = json_lossless.loads(data[:nl])
            where, length = head["state_in"], int(head["state_bytes"])
            offset = int(where["offset"])
            messages = int(head.get("messages_bytes", 0))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"malformed header: {e}") from None
        base = self._open(self.base)
        if base is None:
            raise CheckpointError(f"its state section is in {CHECKPOINT_BASE_NAME}, which is missing")
        with base:  # (and the message section, which follows it there)
            section = os.pread(base.fileno(), length + 1 + _TRAILER + (messages + 1 + _TRAILER if messages else 0),
                               offset)
        return data + section

    def open_state_file(self, cp: Checkpoint, length: int) -> Any:
        """The file holding ``cp``'s state section (``length`` bytes) when it is in ``checkpoint.base``
        (CheckpointError if it is missing or not the section named: its CRC line differs)."""
        base = self._open(self.base)
        if base is None:
            raise CheckpointError(f"its state section is in {CHECKPOINT_BASE_NAME}, which is missing")
        assert cp.state_in is not None
        where = cp.state_in
        try:
            crc = os.pread(base.fileno(), 8, int(where["offset"]) + length + 1)
            if crc != str(where["crc"]).encode():
                raise CheckpointError(f"{CHECKPOINT_BASE_NAME} does not hold the state section the checkpoint "
                                      f"names (CRC {crc.decode('ascii', 'replace')}, expected {where['crc']})")
        except BaseException:
            base.close()
            raise
        return base

    def _open(self, path: Path | None = None) -> Any:
        """The checkpoint file (or ``path``) opened for reading, or None: never through a symlink, and only a
        regular file (a FIFO or a device in its place would block or never end; CheckpointError, so it is
        ignored)."""
        path = path or self.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{path} is a symbolic link; checkpoints are never read through "
                                      "one") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{path} is not a regular file")
        return os.fdopen(fd, "rb")

    async def save(self, payload: bytes, seq: int) -> None:
        await asyncio.to_thread(self.save_sync, payload)

    def save_sync(self, payload: bytes) -> None:
        """Store a payload holding its own state section; an earlier ``checkpoint.base`` is then unused."""
        self._save(lambda fd: write_all(fd, payload))
        if os.path.lexists(self.base):
            self.base.unlink(missing_ok=True)
            fsync_dir(self.path.parent)

    def keep_as_base(self, src: int) -> bool:
        """Make the open checkpoint file ``src`` (the one a lazy history was opened from) ``checkpoint.base``,
        by a hard link, unless it is already: a based checkpoint can then refer to its state section instead
        of copying it. False if the file system cannot link it (the caller copies the section instead)."""
        st = os.fstat(src)
        try:
            cur = os.stat(self.base, follow_symlinks=False)
        except FileNotFoundError:
            cur = None
        if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino) and stat.S_ISREG(cur.st_mode):
            return True
        # The file is linked by its name, checkpoint.json, which it still has unless a newer checkpoint replaced
        # it (then the link names another file, found by its inode, and the section is copied instead).
        tmp = self.base.with_name(self.base.name + ".tmp")
        try:
            tmp.unlink(missing_ok=True)
            os.link(self.path, tmp, follow_symlinks=False)
            got = os.stat(tmp, follow_symlinks=False)
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                tmp.unlink()
                return False
            os.replace(tmp, self.base)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        fsync_dir(self.path.parent)  # (durable before a checkpoint names it)
        return True

    def save_front_only(self, prefix: bytes) -> int:
        """Store a based checkpoint whose state section stays in ``checkpoint.base`` (:meth:`keep_as_base`)."""
        self._save(lambda fd: write_all(fd, prefix))
        return len(prefix)

    def save_copying(self, prefix: bytes, src: int, offset: int, count: int) -> int:
        """:meth:`save_sync` of ``prefix`` followed by ``count`` bytes of the open file ``src`` from ``offset``,
        copied by the kernel where it can (``copy_file_range``); closes ``src``. Returns the payload's size."""

        def write(fd: int) -> None:
            write_all(fd, prefix)
            done = 0
            while done < count:
                try:
                    n = os.copy_file_range(src, fd, count - done, offset + done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    n = -1
                if n < 0:  # (a file system or kernel without it: copy through memory, 1 MiB at a time)
                    chunk = os.pread(src, min(count - done, 1 << 20), offset + done)
                    write_all(fd, chunk)
                    n = len(chunk)
                if n == 0:
                    raise CheckpointError(f"the checkpoint copied from ended {count - done} bytes early")
                done += n

        try:
            self._save(write)
        finally:
            os.close(src)
        return len(prefix) + count

    def _save(self, write: Callable[[int], None]) -> None:
        # A fixed temp name is safe: only the lock holder writes checkpoints. A leftover (or a link planted in
        # its place) is removed, never written through: the file is created anew, without following symlinks.
        try:
            fd = create_private_file(self.tmp.parent, self.tmp.name)
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            _step("checkpoint-written")
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)

    def open_front(self) -> tuple[Checkpoint, Any, int, int] | None:
        """Read and verify only the header and front section: ``(checkpoint, open file, state offset, state
        length)``, or None if there is no checkpoint. The caller owns the file (it reads the state from it)."""
        f = self._open()
        if f is None:
            return None
        try:
            cp, offset, length = read_front(f)
            if cp.state_in is not None:  # the state section is in checkpoint.base: read it from there
                state_file = self.open_state_file(cp, length)
                f.close()
                f = state_file
            return cp, f, offset, length
        except BaseException:
            f.close()
            raise

    async def discard(self) -> None:
        self.discard_sync()

    def discard_sync(self) -> None:
        existed = self.path.exists() or os.path.lexists(self.base)
        self.path.unlink(missing_ok=True)
        self.tmp.unlink(missing_ok=True)
        self.base.unlink(missing_ok=True)
        if existed:
            fsync_dir(self.path.parent)


def checkpoint_store_for(log: Any) -> CheckpointStore | None:
    """The checkpoint store of a log backend: its ``checkpoint_store`` attribute, a file beside a file log."""
    store = getattr(log, "checkpoint_store", None)
    if store is not None:
        return store  # type: ignore[no-any-return]
    directory = getattr(log, "directory", None)
    if isinstance(directory, Path):
        return FileCheckpointStore(directory)
    return None


async def first_record_crc(log: Any) -> str | None:
    """The checksum of the log's first record (its identity), reading only that record (or, for a segmented
    file log, taking it from the manifest: no sealed segment is read)."""
    known = getattr(log, "first_crc", None)
    if callable(known):
        crc = known()
        if crc is not None:
            return crc  # type: ignore[no-any-return]
    batches = log.read_batches(0, None, batch=1)
    try:
        async for batch in batches:
            if batch:
                return batch[0].get("crc")  # type: ignore[no-any-return]
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
    return None

