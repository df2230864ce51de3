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
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from ..model import codec
from ..model import events as ev
from ..storage.checkpoint import CheckpointError, FileCheckpointStore, decode as decode_checkpoint, mismatch
from ..errors import SessionNotFoundError
from ..errors import LogCorruptedError
from ..storage.log import FileLock, crash_leaves, data_size
from ..storage.segment_store import recover
from ..storage.segments import MANIFEST_NAME, LogReader
from ..storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, LOCK_NAME, LOG_NAME, create_private_file, fsync_dir, write_all
from ..storage.pages import MessageReader
from ..model.projection import Counts, Projection, Refs, same_items
from .semantic import Finding, check as semantic_check

#: The audit event repair appends to a log it rebuilt (the projection ignores it).
REPAIRED = ev.LOG_REPAIRED
QUARANTINE_PREFIX = LOG_NAME + ".quarantine-"
TORN_PREFIX = LOG_NAME + ".torn-"
_REPAIR_TMP = LOG_NAME + ".repair-tmp"
_MAX_LISTED = 100  # quarantined pieces listed in the audit event (all are in the quarantine file)


@dataclass
class Problem:
    """One finding: ``kind`` (corrupt, torn, seq, link, session, unloadable, segment), where it is (line and
    byte offset in the whole log: global positions for a segmented log), and why."""

    kind: str
    line: int
    offset: int
    length: int
    reason: str
    seq: int | None = None
    #: What these bytes held that the history loses without them (seqs, event type, message), as far as
    #: can be told; None for a problem that removes nothing (an unloadable record is kept).
    lost: str | None = None

    def describe(self) -> str:
        what = {"corrupt": "corrupt record", "torn": "torn tail", "seq": "out-of-order record",
                "unloadable": "unloadable record", "link": "foreign record", "session": "foreign log",
                "segment": "damaged sealed segment"}[self.kind]
        text = f"{what} at line {self.line} (byte offset {self.offset}, {self.length} bytes): {self.reason}"
        return text + (f"; {self.lost}" if self.lost else "")


def _content_of(raw: bytes) -> str:
    """What a bad piece seems to hold, read without trusting it: event type and message role and text."""
    try:
        rec = orjson.loads(raw.strip())
    except orjson.JSONDecodeError:
        kind = re.search(rb'"type.{1,3}?([a-z_]{4,})"', raw)  # (the flipped byte may be in these names too)
        role = re.search(rb'"role.{1,3}?([a-z_]{4,})"', raw)
        if kind is None:
            return "content unreadable"
        what = kind.group(1).decode() + (f" of a {role.group(1).decode()} message" if role else "")
        return f"it looks like a {what} event (not valid JSON any more)"
    if not isinstance(rec, dict):
        return "content unreadable"
    data: dict[str, Any] = rec["data"] if isinstance(rec.get("data"), dict) else {}
    msg: dict[str, Any] | None = data["message"] if isinstance(data.get("message"), dict) else None
    text = f"{rec.get('type')} event"
    if msg is not None:
        content = msg.get("content")
        body = content if isinstance(content, str) else orjson.dumps(content).decode()
        text = f"{msg.get('role')} message {body[:60]!r}" + ("…" if len(body) > 60 else "")
    elif isinstance(data.get("messages"), list):
        text = f"{len(data['messages'])} messages (a replacement)"
    return f"it held {text} (unverified)"


@dataclass
class Gap:
    """Seqs ``after_seq + 1 .. next_seq - 1`` are missing; ``explained`` if a repair recorded it."""

    after_seq: int
    next_seq: int
    explained: bool = False
    #: Bad bytes sit where the missing seqs were: the gap is that corruption, already reported as a problem.
    corrupt: bool = False


