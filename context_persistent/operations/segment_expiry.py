"""Expiring the oldest sealed segments of a kept session (I/O; retention.py decides which, trash.py holds the
ledger and the trash).

The steps, each durable before the next, so that a process killed at any point leaves a state that opens
with nothing acknowledged lost and no half-expired view (docs/operations.md, "Retention"):

1. the ledger records a ``segments_trashed`` entry (what, why, when, which policy, each segment's SHA-256);
2. the session's log gets an ``expired`` record (the range, the segments, the carried messages embedded),
   appended and fsynced like any record: from here on every view is the expired one, whether or not the
   files are gone yet;
3. the session's checkpoint is deleted (it may refer to records in the expired segments);
4. the manifest is rewritten: it lists the surviving segments only, records the boundary (the last expired
   seq and crc, where the first surviving record starts, the ``expired`` record's seq) and, as
   pending steps, the moves of the expired files (the commit point for the files);
5. the files are moved into ``.retention/trash/<entry>/`` and the manifest is written without the steps.

A kill after 1 and before 2 is cancelled by the next retention command (``segments_cancelled``: nothing of
the session changed); after 2 and before 4 the next retention command carries out 3-5; after 4 the next open
of the session (writer) or retention command finishes the moves (``segment_store.recover``). The writer
lock is held throughout: a session open by a writer is never touched.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ..model import codec
from .search import indexer as search_index
from ..errors import LogCorruptedError
from ..model.events import expired_of
from ..storage.log import FileEventLog
from ..storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, fsync_dir, make_private_dirs
from ..model.projection import Projection
from ..model.retention import SEGMENTS_CANCELLED, SEGMENTS_TRASHED, ENTRY_SEP, RetentionPolicy, SegmentExpiry, expired_data
from ..storage.segment_store import _step
from ..storage.segments import Boundary, Manifest, SEGMENT_PREFIX, write_manifest

#: Kill points of the crash tests, in order (``CONTEXT_PERSISTENT_CRASH_AT``).
STEPS = ("expire-ledger", "expire-recorded", "expire-checkpoint", "expire-manifest", "expire-file-moved",
         "expire-moved")


def _number(name: str) -> int:
    return int(name[len(SEGMENT_PREFIX):].split(".")[0])


def _records_state(log: FileEventLog, records: list[tuple[dict[str, Any], int]], upto: int | None) -> Projection:
    from ..storage.checkpoint.replay import seed_state

    state = seed_state(log, None)
    for rec, _ in records:
        if upto is not None and rec["seq"] > upto:
            break
        state.apply(rec)
    return state


async def _read_all(log: FileEventLog) -> list[tuple[dict[str, Any], int]]:
    out: list[tuple[dict[str, Any], int]] = []
    async for batch in log.read_batches(0):
        out.extend(zip(batch, (s for s, _ in log.batch_spans)))
    return out


def find_expired(log: FileEventLog, entry: str) -> tuple[dict[str, Any], int] | None:
    """The ``expired`` record of trash entry ``entry`` in the log and its position, if it was written."""
    needle = f'"entry":"{entry}"'.encode()
    with log.reader() as reader:
        for at, line in reader.lines(reader.start):
            if (b'"type":"expired"' in line or b'"of":"expired"' in line) and needle in line:
                rec = codec.decode(line)
                data = expired_of(rec)  # (an expired record, or its erasure tombstone)
                if data is not None and data.get("entry") == entry:
                    return rec, at
    return None


def discard_checkpoint(directory: Path) -> None:
    """Delete the session's checkpoint (it may refer to expired records); the next open replays from the
    boundary, seeded from the ``expired`` record, and writes a new one."""
    removed = False
    for name in (CHECKPOINT_NAME, CHECKPOINT_BASE_NAME):
        try:
            os.unlink(directory / name)
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(directory)


def commit_and_move(log: FileEventLog, storage: Path, entry: str, rec: dict[str, Any]) -> Manifest:
    """Steps 3-5 for the ``expired`` record ``rec`` (already durable in the log)."""
    directory = log.directory
    data = expired_of(rec)
    assert data is not None
    discard_checkpoint(directory)
    _step("expire-checkpoint")
    manifest = log.manifest
    assert manifest is not None
    names = [s["name"] for s in data["segments"]]
    gone = [s for s in manifest.segments if s.name in names]
    left = tuple(s for s in manifest.segments if s.name not in names)
    if [s.name for s in gone] != names or (left and left[0].first_seq != data["last_seq"] + 1):
        raise LogCorruptedError(str(directory / "segments.json"), 0, 0,
                                f"the expired record seq {rec['seq']} names segments {', '.join(names)}, which are "
                                "not the oldest ones the manifest lists; nothing was moved")
    start = left[0].start if left else manifest.base
    boundary = Boundary(data["last_seq"], data["boundary_crc"], start, rec["seq"], max(_number(s.name) for s in gone))
    pending = tuple({"op": "expire", "name": s.file, "entry": entry} for s in gone)
    write_manifest(directory, manifest.with_boundary(boundary, left, pending))  # the commit point for the files
    _step("expire-manifest")
    from ..storage.segment_store import recover

    done, _ = recover(directory, log.session_id, quiet=True)  # the moves, exactly as after a crash
    assert done is not None
    log.manifest = done
    _step("expire-moved")
    return done


async def expire(storage: Path, ledger: Any, session_id: str, picked: list[SegmentExpiry], policy: RetentionPolicy,
                 now: datetime) -> dict[str, Any] | None:
    """Expire the sealed segments ``picked`` (the oldest of the session, oldest first) of one session: the
    five steps above. SessionLockedError if a writer holds the session. Returns the ledger record's data, or
    None when nothing could be expired (``picked`` empty after the checks)."""
    folder = storage / session_id
    log = FileEventLog(folder, session_id, create=False)
    try:
        records = await _read_all(log)
        if log.torn is not None:
            log.cut_torn_tail()  # (a write cut short by a crash: what an open does first)
        manifest = log.manifest
        if manifest is None or not picked:
            return None
        names = [e.segment.name for e in picked]
        segs = manifest.segments[:len(names)]
        if [s.name for s in segs] != names:
            return None  # the log changed since the plan: the next apply plans again
        last = segs[-1]
        prior = manifest.boundary
        if prior is not None and prior.expired_seq > last.last_seq:
            return None  # (an earlier expiry's record lies after these: it must expire with them; later)
        boundary_state = _records_state(log, records, last.last_seq)
        now_state = _records_state(log, records, None)
        entry = f"{session_id}{ENTRY_SEP}{ledger.next_seq}"
        seg_rows = [{"name": s.name, "file": s.file, "first_seq": s.first_seq, "last_seq": s.last_seq,
                     "first_crc": s.first_crc, "last_crc": s.last_crc, "start": s.start, "end": s.end,
                     "sha256": s.sha256, "compressed_sha256": s.compressed.sha256 if s.compressed else None}
                    for s in segs]
        first_seq = prior.last_seq + 1 if prior is not None else 1
        rule = picked[-1].rule if len({e.rule for e in picked}) == 1 else ", ".join(sorted({e.rule for e in picked}))
        reason = "; ".join(dict.fromkeys(e.reason for e in picked))
        ledger_data = {"entry": entry, "session_id": session_id, "rule": rule, "reason": reason,
                       "policy": policy.as_dict(), "segments": seg_rows, "first_seq": first_seq,
                       "last_seq": last.last_seq, "bytes": sum(s.size for s in segs), "files": len(segs),
                       "log": None, "manifest": None, "grace_days": policy.grace_days,
                       "purge_after": (now + timedelta(days=policy.grace_days)).isoformat()}
        await ledger.append(SEGMENTS_TRASHED, ledger_data)
        _step("expire-ledger")
        data = expired_data(boundary_state, now_state, first_seq, last.last_seq, last.last_crc, segments=seg_rows,
                            rule=rule, reason=reason, policy=policy.as_dict(), expired_at=now.isoformat())
        data["entry"] = entry
        seq = log.last_seq + 1
        line = codec.encode_event(seq, "expired", data, prev=log.last_crc or codec.root_crc(session_id))
        await log.append((line,), seq)
        _step("expire-recorded")
        make_private_dirs(Path(storage) / ".retention" / "trash")
        commit_and_move(log, storage, entry, codec.decode(line))
        await search_index.reindex_changed(storage, session_id)  # (the expired messages leave the search index)
        return ledger_data
    finally:
        await log.close()


__all__ = ["SEGMENTS_CANCELLED", "SEGMENTS_TRASHED", "STEPS", "commit_and_move", "discard_checkpoint", "expire",
           "find_expired"]
