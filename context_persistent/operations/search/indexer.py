"""Bringing the index up to date with the logs: one session (from its last indexed record, or again from its
log), a whole storage, a rebuild; and the erasure protocol (docs/search.md, "Erasure").

A session's row anchors it: the seq, crc and byte position of the last record indexed. Catching up first
checks that the log still holds that record (else the log was replaced, repaired or recreated: the session is
indexed again from its log), then reads the records after it. Appends add documents; an event that changes
the history (clear, replace, pin, redact, system prompt) also sets which documents the views show, from the
history's keys (the writer's, handed over with the notification, or a fold of the log); an expiry, a repair
or an erasure tombstone indexes the session again. Every step of one session is one write transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ...model import events as ev
from ...model.projection import make_key
from ...model.values import Value
from ...storage.lockfile import pid_alive
from .fold import APPEND_TYPES, REINDEX_TYPES, docs_of, fold, hidden, positioned, redacted_key, slots
from .file_listing import file_sessions, signature
from .sqlite_index import SqliteIndex, discard, index_path, storage_lock, title_of
from .snapshot import Snapshot, keys_snapshot  # (re-exported: the writer's side)
from .text import fingerprint

logger = logging.getLogger("context_persistent")
HOST = socket.gethostname()
#: An erasure in another process whose marker is older than this is taken as abandoned on PostgreSQL
#: (a process on another host cannot be probed).
ERASE_STALE_SECONDS = 600.0


class _Reindex(Exception):
    """The records after the anchor hold one of fold.REINDEX_TYPES: index the session again."""


class Outcome(Value):
    """What a catch-up of one session did."""

    __slots__ = ("session_id", "added", "removed", "reindexed", "skipped", "purged", "facts")
    session_id: str
    added: int
    removed: int
    reindexed: bool
    skipped: str | None
    purged: bool
    facts: dict[str, Any]

    def __init__(self, session_id: str, added: int = 0, removed: int = 0, reindexed: bool = False,
                 skipped: str | None = None, purged: bool = False, facts: dict[str, Any] | None = None) -> None:
        self.session_id = session_id
        self.added = added
        self.removed = removed
        self.reindexed = reindexed
        self.skipped = skipped
        self.purged = purged
        self.facts = {} if facts is None else facts


def _alive(pid: int, host: str, since: float) -> bool:
    """Whether the process that marked an erasure may still be running it."""
    if host != HOST:
        return time.time() - since < ERASE_STALE_SECONDS
    return pid_alive(pid)


async def _anchored(index: Any, log: Any, row: dict[str, Any]) -> bool:
    """Whether the log still holds the record the session's row was indexed up to (a file log: the record
    before the anchored position; PostgreSQL: the row at the anchored seq, read by the index)."""
    seq, crc, pos = row["last_seq"], row["last_crc"], row["position"]
    if seq == 0:
        return True
    if pos is not None and hasattr(log, "record_before"):
        rec = log.record_before(pos)
        return rec is not None and rec["seq"] == seq and rec["crc"] == crc
    check = getattr(index, "record_crc", None)
    return check is not None and await check(log.session_id, seq) == crc


async def catch_up(index: Any, log: Any, *, signature: str | None = None, snapshot: Snapshot | None = None,
                   force: bool = False, eraser: bool = False) -> Outcome:
    """Bring one session's documents up to date with ``log`` (open read-only by the caller)."""
    sid = log.session_id
    out = Outcome(sid)
    async with index.writing(sid):
        row = await index.session(sid)
        markers = await index.erasing(sid)
        if markers and not eraser:
            if any(_alive(pid, host, since) for _, pid, host, since in markers):
                out.skipped = "an erasure is in progress"
                return out
            await index.clear_erasing(sid)
            force = True
        full = force or row is None or row["state"] != "ok" or not await _anchored(index, log, row)
        if not full:
            assert row is not None
            try:
                await _incremental(index, log, row, snapshot, out)
            except _Reindex:
                full = True
        if full:
            # (the rollback of what _incremental inserted: a savepoint would do, a fresh pass is as simple)
            out.added = 0
            await _reindex(index, log, signature, out)
        else:
            out.facts["signature"] = signature
            await _save(index, sid, out.facts)
    if out.removed:
        await index.purge()
        out.purged = True
    return out