@dataclass
class Report:
    """What verify found in one session (``ok`` means exit code 0)."""

    session_id: str
    path: str
    size: int
    records: int = 0
    first_seq: int = 0
    last_seq: int = 0
    problems: list[Problem] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)
    writer_pid: int | None = None
    #: Semantic findings on the history the log folds into (semantic.py): tool-call pairing and order.
    semantic: list[Finding] = field(default_factory=list)
    #: The sealed segments' files, in order (empty for a single-file log); each was checked (check_segments).
    segments: list[str] = field(default_factory=list)
    #: When the oldest segments expired (segment retention): ``{last_seq, expired_seq, start}``, else None.
    expired: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return (not self.problems and all(g.explained or g.corrupt for g in self.gaps)
                and self.checkpoint.get("ok", True) and not any(f.problem for f in self.semantic))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class RepairResult:
    """What repair did; ``changed`` is False when the log needed nothing."""

    session_id: str
    path: str
    changed: bool
    kept: int
    quarantined: list[Problem]
    quarantine_file: str | None
    gaps: list[Gap]
    checkpoint_removed: bool
    old_size: int
    new_size: int
    audit_seq: int | None
    unfixable: list[Problem]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the walk (shared by verify and repair) ----------------------------------------------------------
def _reader_lines(reader: LogReader, size: int, skip: list[Problem]) -> Iterator[tuple[int, int, bytes]]:
    """As :func:`_lines` across a segmented log (global offsets; lines counted over the whole log), leaving out
    the sealed segments in ``skip`` (damaged: reported on their own; their seqs show as a gap)."""
    n = 0
    ranges = [(s.start, s.end) for s in reader.segments if not any(p.offset == s.start for p in skip)]
    ranges.append((reader.base, size))
    for start, end in ranges:
        for offset, line in reader.lines(start, end):
            n += 1
            yield n, offset, line


def _check_segment(reader: LogReader, i: int) -> None:
    """Raise (ValueError, OSError, LogCorruptedError, codec.RecordError) if sealed segment ``i`` is not what its
    manifest entry says. Streams the segment (1 MiB reads, or one zstd frame at a time), so memory does not grow
    with the segment's size."""
    f = reader.segment_file(i)
    seg = f.seg  # (the reader's entry: compressed meanwhile, it names the compressed file)
    if seg.compressed is not None:
        blob = hashlib.sha256()
        pos = 0
        while chunk := os.pread(f.fd, 1 << 20, pos):
            blob.update(chunk)
            pos += len(chunk)
        if "sha256:" + blob.hexdigest() != seg.compressed.sha256:
            raise ValueError(f"the compressed file's SHA-256 is not {seg.compressed.sha256}")
    digest = hashlib.sha256()
    size = 0
    if seg.compressed is not None:
        for _, data in f.chunks(0):  # every frame on its own, as random reads use them (each size checked)
            digest.update(data)
            size += len(data)
    else:
        while data := os.pread(f.fd, 1 << 20, size):  # to the file's end (a longer file is not the segment)
            digest.update(data)
            size += len(data)
    if size != seg.size or "sha256:" + digest.hexdigest() != seg.sha256:
        raise LogCorruptedError(str(f.path), 0, 0,
                                f"its contents ({size} bytes, sha256:{digest.hexdigest()}) are not what the "
                                f"manifest recorded when it was sealed ({seg.size} bytes, {seg.sha256})")
    if not size:
        raise ValueError("it is empty")
    first = codec.decode(f.line_at(0))
    last = codec.decode(f.line_ending_at(size))
    f.drop_cache()
    if (first["seq"], first["crc"], last["seq"], last["crc"]) != (seg.first_seq, seg.first_crc,
                                                                  seg.last_seq, seg.last_crc):
        raise ValueError(f"it holds seqs {first['seq']}..{last['seq']} (crc {first['crc']}..{last['crc']}), "
                         f"the manifest says {seg.first_seq}..{seg.last_seq} "
                         f"({seg.first_crc}..{seg.last_crc})")


