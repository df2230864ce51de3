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
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...model import events as ev
from ...model.projection import make_key
from .fold import APPEND_TYPES, REINDEX_TYPES, docs_of, fold, hidden, positioned, redacted_key, slots
from .sqlite_index import SqliteIndex, discard, index_path, title_of
from .text import fingerprint

logger = logging.getLogger("context_persistent")
HOST = socket.gethostname()
#: An erasure in another process whose marker is older than this is taken as abandoned on PostgreSQL
#: (a process on another host cannot be probed).
ERASE_STALE_SECONDS = 600.0


class _Reindex(Exception):
    """The records after the anchor hold one of fold.REINDEX_TYPES: index the session again."""


@dataclass(slots=True)
class Snapshot:
    """The history's keys right after record ``seq`` (the writer's state, handed over with a notification)."""

    seq: int
    keys: Any


@dataclass(slots=True)
class Outcome:
    session_id: str
    added: int = 0
    removed: int = 0
    reindexed: bool = False
    skipped: str | None = None
    purged: bool = False
    facts: dict[str, Any] = field(default_factory=dict)


def _alive(pid: int, host: str, since: float) -> bool:
    """Whether the process that marked an erasure may still be running it."""
    if host != HOST:
        return time.time() - since < ERASE_STALE_SECONDS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _anchored(log: Any, row: dict[str, Any]) -> bool:
    """Whether the log still holds the record the session's row was indexed up to."""
    seq, crc, pos = row["last_seq"], row["last_crc"], row["position"]
    if seq == 0:
        return True
    if pos is not None and hasattr(log, "record_before"):
        rec = log.record_before(pos)
        return rec is not None and rec["seq"] == seq and rec["crc"] == crc
    check = getattr(log, "record_crc", None)
    return check is not None and await check(seq) == crc


async def catch_up(index: SqliteIndex, log: Any, *, signature: str | None = None, snapshot: Snapshot | None = None,
                   force: bool = False, eraser: bool = False) -> Outcome:
    """Bring one session's documents up to date with ``log`` (open read-only by the caller)."""
    sid = log.session_id
    out = Outcome(sid)
    with index.writing():
        row = index.session(sid)
        markers = index.erasing(sid)
        if markers and not eraser:
            if any(_alive(pid, host, since) for _, pid, host, since in markers):
                out.skipped = "an erasure is in progress"
                return out
            index.clear_erasing(sid)
            force = True
        full = force or row is None or row["state"] != "ok" or not await _anchored(log, row)
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
            _save(index, sid, out.facts)
    if out.removed:
        index.purge()
        out.purged = True
    return out