async def _incremental(index: Any, log: Any, row: dict[str, Any], snapshot: Snapshot | None,
                       out: Outcome) -> None:
    sid = row["session_id"]
    facts = {k: row[k] for k in ("last_seq", "last_crc", "position", "bytes", "first_ts", "last_ts")}
    changed_at = 0  # the seq of the last record that changed the history other than by appending
    appended: list[int] = []  # keys of messages appended after it
    redacted: list[int] = []
    docs = []
    async for batch, positions, sizes in positioned(log, row["last_seq"], row["position"]):
        for rec, pos, size in zip(batch, positions, sizes):
            kind = rec["type"]
            if kind in REINDEX_TYPES:
                raise _Reindex
            if kind not in APPEND_TYPES:
                changed_at, appended = rec["seq"], []
                if kind == ev.REDACTED:
                    key = redacted_key(rec)
                    if key is not None:
                        redacted.append(key)
            elif kind == ev.MESSAGE_ADDED:
                appended.append(make_key(rec["seq"]))
            docs.extend(docs_of(rec, pos))
            facts.update(last_seq=rec["seq"], last_crc=rec["crc"], last_ts=rec["ts"], bytes=facts["bytes"] + size,
                         first_ts=facts["first_ts"] or rec["ts"])
            if pos is not None:
                facts["position"] = pos + size
        if len(docs) >= 1024:
            out.added += await index.insert_docs(sid, ((d, True) for d in docs))
            docs = []
    out.added += await index.insert_docs(sid, ((d, True) for d in docs))
    if changed_at:
        if snapshot is not None and changed_at <= snapshot.seq <= facts["last_seq"]:
            # only appends came after the snapshot: the history is its keys and theirs
            keys = set(snapshot.keys)
            keys.update(k for k in appended if k > make_key(snapshot.seq))
        else:
            keys = set((await fold(log)).keys)
        await index.set_view(sid, keys)
        if redacted:
            await index.add_redacted(sid, redacted)
        out.removed += await index.delete_hidden(sid)
    elif type(row.get("messages")) is int and row.get("title") is not None:
        # (only appends since the row was saved: every new document is in the views, and the title, the
        # first user message's, is older than them; not counted again from every document of the session)
        facts.update(messages=row["messages"] + out.added, title=row["title"])
    out.facts = facts


async def _reindex(index: Any, log: Any, signature: str | None, out: Outcome) -> None:
    """Index a session again from its whole log (three passes when it holds redactions: fold.py)."""
    sid = log.session_id
    out.reindexed = True
    out.removed += await index.delete_session(sid, keep_row=True)
    folded = await fold(log)
    keys = set(folded.keys)
    prints: dict[int, bytes] = {}
    if folded.redacted:
        async for batch in log.read_batches():
            for rec in batch:
                for key, _, m in slots(rec):
                    if key in folded.redacted:
                        prints[key] = fingerprint(m)
    print_set = set(prints.values())
    async for batch, positions, _ in positioned(log):
        docs = [d for rec, pos in zip(batch, positions) for d in docs_of(rec, pos)]
        out.added += await index.insert_docs(sid, ((d, d.key in keys) for d in docs
                                             if not hidden(d, d.key in keys, folded.redacted, print_set)))
    await index.add_redacted(sid, folded.redacted, prints)
    out.facts = {"last_seq": folded.last_seq, "last_crc": folded.last_crc, "position": folded.position,
                 "bytes": folded.bytes, "first_ts": folded.first_ts, "last_ts": folded.last_ts,
                 "signature": signature}
    await _save(index, sid, out.facts)


async def _save(index: Any, sid: str, facts: dict[str, Any]) -> None:
    """Store the session's row: ``facts`` and the views' facts (taken from ``facts`` when ``_incremental``
    carried them forward, else counted: ``view_facts``, O(documents))."""
    if "messages" in facts and "title" in facts:
        messages, title = facts["messages"], facts["title"]
    else:
        messages, title = await index.view_facts(sid)
    await index.save_session({**facts, "session_id": sid, "state": "ok", "messages": messages, "title": title})
    facts.update(messages=messages, title=title)