def check_segments(reader: LogReader) -> list[Problem]:
    """Each sealed segment against its manifest entry: the file's SHA-256 (and, compressed, that every frame
    decompresses to the recorded bytes), its size, and its first and last record's seq and crc. Reads each
    segment in pieces: memory stays bounded whatever the segments' sizes."""
    problems = []
    for i, seg in enumerate(reader.segments):
        try:
            _check_segment(reader, i)
        except (OSError, ValueError, LogCorruptedError, codec.RecordError) as e:
            reason = e.reason if isinstance(e, LogCorruptedError) else str(e)
            problems.append(Problem("segment", 0, seg.start, seg.size, f"{seg.file}: {reason}", seg.first_seq,
                                    lost=f"seqs {seg.first_seq}..{seg.last_seq} cannot be trusted until it is "
                                         "restored from a backup"))
    return problems


def _after_expiry(reader: LogReader, directory: Path, session_id: str) -> tuple[Projection | None,
                                                                              tuple[int, str] | None]:
    """When the log's oldest segments expired (segment retention): the state to fold from (seeded from the
    ``expired`` record) and ``(last_seq, last_crc)`` the chain continues from; else ``(None, None)``."""
    boundary = reader.manifest.boundary
    if boundary is None:
        return None, None
    from types import SimpleNamespace

    from ..storage.checkpoint.policy import seed_state

    at = SimpleNamespace(manifest=reader.manifest, reader=reader.copy)
    return seed_state(at, MessageReader(directory, open_reader=reader.copy)), (boundary.last_seq, boundary.last_crc)


