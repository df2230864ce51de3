"""The index's part in an erasure (docs/search.md, "Erasure"): before the log changes, the session's documents
are removed and the index purged, with a marker saying an erasure is in progress (a catch-up by another
process then leaves the session out instead of indexing the message again from the old log); after it, the
session is indexed again from the new log and the marker removed. A process killed in between leaves the
marker: the next catch-up after its process is gone indexes the session from whatever log it left.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .indexer import HOST, catch_up_session, storage_lock
from .sqlite_index import SqliteIndex, index_path


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
    with storage_lock(storage, exclusive=False):
        index = SqliteIndex(storage)
        try:
            with index.writing():
                index.add_erasing(sid, key, os.getpid(), HOST)
                removed = index.delete_session(sid, keep_row=True)
                index.mark_dirty(sid)
            index.purge()
            try:
                yield entry
            finally:
                out = await catch_up_session(index, storage, sid, force=True, eraser=True)
                with index.writing():
                    index.clear_erasing(sid)
                if out.removed:
                    index.purge()
            entry.update(action="purged", documents_removed=removed, documents_indexed_again=out.added,
                         purged_at=index.db.execute("SELECT value FROM meta WHERE name = 'purged_at'").fetchone()[0])
        finally:
            index.close()


def check_index(storage: Path, sid: str, key: int) -> list[str]:
    """Problems with a receipt's index entry: a document of the erased key, or an unfinished erasure."""
    path = index_path(storage)
    if not path.exists():
        return []
    index = SqliteIndex(storage)
    try:
        problems = []
        if index.db.execute("SELECT 1 FROM docs WHERE session_id = ? AND key = ?", (sid, key)).fetchone():
            problems.append(f"{path}: the search index still holds the message (session {sid}, key {key})")
        if index.erasing(sid):
            problems.append(f"{path}: an erasure of session {sid} is unfinished in the search index")
        return problems
    finally:
        index.close()
