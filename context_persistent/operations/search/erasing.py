"""The index's part in an erasure (docs/search.md, "Erasure"): before the log changes, the session's documents
are removed and the index purged, with a marker saying an erasure is in progress (a catch-up by another
process then leaves the session out instead of indexing the message again from the old log); after it, the
session is indexed again from the new log and the marker removed. A process killed in between leaves the
marker: the next catch-up after its process is gone indexes the session from whatever log it left.

The same protocol on both backends: ``erasing`` (a file storage's index) and ``erasing_pg`` (the search
tables of a PostgreSQL schema) share ``_around``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .indexer import HOST, catch_up_session
from .sqlite_index import SqliteIndex, index_path


@contextlib.asynccontextmanager
async def _around(index: Any, sid: str, key: int, entry: dict[str, Any]) -> AsyncIterator[None]:
    async with index.rebuild_lock(exclusive=False):
        async with index.writing(sid):
            await index.add_erasing(sid, key, os.getpid(), HOST)
            removed = await index.delete_session(sid, keep_row=True)
            await index.mark_dirty(sid)
        await index.purge()
        try:
            yield
        finally:
            out = await catch_up_session(index, sid, force=True, eraser=True)
            async with index.writing(sid):
                await index.clear_erasing(sid)
            if out.removed:
                await index.purge()
        entry.update(action="purged", documents_removed=removed, documents_indexed_again=out.added,
                     purged_at=await index.purged_at())


@contextlib.asynccontextmanager
async def erasing(storage: Path, sid: str, key: int) -> AsyncIterator[dict[str, Any]]:
    """Around an erasure of the message ``key`` of a file session; yields the receipt's ``index`` entry,
    filled in once the session is indexed again."""
    path = index_path(storage)
    entry: dict[str, Any] = {"where": str(path)}
    if not path.exists():
        entry["action"] = "none: the storage has no search index"
        yield entry
        return
    index = SqliteIndex(storage)
    try:
        async with _around(index, sid, key, entry):
            yield entry
    finally:
        index.close()


@contextlib.asynccontextmanager
async def erasing_pg(dsn: str, schema: str, sid: str, key: int) -> AsyncIterator[dict[str, Any]]:
    """``erasing`` for a PostgreSQL session: its documents leave the search tables before its rows change."""
    from .pg_index import PgIndex

    index = PgIndex(dsn, schema)
    try:
        entry: dict[str, Any] = {"where": f"{schema}.search_docs"}
        if not await index.exists():
            entry["action"] = "none: the schema has no search tables"
            yield entry
            return
        async with _around(index, sid, key, entry):
            yield entry
    finally:
        await index.aclose()


async def check_index(index: Any, where: str, sid: str, key: int) -> list[str]:
    """Problems with a receipt's index entry: a document of the erased key, or an unfinished erasure."""
    problems = []
    if await index.holds(sid, key):
        problems.append(f"{where}: the search index still holds the message (session {sid}, key {key})")
    if await index.erasing(sid):
        problems.append(f"{where}: an erasure of session {sid} is unfinished in the search index")
    return problems


async def check_file_index(storage: Path, sid: str, key: int) -> list[str]:
    path = index_path(storage)
    if not path.exists():
        return []
    index = SqliteIndex(storage)
    try:
        return await check_index(index, str(path), sid, key)
    finally:
        index.close()


async def check_pg_index(dsn: str, schema: str, sid: str, key: int) -> list[str]:
    from .pg_index import PgIndex

    index = PgIndex(dsn, schema)
    try:
        return await check_index(index, f"{schema}.search_docs", sid, key) if await index.exists() else []
    finally:
        await index.aclose()