def _lines(path: Path, size: int) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, offset, bytes)`` of each line within the first ``size`` bytes."""
    with open(path, "rb") as f:
        offset = 0
        for n, line in enumerate(f, 1):
            if offset + len(line) > size:
                line = line[: size - offset]
            if line:
                yield n, offset, line
            offset += len(line)
            if offset >= size:
                return


class _Walk:
    """One pass over a log: classifies every byte; ``keep`` receives the raw bytes of each kept record."""

    def __init__(self, path: Path, size: int, keep: Callable[[bytes], None] | None = None,
                 fold: bool = False, on_record: Callable[[dict[str, Any], int, Projection | None], None] | None = None,
                 progress: Callable[[int, int], None] | None = None, session_id: str = "",
                 lines: Iterator[tuple[int, int, bytes]] | None = None, paged: bool = True,
                 seed: Projection | None = None, after: tuple[int, str] | None = None,
                 open_reader: Callable[[], LogReader] | None = None) -> None:
        self.path, self.size, self.keep, self.on_record = path, size, keep, on_record
        self.lines = lines if lines is not None else _lines(path, size)
        self.root = codec.root_crc(session_id).decode()
        self.last_crc: str | None = None  # of the last kept record: the next one must name it (prev)
        self.chained = False
        self.foreign: set[Any] = set()  # crcs of the records quarantined as foreign
        self.progress = progress
        # (paged: messages stay refs into this log, read back only to compare, so memory stays bounded; a repair,
        # which replaces the log, holds them instead)
        self.state = (seed if seed is not None else Projection(MessageReader(path.parent, open_reader=open_reader)
                                                               if paged else None)) if fold else None
        self.records = 0
        self.first_seq = self.last_seq = 0
        self.first_crc: str | None = None
        #: ``(last_seq, last_crc)`` of the expired records before the log's first one (segment retention).
        self.after = after
        if after is not None:
            self.last_seq, self.last_crc, self.chained = after[0], after[1], True
        self.problems: list[Problem] = []
        self.bad: list[tuple[Problem, bytes]] = []  # every bad piece with its bytes (for the quarantine)
        self._pending: list[tuple[Problem, bytes]] = []  # bad pieces no valid record has followed yet
        self.gaps: list[Gap] = []
        self.explained: set[tuple[int, int]] = set()
        self.session_problem: str | None = None

    def run(self) -> "_Walk":
        progress = self.progress
        for n, offset, line in self.lines:
            if progress is not None and not n & 0xFFF:
                progress(offset, self.size)
            if line[-1:] != b"\n":
                self._bad(n, offset, line, "unterminated last record (no newline): a write cut short")
                continue
            try:
                self._good(n, offset, line, codec.decode(line))
                continue
            except codec.RecordError:
                pass
            pieces = codec.split_records(line[:-1])
            for i, (rel, seg, rec, reason) in enumerate(pieces):
                raw = seg + b"\n" if i == len(pieces) - 1 else seg
                if rec is None:
                    self._bad(n, offset + rel, raw, reason)
                else:
                    self._good(n, offset + rel, seg + b"\n", rec)
        if self._pending:  # nothing valid after them: one torn tail, as open sees it
            first = self._pending[0][0]
            raw = b"".join(r for _, r in self._pending)
            torn = Problem("torn", first.line, first.offset, len(raw), first.reason,
                           lost=f"the history loses what followed seq {self.last_seq}, never acknowledged as "
                                f"written if a writer crashed mid-append; {_content_of(raw)}")
            if not crash_leaves(self._pending[0][1]):  # a complete line: corruption (log.crash_leaves)
                torn = Problem("corrupt", first.line, first.offset, len(raw),
                               f"{first.reason}; it is the last record, but complete (newline-terminated, no "
                               "NUL bytes), which no crash leaves behind: it was changed after it was written",
                               lost=f"the history loses seq {self.last_seq + 1}; {_content_of(raw)}")
            self.problems.append(torn)
            self.bad.append((torn, raw))
        for gap in self.gaps:
            gap.explained = (gap.after_seq, gap.next_seq) in self.explained
        if self.session_problem is not None:
            self.problems.append(Problem("session", 1, 0, 0, self.session_problem, self.first_seq))
        return self

    def _bad(self, n: int, offset: int, raw: bytes, reason: str) -> None:
        self._pending.append((Problem("corrupt", n, offset, len(raw), reason), raw))

    def _link(self, rec: dict[str, Any], seq: int) -> str | None:
        """Why ``rec`` breaks the chain (codec.Links) after the last kept record, else None (it is then the
        last). A break right after a seq gap is the gap's (records are missing there: reported as a gap, and a
        repair records it); a break at the log's first record means the log names another session id
        (reported, never fixed: see ``session_problem``)."""
        prev = rec.get("prev")
        if prev is None:
            broken = self.chained
        else:
            broken = prev != (self.last_crc if self.records else self.root)
            self.chained = True
        if prev is not None and self.records == 0 and self.after is not None:
            broken = prev != self.after[1]  # (the first record left names the last expired one)
        if broken and self.records == 0 and self.after is None:
            if seq > 1:  # the log's first records are missing: a gap from seq 0 (reported, recorded by repair)
                self.gaps.append(Gap(0, seq))
            else:
                self.session_problem = (f"record seq {seq} names {prev} as its predecessor instead of this "
                                        f"session's root {self.root}: the log was written for another session "
                                        "id (a renamed or copied session folder?); give the folder its original "
                                        "name")
            broken = False
        gap = (self.records > 0 or self.after is not None) and seq > self.last_seq + 1
        if broken and prev in self.foreign:  # it chains onto a foreign record: foreign too (a spliced run)
            gap = False
        if broken and not gap:
            self.foreign.add(rec.get("crc"))
            if prev is None:
                return f"record seq {seq} is an unchained (version 1) record after chained ones: not appended to this log"
            return (f"record seq {seq} names crc {prev} as its predecessor, but the record before it (seq "
                    f"{self.last_seq}) has crc {self.last_crc}: it was not appended after it (a record from "
                    "another log, or a copy)")
        self.last_crc = rec.get("crc")
        return None

    def _flush_pending(self) -> None:
        for problem, raw in self._pending:
            self.problems.append(problem)
            self.bad.append((problem, raw))
        self._pending = []

    def _good(self, n: int, offset: int, raw: bytes, rec: dict[str, Any]) -> None:
        seq = rec["seq"]
        if self._pending:  # say what the bad bytes took from the history: the seqs missing where they are
            missing = seq - self.last_seq - 1
            for i, (problem, bad_raw) in enumerate(self._pending):
                if missing <= 0:
                    problem.lost = f"no seq is missing where it is: not a record of the history; {_content_of(bad_raw)}"
                    continue
                lo, hi = self.last_seq + 1, seq - 1
                if missing == len(self._pending):
                    lo = hi = self.last_seq + 1 + i
                span = f"seq {lo}" if lo == hi else f"seqs {lo}..{hi} (between seq {self.last_seq} and seq {seq})"
                problem.lost = f"the history loses {span}; {_content_of(bad_raw)}"
        corrupt_before = bool(self._pending)
        self._flush_pending()  # bad bytes before a valid record are corruption, not a torn tail
        if seq <= self.last_seq:
            problem = Problem("seq", n, offset, len(raw), f"seq {seq} does not follow seq {self.last_seq}", seq,
                              lost=f"the history loses this copy of seq {seq} ({rec['type']}); the record of "
                                   f"seq {seq} before it stays")
            self.problems.append(problem)
            self.bad.append((problem, raw))
            return
        link = self._link(rec, seq)
        if link is not None:  # a valid record that was not appended after the one before it: not this log's
            problem = Problem("link", n, offset, len(raw), link, seq)
            self.problems.append(problem)
            self.bad.append((problem, raw))
            return
        if self.records == 0:
            self.first_seq, self.first_crc = seq, rec.get("crc")
        if (self.records or self.after is not None) and seq > self.last_seq + 1:
            self.gaps.append(Gap(self.last_seq, seq, corrupt=corrupt_before))
        self.last_seq = seq
        self.records += 1
        if rec["type"] == REPAIRED:
            for a, b in rec["data"].get("gaps", []):
                self.explained.add((a, b))
        if self.keep is not None:
            self.keep(raw)
        if self.state is not None:
            try:
                self.state.apply(rec, offset, len(raw))
            except Exception as e:  # a valid checksum but a shape this program cannot fold
                self.problems.append(Problem("unloadable", n, offset, len(raw),
                                             f"record seq {seq} ({rec['type']}) cannot be loaded: "
                                             f"{type(e).__name__}: {e}", seq))
        if self.on_record is not None:
            self.on_record(rec, offset + len(raw), self.state)


# -- verify ------------------------------------------------------------------------------------------
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
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def side_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith((TORN_PREFIX, QUARANTINE_PREFIX)))


_LISTS = ("messages", "keys", "tokens")


def _normal(state: dict[str, Any]) -> Any:
    """A projection state's facts as plain JSON values, its per-message lists left out."""
    return orjson.loads(orjson.dumps({k: v for k, v in state.items() if k not in _LISTS}))