# -- a storage ------------------------------------------------------------------------------------------
async def catch_up_session(index: Any, sid: str, *, snapshot: Snapshot | None = None, force: bool = False,
                           eraser: bool = False) -> Outcome:
    """Catch one session up (it is forgotten if it is gone: trashed or deleted). ``index``: a SqliteIndex or
    a PgIndex (pg_index.py), which opens the session's log."""
    async with index.open_log(sid) as opened:
        if opened is None:
            out = Outcome(sid)
            out.removed = await forget(index, [sid], purge=True)
            out.purged = bool(out.removed)
            return out
        log, sig = opened
        return await catch_up(index, log, signature=sig, snapshot=snapshot, force=force, eraser=eraser)


async def catch_up_storage(index: Any, storage: Path | None = None,
                           known: dict[str, tuple[str | None, str]] | None = None) -> list[Outcome]:
    """Catch every session of the index's storage up: those whose log changed since it was indexed (by their
    signatures), those not indexed yet, and those gone (forgotten). One unreadable session is logged and
    skipped, never hides the others. (``storage``: unused, the index knows its storage.)"""
    listed = await index.listing()
    if known is None:
        known = await index.signatures()
    gone = [sid for sid in known if sid not in listed]
    outcomes = [Outcome(sid, skipped=None) for sid in gone]  # (forgotten: the caller reads the rows again)
    if gone:
        await forget(index, gone, purge=True)
    for sid, sig in listed.items():
        was = known.get(sid)
        if was is not None and was == (sig, "ok") and sig is not None:
            continue
        try:
            outcomes.append(await catch_up_session(index, sid))
        except Exception as e:  # (a damaged log: verify and repair say what; the other sessions go on)
            if getattr(index, "unusable", lambda _e: False)(e):
                raise  # (the index itself failed, not this session's log)
            logger.warning("search index: session %s not indexed: %s", sid, e)
            outcomes.append(Outcome(sid, skipped=str(e)))
    return outcomes


async def forget(index: Any, sids: list[str], *, purge: bool = True) -> int:
    """Remove sessions from the index (trashed, deleted); purges when anything was removed."""
    n = 0
    async with index.writing():
        for sid in sids:
            n += await index.delete_session(sid)
    if purge and n:
        await index.purge()
    return n


async def rebuild(storage: Path) -> list[Outcome]:
    """Build a storage's index from its logs alone, into a new file renamed over the old one (searches go on
    with the old one meanwhile; erasures wait for the rebuild: ``storage_lock``)."""
    path = index_path(storage)
    tmp = path.with_name(f".{path.name}.rebuild-{os.getpid()}")
    with storage_lock(storage, exclusive=True):
        discard(tmp)
        new = SqliteIndex(storage, tmp)
        try:
            outcomes = await catch_up_storage(new)
            new.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            new.close()
        os.replace(tmp, path)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(tmp) + suffix)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(path) + suffix)
    return outcomes


async def rebuild_pg(dsn: str, schema: str | None) -> list[Outcome]:
    """Build a PostgreSQL schema's search tables from its logs alone: every session indexed again from its
    rows, one transaction each (searches go on meanwhile and see each session before or after; erasures
    wait for the rebuild: ``rebuild_lock``)."""
    from .pg_index import PgIndex

    index = PgIndex(dsn, schema)
    try:
        async with index.rebuild_lock(exclusive=True):
            outcomes = []
            for sid in sorted(await index.listing()):
                try:
                    outcomes.append(await catch_up_session(index, sid, force=True))
                except Exception as e:
                    logger.warning("search index: session %s not indexed: %s", sid, e)
                    outcomes.append(Outcome(sid, skipped=str(e)))
            return outcomes
    finally:
        await index.aclose()


__all__ = ["Outcome", "Snapshot", "catch_up", "catch_up_session", "catch_up_storage", "file_sessions", "forget",
           "keys_snapshot", "rebuild", "rebuild_pg", "signature", "storage_lock", "title_of"]


# -- for the operations that take text out of a storage (trash, segment expiry) ------------------------------
async def forget_removed(storage: Path, sid: str) -> None:
    """A session left the storage (moved to the trash): its documents leave the index now, purged."""
    if index_path(storage).exists():
        index = SqliteIndex(storage)
        try:
            await forget(index, [sid])
        finally:
            index.close()


async def reindex_changed(storage: Path, sid: str) -> None:
    """A session's log lost records (segments expired): index it again from its log now, purged."""
    if index_path(storage).exists():
        index = SqliteIndex(storage)
        try:
            await catch_up_session(index, sid, force=True)
        finally:
            index.close()
