"""Erasure: remove a message's bytes from everything the store wrote, keep a tombstone, hand out a receipt.

``redact`` hides a message (its bytes stay in the log); ``erase`` removes them (docs/operations.md,
"Erasure"). The record that held the message is replaced, at the same seq, by an ``erased`` tombstone that
keeps the record's ``prev`` and ``ts`` and is padded (``data.pad``) so that its own CRC-32 equals the CRC of
the record it replaces: the next record's ``prev`` still names it, so the chain, ``verify``, checkpoints'
anchors and every reader work unchanged (docs/format.md, "Erasure tombstones"). CRC-32 is affine over GF(2),
so 48 pad characters, each ``a`` or ``c``, give a linear system whose solution is found by elimination.

Every copy of the message's bytes in the log is erased (a ``messages_replaced`` that carried the message
forward holds a copy, and so does an ``expired`` record that carries it: segment retention); checkpoints are
deleted (a cache: the next close writes a new one); the torn-tail and quarantine side files and the compaction
exports in the session folder are rewritten without it, and the expired segments in the session's trash
entries get the same tombstones as the log. The order
makes a crash at any point safe: side copies first (a crash leaves the old log: nothing was acknowledged),
then the log in one atomic rename, the commit point.

The parts: this module rewrites the log (a single file, or the segments of a segmented log) and the PostgreSQL
rows; tombstones.py holds the tombstone format and finds the records holding a message; erasure_scrub.py
rewrites the side files, exports and trashed segments; erasure_receipt.py writes and checks the receipt.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..model import codec
from ..model.projection import split_key
from ..model.values import Value
from ..storage.paths import CHECKPOINT_NAME, LOG_NAME, create_private_file, fsync_dir, write_all
from ..storage.segment_store import _step
from .erasure_receipt import RECEIPT_VERSION, _receipt, check_receipt, check_receipt_postgres, check_receipt_shape
from .erasure_scrub import (TMP_SUFFIX, _rewrite_trash_file, _scan_trash_file, _scrub_export, _scrub_side_file,
                            _trash_changes, clean_leftovers, escaped, export_paths, side_paths, trash_files)
from .copies import not_covered
from .tombstones import (_copies, _scan_file, _scan_segmented, erased_data, find_target, keyed, message_slots,
                         sha256, tombstone)


# -- the file log ---------------------------------------------------------------------------------------
def erase_file(store: Any, seq: int, index: int, reason: str, moved: list[Moved] | None = None) -> dict[str, Any]:
    """Erase the message at ``(seq, index)`` from a file session held by ``store`` (its writer). Returns the
    receipt. The caller rebuilds the store's state afterwards. ``moved``: once the new log is committed, each
    record replaced by a tombstone is appended to it (``Moved``: for the search index, search/erasing.py)."""
    log = store._log
    path: Path = log.path
    directory: Path = log.directory
    size = log.size
    segmented = log.manifest is not None and (bool(log.manifest.segments) or log.manifest.boundary is not None)
    if segmented:
        end = log.position

        def records() -> Any:
            return _scan_segmented(directory, log.session_id, end)
    else:
        def records() -> Any:
            return _scan_file(path, size)
    boundary = log.manifest.boundary if log.manifest is not None else None
    key = os.urandom(32)  # the tombstones' HMAC key: only the receipt holds it (tombstones.keyed)
    # Leftovers of killed steps first (copies.py): a half-purged trash entry may be the only copy left.
    keep = frozenset(p["tmp"] for p in log.manifest.pending if "tmp" in p) if log.manifest is not None else frozenset()
    removed = clean_leftovers(directory, session_id=log.session_id, keep=keep)
    trashed = trash_files(directory.parent, log.session_id)
    try:
        message = find_target((r for r, *_ in records()), seq, index)
    except ValueError:
        if boundary is None or seq > boundary.last_seq:
            raise
        try:  # expired and not carried: only its trash entry may hold it
            message = find_target((r for p in trashed for r, *_ in _scan_trash_file(p)), seq, index)
        except ValueError as e:
            if "already erased" in str(e):
                raise
            sides = [q.name for q in side_paths(directory) + export_paths(directory)]
            raise ValueError(f"seq {seq} expired with the oldest log segments (seqs 1..{boundary.last_seq}) and no "
                             "expired record carries it nor any trash entry holds it (purged): no record holds its "
                             "bytes" + (f"; the side files and compaction exports {', '.join(sides)} may hold copies "
                                        "that erase cannot name without the record: delete them if they may"
                                        if sides else "")) from None
    needle = codec.dumps(message)
    digest = keyed(key, needle)  # (side files and exports get a marker naming it: never an unsalted hash)
    when = codec.now_iso()
    trash_changes = [(p, c) for p in trashed if (c := _trash_changes(p, needle, reason, when, key))]
    # 1. every record holding a copy, and its tombstone
    changes: list[tuple[int, int, bytes, dict[str, Any], list[int], str]] = []
    done: list[Moved] = []
    for rec, start, end, raw in records():
        hits = _copies(rec, needle)
        if hits:
            data = erased_data(rec, hits, reason, when, key)
            line = tombstone(rec, data)
            changes.append((start, end, line, rec, hits, sha256(raw.rstrip(b"\n"))))
            done.append(_moved(rec["seq"], start, end - start, len(line), data, len(hits)))
    receipt = _receipt(store, message, needle, seq, index, reason, when, key)
    receipt["removed_temp_files"] = removed + [
        f"{folder.name}/{name}" for folder in sorted({p.parent for p in trashed})
        for name in clean_leftovers(folder, trash=True)]
    receipt["records"] = [{"seq": rec["seq"], "type": rec["type"], "indices": hits, "offset": start,
                           "bytes": end - start, "record_sha256": raw_digest}
                          for start, end, _, rec, hits, raw_digest in changes]
    if segmented:  # which file held each record (offsets are global positions: docs/format.md, "Segments")
        for item in receipt["records"]:
            i = log.manifest.index_at(item["offset"])
            item["segment"] = log.manifest.segments[i].file if i >= 0 else LOG_NAME
    # 2. the checkpoint (a cache holding the history): deleted before the log changes, so that a crash never
    #    leaves a checkpoint that a later open would trust and that still shows the message
    cp = directory / CHECKPOINT_NAME
    had_cp = cp.exists()
    checkpoint_seq = store._checkpoints.seq if had_cp else None
    store._checkpoints.store.discard_sync()
    receipt["checkpoints"] = ([{"where": str(cp), "seq": checkpoint_seq, "action": "deleted"}] if had_cp else [])
    # 3. side files and the compaction exports this store wrote
    receipt["side_files"] = []
    for p in side_paths(directory):
        n = _scrub_side_file(p, needle, digest)
        if n:
            receipt["side_files"].append({"where": str(p), "copies": n, "action": "rewritten"})
    receipt["exports"] = []
    for p in export_paths(directory):
        n = _scrub_export(p, needle, digest)
        if n:
            receipt["exports"].append({"where": str(p), "lines": n, "action": "rewritten"})
    # 4. expired segments in the trash (segment retention): rewritten with the tombstones, like the log
    receipt["trash"] = []
    for p, trash_edits in trash_changes:
        if _rewrite_trash_file(p, trash_edits):
            receipt["trash"].append({"where": str(p), "entry": p.parent.name, "action": "rewritten",
                                     "records": [{"seq": rec["seq"], "type": rec["type"], "indices": hits}
                                                 for _, _, _, rec, hits in trash_edits]})
    fsync_dir(directory)  # the rewritten copies are durable before the log, the commit point, changes
    _step("erase-copies-written")
    if segmented:
        receipt["log"] = (_erase_in_segments(log, changes) if changes else  # (only the trash held a copy)
                          {"where": str(directory), "rewritten": [], "bytes_before": log.position,
                           "bytes_after": log.position})
        receipt["not_covered"] = not_covered("file")
        if moved is not None:
            moved.extend(done)
        return receipt
    # 5. the log: a new file with the tombstones in place, then one atomic rename (the commit point)
    tmp = directory / (LOG_NAME + TMP_SUFFIX)
    fd = create_private_file(directory, tmp.name)
    try:
        with open(path, "rb") as src:
            pos = 0
            for start, end, line, *_ in changes:
                _copy_range(src, fd, pos, start)
                write_all(fd, line)
                pos = end
            _copy_range(src, fd, pos, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    new_size = os.stat(tmp).st_size
    log.swap_in(tmp, new_size)
    if moved is not None:
        moved.extend(done)
    receipt["log"] = {"where": str(path), "bytes_before": size, "bytes_after": new_size}
    receipt["not_covered"] = not_covered("file")
    return receipt


class Moved(Value):
    """A record an erasure replaced by its tombstone: its seq, where it starts (a file log's global byte
    position; None on PostgreSQL), its length before and after in bytes, and the ``(slot, key)`` of each
    message slot erased in it (the slot as search/fold.py's ``slots`` numbers it)."""

    __slots__ = ("seq", "start", "before", "after", "slots")
    seq: int
    start: int | None
    before: int
    after: int
    slots: tuple[tuple[int, int], ...]

    def __init__(self, seq: int, start: int | None, before: int, after: int,
                 slots: tuple[tuple[int, int], ...]) -> None:
        self.seq = seq
        self.start = start
        self.before = before
        self.after = after
        self.slots = slots


def _moved(seq: int, start: int | None, before: int, after: int, data: dict[str, Any], n: int) -> Moved:
    """The ``Moved`` of a record whose tombstone data is ``data``, ``n`` of its slots erased now (the last
    ``n`` entries of ``data["erased"]``: an earlier erase of the same record listed its own before them)."""
    return Moved(seq, start, before, after, tuple((e["index"], e["key"]) for e in data["erased"][-n:]))


def _erase_in_segments(log: Any, changes: list[tuple[int, int, bytes, dict[str, Any], list[int], str]]
                       ) -> dict[str, Any]:
    """Put the tombstones of ``changes`` (global positions) into a segmented log: each sealed segment that
    holds one is rewritten (re-compressed if it was compressed) and the active segment copied, all as temp
    files, then committed together by one manifest write (segment_store.replace_segments). A tombstone's
    length may differ from its record's: the positions after it move, as in a single-file log."""
    from ..storage.segment_store import read_segment

    manifest = log.manifest
    directory: Path = log.directory
    base = manifest.base
    sealed: dict[int, bytearray] = {}
    edits: dict[int, list[tuple[int, int, bytes]]] = {}
    active = [c for c in changes if c[0] >= base]
    for start, end, line, *_ in changes:
        if start >= base:
            continue
        i = manifest.index_at(start)
        seg = manifest.segments[i]
        if i not in sealed:
            sealed[i] = bytearray(read_segment(directory, seg))  # (checked against its SHA-256)
        sealed.setdefault(-1 - i, bytearray())  # (marks the order of edits: applied from the end, below)
        edits.setdefault(i, []).append((start - seg.start, end - seg.start, line))
    for i, items in edits.items():  # a tombstone may be longer or shorter than its record: from the end
        for a, b, line in sorted(items, reverse=True):
            sealed[i][a:b] = line
    sealed = {i: d for i, d in sealed.items() if i >= 0}
    before = log.position
    tmp_name = None
    if active:
        tmp_name = LOG_NAME + TMP_SUFFIX
        fd = create_private_file(directory, tmp_name)
        try:
            with open(log.path, "rb") as src:
                pos = 0
                for start, end, line, *_ in active:
                    _copy_range(src, fd, pos, start - base)
                    write_all(fd, line)
                    pos = end - base
                _copy_range(src, fd, pos, log.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    names = [manifest.segments[i].file for i in sorted(sealed)] + ([LOG_NAME] if active else [])
    log.replace_segments({i: bytes(d) for i, d in sealed.items()}, tmp_name)
    return {"where": str(directory), "rewritten": names, "bytes_before": before, "bytes_after": log.position}


def _copy_range(src: Any, fd: int, start: int, end: int) -> None:
    src.seek(start)
    left = end - start
    while left > 0:
        chunk = src.read(min(left, 1 << 20))
        if not chunk:
            raise OSError(f"the log ended {left} bytes early while erasing")
        write_all(fd, chunk)
        left -= len(chunk)


# -- PostgreSQL -----------------------------------------------------------------------------------------
async def erase_postgres(store: Any, seq: int, index: int, reason: str, vacuum: bool | str = False,
                         moved: list[Moved] | None = None) -> dict[str, Any]:
    """Erase from a PostgreSQL session: every row holding a copy is updated and the checkpoint row deleted, in
    one transaction. Returns the receipt. The rows are read a batch at a time (the record at ``seq``, then one
    pass looking for copies): only the tombstones are held, never the history.

    The old row versions stay in the tables' pages until a VACUUM: ``vacuum=True`` runs ``VACUUM`` on the
    events and checkpoints tables afterwards, ``vacuum="full"`` ``VACUUM FULL`` (it rewrites the tables,
    holding an exclusive lock on them: every session's appends wait). The receipt says what remains
    (``not_covered``; docs/operations.md, "Erasure")."""
    log = store._log
    message = None
    async for batch in log.read_batches(max(0, seq - 1)):
        message = find_target(batch, seq, index)  # (the first batch starts at seq: ValueError if it is not there)
        break
    if message is None:
        raise ValueError(f"seq {seq} is not in this session's log")
    needle = codec.dumps(message)
    when = codec.now_iso()
    key = os.urandom(32)
    updates: dict[int, bytes] = {}
    listed = []
    done: list[Moved] = []
    async for batch in log.read_batches(0):
        sizes = getattr(log, "batch_sizes", None) or [0] * len(batch)
        for rec, size in zip(batch, sizes):
            hits = _copies(rec, needle)
            if hits:
                data = erased_data(rec, hits, reason, when, key)
                updates[rec["seq"]] = tombstone(rec, data)
                listed.append({"seq": rec["seq"], "type": rec["type"], "indices": hits, "row": rec["seq"]})
                done.append(_moved(rec["seq"], None, size, len(updates[rec["seq"]]), data, len(hits)))
    had_cp = await log.replace_records(updates)
    if moved is not None:
        moved.extend(done)
    receipt = _receipt(store, message, needle, seq, index, reason, when, key)
    receipt["records"] = listed
    receipt["checkpoints"] = ([{"where": f"{log.schema}.checkpoints", "action": "deleted"}] if had_cp else [])
    receipt["side_files"] = []
    receipt["exports"] = []
    receipt["trash"] = []  # (segment expiry is a file-backend feature: nothing of a session is trashed in part)
    receipt["log"] = {"where": str(log.path)}
    receipt["not_covered"] = not_covered("postgres")
    if vacuum:
        from ..storage.pg.vacuum import vacuum_tables

        full = vacuum == "full"
        receipt["vacuum"] = await vacuum_tables(log, full)
        receipt["not_covered"] = [n for n in receipt["not_covered"] if n["what"] != "dead row versions"]
        if not full:
            receipt["not_covered"].insert(0, {"what": "free space in the tables' pages", "why": (
                "VACUUM removed the old row versions; the space they took is free but may still hold their bytes "
                "until new rows overwrite it (vacuum=\"full\" rewrites the tables)")})
    return receipt


# (the names other modules and the tests import from here, as before the split)
__all__ = ["Moved", "RECEIPT_VERSION", "check_receipt", "check_receipt_postgres", "check_receipt_shape", "clean_leftovers",
           "erase_file", "erase_postgres", "erased_data", "escaped", "message_slots", "split_key", "tombstone",
           "trash_files"]