async def _incremental(index: SqliteIndex, log: Any, row: dict[str, Any], snapshot: Snapshot | None,
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
            out.added += index.insert_docs(sid, ((d, True) for d in docs))
            docs = []
    out.added += index.insert_docs(sid, ((d, True) for d in docs))
    if changed_at:
        if snapshot is not None and changed_at <= snapshot.seq <= facts["last_seq"]:
            # only appends came after the snapshot: the history is its keys and theirs
            keys = set(snapshot.keys)
            keys.update(k for k in appended if k > make_key(snapshot.seq))
        else:
            keys = set((await fold(log)).keys)
        index.set_view(sid, keys)
        if redacted:
            index.add_redacted(sid, redacted)
        out.removed += index.delete_hidden(sid)
    out.facts = facts


async def _reindex(index: SqliteIndex, log: Any, signature: str | None, out: Outcome) -> None:
    """Index a session again from its whole log (three passes when it holds redactions: fold.py)."""
    sid = log.session_id
    out.reindexed = True
    out.removed += index.delete_session(sid, keep_row=True)
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
        out.added += index.insert_docs(sid, ((d, d.key in keys) for d in docs
                                             if not hidden(d, d.key in keys, folded.redacted, print_set)))
    index.add_redacted(sid, folded.redacted, prints)
    out.facts = {"last_seq": folded.last_seq, "last_crc": folded.last_crc, "position": folded.position,
                 "bytes": folded.bytes, "first_ts": folded.first_ts, "last_ts": folded.last_ts,
                 "signature": signature}
    _save(index, sid, out.facts)


def _save(index: SqliteIndex, sid: str, facts: dict[str, Any]) -> None:
    messages, title = index.view_facts(sid)
    index.save_session({**facts, "session_id": sid, "state": "ok", "messages": messages, "title": title})
    facts.update(messages=messages, title=title)


# -- a storage ------------------------------------------------------------------------------------------
def signature(folder: Path) -> str | None:
    """What changes when a file session's log changes: its active file's inode, size and modification time."""
    from ...storage.paths import LOG_NAME

    try:
        st = os.stat(folder / LOG_NAME)
    except FileNotFoundError:
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def file_sessions(storage: Path) -> dict[str, str | None]:
    """Every session folder of a storage with its log's signature (one ``stat`` each)."""
    from ...storage.paths import LOG_NAME
    from ...storage.segments import MANIFEST_NAME

    out: dict[str, str | None] = {}
    try:
        fd = os.open(storage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    stat = os.stat
    try:
        with os.scandir(fd) as entries:
            for d in entries:
                name = d.name
                if name[0] == "." or not d.is_dir(follow_symlinks=False):
                    continue
                try:  # (relative to the folder's descriptor: no path to build, no symlink of the storage to follow)
                    st = stat(name + "/" + LOG_NAME, dir_fd=fd)
                except FileNotFoundError:
                    if os.path.isfile(os.path.join(storage, name, MANIFEST_NAME)):
                        out[name] = None
                    continue
                out[name] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    finally:
        os.close(fd)
    return out


async def catch_up_session(index: SqliteIndex, storage: Path, sid: str, *, snapshot: Snapshot | None = None,
                           force: bool = False, eraser: bool = False) -> Outcome:
    """Catch one file session up (it is forgotten if its folder is gone: trashed or deleted)."""
    from ...errors import SessionNotFoundError
    from ...storage.log import FileEventLog

    folder = storage / sid
    sig = signature(folder)
    try:
        log = FileEventLog(folder, sid, readonly=True)
    except SessionNotFoundError:
        out = Outcome(sid)
        out.removed = forget(index, [sid], purge=True)
        out.purged = bool(out.removed)
        return out
    try:
        return await catch_up(index, log, signature=sig, snapshot=snapshot, force=force, eraser=eraser)
    finally:
        await log.close()


async def catch_up_storage(index: SqliteIndex, storage: Path,
                           known: dict[str, tuple[str | None, str]] | None = None) -> list[Outcome]:
    """Catch every session of a storage up: those whose log changed since it was indexed (by their
    signatures), those not indexed yet, and those gone (forgotten). One unreadable session is logged and
    skipped, never hides the others."""
    listed = file_sessions(storage)
    if known is None:
        known = index.signatures()
    gone = [sid for sid in known if sid not in listed]
    outcomes = [Outcome(sid, skipped=None) for sid in gone]  # (forgotten: the caller reads the rows again)
    if gone:
        forget(index, gone, purge=True)
    for sid, sig in listed.items():
        was = known.get(sid)
        if was is not None and was == (sig, "ok") and sig is not None:
            continue
        try:
            outcomes.append(await catch_up_session(index, storage, sid))
        except Exception as e:  # (a damaged log: verify and repair say what; the other sessions go on)
            logger.warning("search index: session %s not indexed: %s", sid, e)
            outcomes.append(Outcome(sid, skipped=str(e)))
    return outcomes


def forget(index: SqliteIndex, sids: list[str], *, purge: bool = True) -> int:
    """Remove sessions from the index (trashed, deleted); purges when anything was removed."""
    n = 0
    with index.writing():
        for sid in sids:
            n += index.delete_session(sid)
    if purge and n:
        index.purge()
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
            outcomes = await catch_up_storage(new, storage)
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


@contextlib.contextmanager
def storage_lock(storage: Path, exclusive: bool) -> Iterator[None]:
    """The index's rebuild lock: a rebuild holds it exclusively, an erasure shared (so that a rebuild never
    reads a log an erasure is about to change and an erasure never marks an index about to be replaced)."""
    import fcntl

    from ...storage.paths import make_private_dirs

    folder = index_path(storage).parent
    make_private_dirs(folder)
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def keys_snapshot(seq: int, keys: Any) -> Snapshot:
    """A copy of the history's keys (a packed array: a memcpy) to hand to the indexer."""
    return Snapshot(seq, array("q", keys) if not isinstance(keys, array) else keys[:])


__all__ = ["Outcome", "Snapshot", "catch_up", "catch_up_session", "catch_up_storage", "file_sessions", "forget",
           "keys_snapshot", "rebuild", "signature", "storage_lock", "title_of"]


# -- for the operations that take text out of a storage (trash, segment expiry) ------------------------------
def forget_removed(storage: Path, sid: str) -> None:
    """A session left the storage (moved to the trash): its documents leave the index now, purged."""
    if index_path(storage).exists():
        index = SqliteIndex(storage)
        try:
            forget(index, [sid])
        finally:
            index.close()


async def reindex_changed(storage: Path, sid: str) -> None:
    """A session's log lost records (segments expired): index it again from its log now, purged."""
    if index_path(storage).exists():
        index = SqliteIndex(storage)
        try:
            await catch_up_session(index, storage, sid, force=True)
        finally:
            index.close()
