"""verify: read a whole session (never taking the lock) and report every problem (what it finds: repair.py's
module docstring). The walk is log_walk.py's, the checkpoint check checkpoint_check.py's; the report types
are in repair_report.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LogCorruptedError, SessionNotFoundError
from ..storage.lockfile import pid_alive
from ..storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, LOCK_NAME, LOG_NAME
from ..storage.segments import MANIFEST_NAME, LogReader
from .checkpoint_check import _check_checkpoint
from .log_walk import _after_expiry, _reader_lines, _Walk, check_segments
from .repair_report import QUARANTINE_PREFIX, TORN_PREFIX, Report
from .semantic import Finding, check as semantic_check


def _log_path(directory: Path, session_id: str) -> Path:
    path = directory / LOG_NAME
    if not path.is_file():
        raise SessionNotFoundError(f"session {session_id!r} not found: no {path}")
    return path


def writer_pid(directory: Path) -> int | None:
    """The pid written in the lock file if that process is alive (a hint: verify never takes the lock)."""
    try:
        text = (directory / LOCK_NAME).read_text().strip()
        pid = int(text) if text else None
    except (OSError, ValueError):
        return None
    return pid if pid is not None and pid_alive(pid) else None


def side_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith((TORN_PREFIX, QUARANTINE_PREFIX)))


#: How many times verify reads a log again that an erasure or expiry rewrote while it read (then reports).
_VERIFY_ATTEMPTS = 5


def _identity(directory: Path) -> tuple[Any, ...]:
    """What changes when a writer rewrites the log or its checkpoint (never on an append): the active file's
    and the checkpoint's identities and the manifest's bytes."""
    def ident(name: str) -> tuple[int, int] | None:
        try:
            st = os.stat(directory / name)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns if name != LOG_NAME else 0

    try:
        manifest = (directory / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        manifest = None
    return ident(LOG_NAME), ident(CHECKPOINT_NAME), ident(CHECKPOINT_BASE_NAME), manifest


def verify(directory: Path, session_id: str, progress: Callable[[int, int], None] | None = None) -> Report:
    """Read the whole log (never taking the lock) and report every problem; see repair.py's module docstring.

    ``progress(bytes_done, bytes_total)`` is called every 4,096 lines (the CLI draws a bar with it). The log
    is read as it was when verify began; a problem found while a writer rewrote the log or replaced its
    checkpoint (an erasure, a segment expiry, a checkpoint write) is checked again on the log as it is now."""
    for attempt in range(_VERIFY_ATTEMPTS):
        before = _identity(directory)
        try:
            report = _verify(directory, session_id, progress)
        except (LogCorruptedError, FileNotFoundError):
            if attempt == _VERIFY_ATTEMPTS - 1 or _identity(directory) == before:
                raise
            continue
        if report.ok or attempt == _VERIFY_ATTEMPTS - 1 or _identity(directory) == before:
            return report
    raise AssertionError("unreachable")


def _verify(directory: Path, session_id: str, progress: Callable[[int, int], None] | None) -> Report:
    try:
        reader = LogReader(directory, session_id)
    except FileNotFoundError:
        raise SessionNotFoundError(f"session {session_id!r} not found: no {directory / LOG_NAME}") from None
    with reader:
        path = directory / LOG_NAME
        size = reader.end()  # a writer may append meanwhile: we check what was there when we started
        segment_problems = check_segments(reader)
        status, on_record, finish = _check_checkpoint(directory, session_id)
        boundary = reader.manifest.boundary
        lines = _reader_lines(reader, size, segment_problems)  # (the files the reader opened, whatever happens)
        seed, after = _after_expiry(reader, directory, session_id)
        walk = _Walk(path, size, fold=True, on_record=on_record, progress=progress, session_id=session_id,
                     lines=lines, seed=seed, after=after, open_reader=reader.copy).run()
        walk.problems[:0] = segment_problems
        segment_files = [seg.file for seg in reader.segments]
        finish(walk)
        pid = writer_pid(directory)
        findings: list[Finding] = []
        if walk.state is not None:  # (the history as far as it could be folded)
            findings = semantic_check(walk.state.messages, walk.state.keys, writer_active=pid is not None)
            if walk.problems:  # a history with records missing: its pairing follows from them, not a problem of its own
                for f in findings:
                    if f.problem:
                        f.problem = False
                        f.detail += " (the history has bad records above: check again after `repair`)"
        if walk.state is not None and walk.state.pager is not None:
            walk.state.pager.close()  # type: ignore[attr-defined]
    expired = None if boundary is None else {"last_seq": boundary.last_seq, "expired_seq": boundary.expired_seq,
                                             "start": boundary.start}
    return Report(session_id=session_id, path=str(path), size=size, records=walk.records, expired=expired,
                  first_seq=walk.first_seq, last_seq=walk.last_seq, problems=walk.problems, gaps=walk.gaps,
                  checkpoint=status, side_files=side_files(directory), writer_pid=pid, semantic=findings,
                  segments=segment_files)
