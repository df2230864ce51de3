"""Which index a reader uses: the storage's own, a PostgreSQL schema's search tables, or, when the storage's
index cannot be written, a private temporary one (docs/search.md, "A storage you cannot write to").

``search`` and ``ls`` catch the index up before they read it, so they write to it. A storage folder the user
may read but not write (a read-only mount, another user's storage, a backup) would make them fail: instead the
work is done again on an index built from the logs in a private temporary folder (0700, removed afterwards),
with one warning saying so. It costs a build of the index from every log, each time, and is never trusted
more than the storage's own: the logs are the truth for both.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from .sqlite_index import SqliteIndex, index_path

logger = logging.getLogger("context_persistent")
T = TypeVar("T")
_READONLY = re.compile(r"readonly|read-only|unable to open|access permission denied")


def unwritable(e: BaseException) -> bool:
    """Whether ``e`` says the storage's index cannot be written here (permissions, a read-only file system)."""
    if isinstance(e, OSError):
        return e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    return isinstance(e, sqlite3.OperationalError) and _READONLY.search(str(e)) is not None


async def with_index(storage: str | os.PathLike[str] | None, work: Callable[[Any], Awaitable[T]], *,
                     dsn: str | None = None, pg_schema: str | None = None,
                     own_index: str | os.PathLike[str] | None = None) -> T:
    """``work(index)`` on the index of a file storage (or, with ``dsn``, of a PostgreSQL schema); again on a
    private temporary index if the storage's cannot be written. ``own_index``: the caller's own index file of
    the storage, used instead of the storage's (kept by the caller, never written to the storage)."""
    if dsn is not None:
        from .pg_index import PgIndex

        pg = PgIndex(dsn, pg_schema)
        try:
            return await work(pg)
        finally:
            await pg.aclose()
    if storage is None:
        raise ValueError("give the storage folder (or dsn= for the PostgreSQL backend)")
    root = Path(storage)
    if own_index is not None:
        own = SqliteIndex(root, Path(own_index))
        try:
            return await work(own)
        finally:
            own.close()
    index = SqliteIndex(root)
    try:
        return await work(index)
    except Exception as e:
        if not unwritable(e):
            raise
        reason = f"{type(e).__name__}: {e}"
    finally:
        index.close()
    folder = tempfile.mkdtemp(prefix="context-persistent-index-")
    logger.warning("search index %s cannot be written (%s): using a temporary index built from the logs in %s",
                   index_path(root), reason, folder)
    private = SqliteIndex(root, Path(folder) / "index.sqlite3")
    try:
        return await work(private)
    finally:
        private.close()
        shutil.rmtree(folder, ignore_errors=True)