def _stored_state(stored: dict[str, Any], pager: MessageReader) -> Projection | None:
    """A checkpoint's state as a projection, its lists packed (refs, keys and token counts: 24 bytes a message;
    the parsed lists can then be dropped before the log is walked); None if it does not load."""
    try:
        state = Projection.from_state(stored, pager)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return None
    state.tokens = Counts()  # (not compared: token counts are a cache inside the cache)
    return state


def _same_state(state: Projection, stored: Projection | dict[str, Any] | None, directory: Path) -> bool:
    """Whether a checkpoint's state (as stored, or :func:`_stored_state`) equals the fold, token counts left
    out; messages compared one at a time (refs to the same record are equal without reading it, all of them at
    once when all are; a ref and a message are compared by content, the ref read from the log in ``directory``)."""
    if isinstance(stored, dict):
        reader = MessageReader(directory)
        try:
            return _same_state(state, _stored_state(stored, reader), directory)
        finally:
            reader.close()
    if stored is None:
        return False
    mine, theirs = state.to_state(refs=True), stored.to_state(refs=True)
    a, b = mine["messages"], theirs["messages"]
    if _normal(mine) != _normal(theirs) or len(a) != len(b) or not same_items(mine["keys"], theirs["keys"]):
        return False
    if type(a) is Refs and not a.extras and not b.extras and a.a == b.a:
        return True
    pager: Any = state.pager or stored.pager

    def get(v: Any) -> Any:
        return pager.fetch(v) if type(v) is int else v

    return all(x == y if type(x) is int and type(y) is int else get(x) == get(y) for x, y in zip(a, b))


