"""The index's part in an erasure (docs/search.md, "Erasure"): before the log changes, the erased message's
documents (every document with its fingerprint) are removed and the index purged, with a marker saying an
erasure is in progress (a catch-up by another process then leaves the session out instead of indexing the
message again from the old log); after it, only what the erasure changed is brought in line with the new log
(``_after``: the documents' positions after each tombstone, the anchor, the ``ls`` facts) and the marker
removed. Where that cannot be shown to give what indexing the new log from scratch gives, the session is
indexed again whole, as it is when the index was not current before. A process killed in between leaves the
marker: the next catch-up after its process is gone indexes the session from whatever log it left.

The same protocol on both backends: ``erasing`` (a file storage's index) and ``erasing_pg`` (the search
tables of a PostgreSQL schema) share ``_around``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .indexer import HOST, _anchored, catch_up_session
from .sqlite_index import SqliteIndex, index_path

if TYPE_CHECKING:
    from ..erasure import Moved

logger = logging.getLogger("context_persistent")


class IndexErasure:
    """What the store and the index exchange around one erasure: ``entry`` (the receipt's ``index``), and
    what the store fills in once the new log is committed: ``moved`` (the records replaced by tombstones:
    erasure.Moved) and ``keys`` (the history's keys before and after the erasure)."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry
        self.moved: list[Moved] = []
        self.committed = False
        self.keys: tuple[Any, Any] | None = None


class _Plan:
    """What the step before the log changed found: the session's row (current with the log, ``state`` ok)
    and the documents it removed, ``(rec_seq, slot, key, in_view)``."""

    def __init__(self, row: dict[str, Any], gone: list[tuple[int, int, int, bool]]) -> None:
        self.row = row
        self.gone = gone


@contextlib.asynccontextmanager
async def _around(index: Any, sid: str, key: int, head: int, ix: IndexErasure) -> AsyncIterator[None]:
    entry = ix.entry
    async with index.rebuild_lock(exclusive=False):
        plan = None
        async with index.writing(sid):
            await index.add_erasing(sid, key, os.getpid(), HOST)
            row = await index.session(sid)
            if row is not None and row["state"] == "ok" and row["last_seq"] == head:
                gone = await index.delete_copies(sid, key)
                plan = None if gone is None else _Plan(row, gone)
            removed = len(plan.gone) if plan is not None else await index.delete_session(sid, keep_row=True)
            await index.mark_dirty(sid)
        await index.purge()
        added, whole = 0, True
        try:
            yield
        finally:
            if plan is not None and ix.committed and ix.keys is not None and await _moved_in_line(index, sid, plan, ix):
                whole = False
            else:
                out = await catch_up_session(index, sid, force=True, eraser=True)
                async with index.writing(sid):
                    await index.clear_erasing(sid)
                if out.removed:
                    await index.purge()
                added = out.added
        entry.update(action="purged", documents_removed=removed, documents_indexed_again=added,
                     session_indexed_again=whole, purged_at=await index.purged_at())


async def _moved_in_line(index: Any, sid: str, plan: _Plan, ix: IndexErasure) -> bool:
    """``_after``; an error there (a bug, a busy index) is logged and the session indexed again whole."""
    try:
        return await _after(index, sid, plan, ix)
    except Exception as e:
        logger.warning("search index: session %s: the erasure's changes could not be applied alone (%s: %s); "
                       "indexing the session again", sid, type(e).__name__, e)
        return False


async def _after(index: Any, sid: str, plan: _Plan, ix: IndexErasure) -> bool:
    """Bring the index in line with the new log by what the erasure changed, clear the marker, and return
    True; or change nothing and return False (the caller indexes the session again whole) where the result
    could differ from indexing the new log from scratch:

    - a document removed before is not one of the erased slots (another message with the same fingerprint
      but other bytes: it is still in the log), or an erased slot's document is still there;
    - the history's keys after are not those before less the erased keys (an erasure that moved other
      messages in or out of the views, e.g. the leading system messages);
    - an erased key was redacted and no other redacted message keeps its fingerprint (documents hidden as
      identical to it may show again: only the whole log says which);
    - the anchor, moved by the tombstones' lengths, is not the same record in the new log.
    """
    assert ix.keys is not None
    row = plan.row
    erased = {(m.seq, slot) for m in ix.moved for slot, _ in m.slots}
    erased_keys = {k for m in ix.moved for _, k in m.slots}
    if any((seq, slot) not in erased for seq, slot, _, _ in plan.gone):
        return False
    before, after = ix.keys
    expected = array("q", before)
    for k in erased_keys:
        while k in expected:  # (C-level scans: a history's keys are unique)
            expected.remove(k)
    if expected != array("q", after) or any(m.seq > row["last_seq"] for m in ix.moved):
        return False
    pos = row["position"]
    shift = sum(m.after - m.before for m in ix.moved if m.start is not None and pos is not None and m.start < pos)
    new = {**row, "position": None if pos is None else pos + shift,
           "bytes": row["bytes"] + sum(m.after - m.before for m in ix.moved),
           "messages": row["messages"] - sum(1 for *_, in_view in plan.gone if in_view)}
    async with index.open_log(sid) as opened:
        if opened is None:
            return False
        log, sig = opened
        if not await _anchored(index, log, new):
            return False
        async with index.writing(sid):
            if await index.held_slots(sid, sorted(erased)):
                return False  # (nothing changed yet: the transaction commits nothing)
            redacted = dict(await index.redacted_rows(sid))
            prints = {redacted[k] for k in erased_keys if redacted.get(k) is not None}
            if prints - {fp for k, fp in redacted.items() if k not in erased_keys and fp is not None}:
                return False
            named = sorted(erased_keys & redacted.keys())
            if named:  # (the log holds no message under them now: a rebuild keeps no fingerprint for them)
                await index.add_redacted(sid, named, {})
            for m in sorted(ix.moved, key=lambda m: m.start or 0, reverse=True):
                if m.start is not None and m.after != m.before:  # (from the last: older positions stay valid)
                    await index.shift_positions(sid, m.start, m.after - m.before)
            await index.save_session({**new, "signature": sig, "state": "ok", "title": await index.title(sid)})
            await index.clear_erasing(sid)
    return True


@contextlib.asynccontextmanager
async def erasing(storage: Path, sid: str, key: int, head: int) -> AsyncIterator[IndexErasure]:
    """Around an erasure of the message ``key`` of a file session whose log ends at seq ``head``; yields the
    ``IndexErasure`` whose ``entry`` (the receipt's ``index`` entry) is filled in on the way out."""
    path = index_path(storage)
    ix = IndexErasure({"where": str(path)})
    if not path.exists():
        ix.entry["action"] = "none: the storage has no search index"
        yield ix
        return
    index = SqliteIndex(storage)
    try:
        async with _around(index, sid, key, head, ix):
            yield ix
    finally:
        index.close()


@contextlib.asynccontextmanager
async def erasing_pg(dsn: str, schema: str, sid: str, key: int, head: int) -> AsyncIterator[IndexErasure]:
    """``erasing`` for a PostgreSQL session: its documents leave the search tables before its rows change."""
    from .pg_index import PgIndex

    index = PgIndex(dsn, schema)
    try:
        ix = IndexErasure({"where": f"{schema}.search_docs"})
        if not await index.exists():
            ix.entry["action"] = "none: the schema has no search tables"
            yield ix
            return
        async with _around(index, sid, key, head, ix):
            yield ix
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
