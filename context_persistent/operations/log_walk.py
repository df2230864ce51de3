"""The walk verify and repair share (repair.py): one pass over a log, never stopping at the first problem,
that classifies every byte as a kept record or a bad piece (``_Walk``), across a segmented log's files
(``_reader_lines``), after checking each sealed segment against its manifest entry (``check_segments``) and
seeding the fold from an ``expired`` record when the oldest segments expired (``_after_expiry``)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from ..model import json_lossless
from ..errors import LogCorruptedError
from ..model import codec
from ..model.projection import Projection
from ..storage.log import crash_leaves
from ..storage.pages import STREAM_CACHE_BYTES, MessageReader
from ..storage.segments import LogReader
from .repair_report import REPAIRED, Gap, Problem


def _content_of(raw: bytes) -> str:
    """What a bad piece seems to hold, read without trusting it: event type and message role and text."""
    try:
        rec = json_lossless.loads(raw.strip())
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
        body = content if isinstance(content, str) else json_lossless.dumps(content).decode()
        text = f"{msg.get('role')} message {body[:60]!r}" + ("…" if len(body) > 60 else "")
    elif isinstance(data.get("messages"), list):
        text = f"{len(data['messages'])} messages (a replacement)"
    return f"it held {text} (unverified)"


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
        pager = MessageReader(path.parent, STREAM_CACHE_BYTES, open_reader=open_reader) if paged else None
        self.state = (seed if seed is not None else Projection(pager)) if fold else None
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