def _check_checkpoint(directory: Path, session_id: str
                      ) -> tuple[dict[str, Any], Callable[[dict[str, Any], int, Projection | None], None], Callable[[_Walk], None]]:
    """The checkpoint status, filled in during the walk (``on_record``) and after it (``finish``)."""
    status: dict[str, Any] = {"status": "missing", "ok": True}
    store = FileCheckpointStore(directory)
    try:
        payload = store.read_sync()  # (never blocks on a FIFO, never reads through a link)
    except CheckpointError as e:
        payload = None
        status.update(status="ignored", ok=False, reason=str(e))
    cp = None
    if payload is not None:
        try:
            cp = decode_checkpoint(payload, packed=True)
            status.update(seq=cp.seq, position=cp.position, bytes=len(payload))
            reason = mismatch(cp, session_id=session_id)
            if reason:
                status.update(status="ignored", ok=False, reason=reason)
                cp = None
        except CheckpointError as e:
            status.update(status="ignored", ok=False, reason=str(e))
    seen: dict[str, Any] = {}
    stored: Projection | None = None
    if cp is not None and cp.state is not None:
        stored = _stored_state(cp.state, MessageReader(directory))
        cp = replace(cp, state=None)  # (the parsed lists go: the walk folds the history beside it)

    def on_record(rec: dict[str, Any], end: int, state: Projection | None) -> None:
        nonlocal stored
        if cp is None:
            return
        if rec["seq"] == cp.state_seq:  # the state section is at the base of a based checkpoint (or at seq)
            seen["same"] = state is not None and _same_state(state, stored, directory)
            if stored is not None:
                stored.pager.close()  # type: ignore[union-attr]
                stored = None
            if cp.base is not None:
                seen["base"] = end == cp.base["position"] and rec.get("crc") == cp.base["last_crc"]
        if rec["seq"] == cp.seq:
            seen["end"], seen["crc"] = end, rec.get("crc")

    def finish(walk: _Walk) -> None:
        if cp is None:
            return
        if walk.first_crc != cp.first_crc:
            reason = "its first-record fingerprint does not match the log (written for another log)"
        elif "end" not in seen:
            reason = f"it is at seq {cp.seq}, which the log does not hold (the log ends at seq {walk.last_seq})"
        elif seen["end"] != cp.position or seen["crc"] != cp.last_crc:
            reason = f"the record at its seq {cp.seq} is not the one it was written after (the log was rewritten)"
        elif cp.base is not None and not seen.get("base"):
            reason = (f"its state section's record (seq {cp.state_seq}) is not the one it was written after "
                      "(the log was rewritten)")
        elif not seen.get("same"):
            reason = f"its state differs from the log replayed up to seq {cp.state_seq}"
        else:
            status.update(status="valid", behind=walk.last_seq - cp.seq)
            return
        status.update(status="ignored", ok=False, reason=reason)

    return status, on_record, finish


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
    """Read the whole log (never taking the lock) and report every problem; see the module docstring.

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
    return orjson.dumps(entry) + b"\n"


def _write_quarantine(directory: Path, path: Path, size: int, bad: list[tuple[Problem, bytes]]) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    qpath = directory / f"{QUARANTINE_PREFIX}{stamp}-{os.urandom(3).hex()}"
    out = _Writer(qpath)
    try:
        out(orjson.dumps({"quarantined_from": str(path), "at": codec.now_iso(), "original_size": size,
                          "pieces": len(bad)}) + b"\n")
        for problem, raw in bad:
            out(_quarantine_entry(problem, raw))
        out.finish()
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
            removed = status["status"] == "ignored"
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
        os.replace(out.path, path)
        fsync_dir(directory)
    except BaseException:
        out.abandon()
        raise
    had_checkpoint = store.path.exists()
    store.discard_sync()  # its position means nothing in the rebuilt file
    return RepairResult(session_id, str(path), True, walk.records, fixable, str(qpath) if qpath else None,
                        walk.gaps, had_checkpoint, size, out.size, audit_seq, unfixable)
