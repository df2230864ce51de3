"""Files written atomically and the leftovers of writers killed midway (I/O, for export and import).

``write_atomic`` writes a file via a 0600 temp file beside it (write, fsync, rename, fsync of the folder);
``clean_stale_temp_files`` removes the temp files of exports whose process is gone; ``read_file`` reads a
whole file in chunks off the event loop.

aiofiles does the bulk file I/O here (snapshot and import files are read and written in 1 MiB chunks in a
worker thread) so that exporting a large session from inside a running agent does not stall its event loop.
It is not used per line: every aiofiles call is a thread hop (~50 µs), which would dominate small writes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiofiles  # type: ignore[import-untyped]

from ..storage.lockfile import pid_alive
from ..storage.paths import FILE_MODE, LOG_NAME, fsync_dir

logger = logging.getLogger("context_persistent.transfer.atomic_files")

#: ``progress(done, total)`` callback (bytes or messages; ``total`` may be 0 when unknown).
Progress = Callable[[int, int], None]
CHUNK = 1 << 20


async def _listed(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def write_atomic(path: Path, chunks: Iterable[bytes] | AsyncIterator[bytes], progress: Progress | None = None,
                       total: int | None = None) -> int:
    """Write ``chunks`` to ``path`` via a 0600 temp file beside it: write, fsync, rename, fsync the folder.

    ``chunks`` is a list, or an async iterator written as it yields (then ``total``, the expected size, is what
    ``progress`` is told until the end). Returns the bytes written."""
    if not isinstance(chunks, AsyncIterator):
        parts = list(chunks)
        total = sum(len(c) for c in parts)
        chunks = _listed(parts)
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"folder {parent} does not exist (create it first)", str(parent))
    if os.path.lexists(parent / LOG_NAME):  # a session folder (export_on_compact): no leftovers pile up there
        clean_stale_temp_files(parent)
    tmp = parent / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    done = 0
    try:
        async with aiofiles.open(tmp, "xb", opener=_private_opener) as f:
            buf: list[bytes] = []
            held = 0
            async for chunk in chunks:
                buf.append(chunk)
                held += len(chunk)
                if held < CHUNK:
                    continue
                data = b"".join(buf)
                buf, held = [], 0
                for i in range(0, len(data), CHUNK):
                    piece = data[i:i + CHUNK]
                    await f.write(piece)
                    done += len(piece)
                    if progress:
                        progress(done, max(done, total or 0))
            if buf:
                data = b"".join(buf)
                await f.write(data)
                done += len(data)
                if progress:
                    progress(done, done)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(parent)
    return done


_TMP_FILE_RE = re.compile(r"\..+\.tmp-([0-9]+)-[0-9a-f]{8}")


def _stale_entries(folder: Path, pattern: re.Pattern[str], pid_group: int, *, directory: bool
                   ) -> Iterator[tuple[os.DirEntry[str], re.Match[str]]]:
    """Entries of ``folder`` named by ``pattern`` that are real files (or folders, not links) owned by this
    user and whose process (the pid in ``pid_group``) is gone, with their match."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            kind_ok = entry.is_dir(follow_symlinks=False) if directory else entry.is_file(follow_symlinks=False)
            if kind_ok and entry.stat(follow_symlinks=False).st_uid == os.geteuid() and not pid_alive(int(m[pid_group])):
                yield entry, m
        except OSError:
            continue


def clean_stale_temp_files(folder: Path) -> list[Path]:
    """Remove the temp files of exports killed midway in ``folder`` (``.<name>.tmp-<pid>-<8 hex>``): regular
    files of ours whose process is gone. Returns what was removed."""
    removed: list[Path] = []
    for entry, m in _stale_entries(folder, _TMP_FILE_RE, 1, directory=False):
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
            logger.info("removed %s, left by an export that did not finish (pid %s)", entry.path, m[1])
        except OSError as e:
            logger.info("could not remove the leftover temp file %s: %s", entry.path, e)
    return removed


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


async def read_file(path: Path, progress: Progress | None = None) -> bytes:
    """The whole file, read in chunks off the event loop."""
    total = os.stat(path).st_size
    parts = []
    done = 0
    async with aiofiles.open(path, "rb") as f:
        while chunk := await f.read(CHUNK):
            parts.append(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return b"".join(parts)


