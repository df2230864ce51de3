"""verify and repair a file session: find every bad byte, keep every valid record (the CLI is cli/durability.py).

Both walk the whole log the way open does, but never stop at the first problem. What they find:

* ``corrupt``: bytes that are not a valid record, with a valid record after them (open refuses the log);
* ``torn``: bytes after the last valid record (a write cut short; open cuts them to a side file);
* ``seq``: a valid record whose seq does not exceed the one before it (open refuses the log);
* ``link``: a valid record that does not name the record kept before it (``prev``, codec.Links) with no seq
  gap there: another log's record (open refuses the log; repair quarantines it). A break right after a gap is
  the gap's, and repair records the gap;
* ``session`` (never fixed): the first record names another session id's root (a renamed or copied folder);
* ``unloadable`` (verify only): a valid record this program cannot fold into its state;
* seq gaps: a seq that skips numbers. Repair leaves gaps (see below), and records them in a
  ``log_repaired`` event; gaps listed there are "explained", any other gap is a problem;
* the checkpoint: missing (fine), valid, or why open would ignore it;
* (verify) the semantic findings on the history (semantic.py): unpaired tool calls and results.

A newline lost or flipped by a bad bit merges records into one line: every complete record inside such a
line is still found and kept (codec.split_records).

Repair, holding the writer lock: writes the valid records, byte for byte, to a temp file, appends a
``log_repaired`` audit event, fsyncs it, writes every bad piece (line, byte offset, reason, bytes) to
``events.jsonl.quarantine-<time>`` (fsynced), then renames the temp file over the log and fsyncs the
folder; the checkpoint (a cache) is removed. Nothing is lost: the new log plus the quarantine file hold
every byte of the old log. Seqs are never renumbered: message keys, pins and redactions name seqs, so
renumbering would silently re-point them. Gaps are allowed by open (seqs must only increase).

The parts: this module is repair (the quarantine and the rewrite); verify.py is verify; log_walk.py is the
walk both share; checkpoint_check.py checks the checkpoint against the log; repair_report.py holds what they
return (``Problem``, ``Gap``, ``Report``, ``RepairResult``). The names are all importable from here.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..model import json_lossless
from ..model import codec
from ..storage.checkpoint import FileCheckpointStore
from ..storage.log import FileLock, data_size
from ..storage.paths import LOCK_NAME, LOG_NAME, create_private_file, fsync_dir, write_all
from ..storage.segment_store import _step, recover
from ..storage.segments import MANIFEST_NAME, LogReader
from .checkpoint_check import _check_checkpoint
from .log_walk import _after_expiry, _reader_lines, _Walk, check_segments
from .repair_report import QUARANTINE_PREFIX, REPAIRED, TORN_PREFIX, Gap, Problem, RepairResult, Report
from .verify import _log_path, side_files, verify, writer_pid

_REPAIR_TMP = LOG_NAME + ".repair-tmp"
#: The quarantine file is written under this name and renamed once complete (copies.py lists both: a killed
#: repair's temp files are removed by the next erase).
_QUARANTINE_TMP = LOG_NAME + ".repair-quarantine.tmp"
_MAX_LISTED = 100  # quarantined pieces listed in the audit event (all are in the quarantine file)


# -- repair ------------------------------------------------------------------------------------------
class _Writer:
    """Buffered appends to a new private file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = create_private_file(path.parent, path.name)  # (never through a link left in its place)
        self.buf: list[bytes] = []
        self.buffered = 0
        self.size = 0

    def __call__(self, data: bytes) -> None:
        self.buf.append(data)
        self.buffered += len(data)
        if self.buffered >= 1 << 20:
            self.flush()

    def flush(self) -> None:
        data = b"".join(self.buf)
        self.size += len(data)
        write_all(self.fd, data)
        self.buf, self.buffered = [], 0

    def finish(self) -> None:
        self.flush()
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def _quarantine_entry(problem: Problem, raw: bytes) -> bytes:
    entry: dict[str, Any] = {"kind": problem.kind, "line": problem.line, "offset": problem.offset,
                             "length": problem.length, "reason": problem.reason}
    try:
        entry["raw"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        entry["raw_b64"] = base64.b64encode(raw).decode("ascii")
    return json_lossless.dumps(entry) + b"\n"


def _write_quarantine(directory: Path, path: Path, size: int, bad: list[tuple[Problem, bytes]]) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    qpath = directory / f"{QUARANTINE_PREFIX}{stamp}-{os.urandom(3).hex()}"
    out = _Writer(directory / _QUARANTINE_TMP)
    try:
        out(json_lossless.dumps({"quarantined_from": str(path), "at": codec.now_iso(), "original_size": size,
                          "pieces": len(bad)}) + b"\n")
        for problem, raw in bad:
            out(_quarantine_entry(problem, raw))
        out.finish()
        _step("repair-quarantine-written")
        os.replace(out.path, qpath)  # (a quarantine file is always whole: every piece in it decodes)
    except BaseException:
        out.abandon()
        raise
    return qpath


def repair(directory: Path, session_id: str, progress: Callable[[int, int], None] | None = None) -> RepairResult:
    """Rebuild the log without its bad bytes, holding the writer lock (SessionLockedError if it is held)."""
    path = _log_path(directory, session_id)
    lock = FileLock(directory / LOCK_NAME, session_id)
    try:
        recover(directory, session_id)  # (a roll, compression or erasure a killed writer left midway)
        return _repair_locked(directory, session_id, path, progress)
    finally:
        lock.release()


def _segmented_walk(directory: Path, session_id: str, out: Callable[[bytes], None], on_record: Any,
                    progress: Callable[[int, int], None] | None) -> tuple[_Walk, int, int]:
    """The walk of a segmented log: every segment is read (the chain runs across them), only the active
    segment's records are kept (written to ``out``). Returns ``(walk, base, size)``; a problem inside a sealed
    segment is unfixable here (repair never rewrites a sealed segment: restore it from a backup)."""
    with LogReader(directory, session_id) as reader:
        base = reader.base
        size = reader.end()
        segment_problems = check_segments(reader)
        at = [0]

        def lines() -> Iterator[tuple[int, int, bytes]]:
            for n, offset, line in _reader_lines(reader, size, segment_problems):
                at[0] = offset
                yield n, offset, line

        def keep(raw: bytes) -> None:
            if at[0] >= base:
                out(raw)

        seed, after = _after_expiry(reader, directory, session_id)
        walk = _Walk(directory / LOG_NAME, size, keep=keep, fold=True, on_record=on_record, progress=progress,
                     session_id=session_id, lines=lines(), seed=seed, after=after).run()
    for p in segment_problems:
        walk.problems.insert(0, p)
    for p, _ in walk.bad:
        if p.offset < base:
            p.kind, p.reason = "segment", (f"{p.reason} (inside a sealed segment, which repair never rewrites: "
                                           "restore the segment from a backup)")
    walk.bad = [(p, raw) for p, raw in walk.bad if p.kind != "segment"]
    return walk, base, size


def _repair_locked(directory: Path, session_id: str, path: Path,
                   progress: Callable[[int, int], None] | None = None) -> RepairResult:
    size = data_size(path)  # (the writer's reserved tail, if a crash left one, is not part of the log)
    status, on_record, finish = _check_checkpoint(directory, session_id)
    store = FileCheckpointStore(directory)
    out = _Writer(directory / _REPAIR_TMP)
    segmented = (directory / MANIFEST_NAME).exists()
    try:
        if segmented:
            walk, base, size = _segmented_walk(directory, session_id, out, on_record, progress)
        else:
            walk = _Walk(path, size, keep=out, fold=True, on_record=on_record, progress=progress,
                         session_id=session_id, paged=False).run()
        finish(walk)
        fixable = [p for p, _ in walk.bad]
        unfixable = [p for p in walk.problems if p.kind in ("unloadable", "session", "segment")]
        if segmented and any(p.kind == "segment" for p in unfixable):
            out.abandon()
            return RepairResult(session_id, str(path), False, walk.records, [], None, walk.gaps, False,
                                size, size, None, unfixable)
        # A log of another session id is never rebuilt: its records are not ours to keep or quarantine.
        if (not fixable and all(g.explained for g in walk.gaps)) or any(p.kind == "session" for p in unfixable):
            out.abandon()
            removed = status["status"] == "ignored" or not status.get("ok", True)  # (or its message section)
            if removed:
                store.discard_sync()  # a checkpoint open would ignore: remove the useless cache
            return RepairResult(session_id, str(path), False, walk.records, [], None, walk.gaps, removed,
                                size, size, None, unfixable)
        audit_seq = None
        if walk.records:  # record what was done, and the gaps it leaves, in the log itself
            audit_seq = walk.last_seq + 1
            out(codec.encode_event(audit_seq, REPAIRED, {
                "program": "context-persistent repair", "original_size": size, "quarantined": len(fixable),
                "gaps": [[g.after_seq, g.next_seq] for g in walk.gaps],
                "pieces": [{"kind": p.kind, "line": p.line, "offset": p.offset, "length": p.length,
                            "reason": p.reason} for p in fixable[:_MAX_LISTED]],
            }, prev=(walk.last_crc or walk.root).encode()))
            for g in walk.gaps:
                g.explained = True
        qpath = _write_quarantine(directory, path, size, walk.bad) if walk.bad else None
        out.finish()
        fsync_dir(directory)  # the quarantine file is durable before the log loses the bytes
        _step("repair-log-written")
        os.replace(out.path, path)
        fsync_dir(directory)
    except BaseException:
        out.abandon()
        raise
    had_checkpoint = store.path.exists()
    store.discard_sync()  # its position means nothing in the rebuilt file
    return RepairResult(session_id, str(path), True, walk.records, fixable, str(qpath) if qpath else None,
                        walk.gaps, had_checkpoint, size, out.size, audit_seq, unfixable)


__all__ = ["QUARANTINE_PREFIX", "REPAIRED", "TORN_PREFIX", "Gap", "Problem", "RepairResult", "Report",
           "check_segments", "repair", "side_files", "verify", "writer_pid"]
