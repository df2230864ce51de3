"""Reading a session's log across its segments by global position (:class:`LogReader`), without the lock.

A session's log is a sequence of segments: sealed ones listed in the manifest (manifest.py: the layout, the
manifest's parsing and writing, global positions), then the active ``events.jsonl``. A sealed segment's file is
plain or zstd frames (segment_file.py: :class:`SegmentFile`, :func:`compress`). Their names are importable
from here too.

Readers never take the writer lock. A roll renames ``events.jsonl`` to the new sealed name after the manifest
lists it (docs/format.md, "Segments"); :class:`LogReader` resolves which file is which against a manifest that
did not change while it looked, and finds a segment compressed after that in its ``.zst``.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator
from ..model.values import replace
from pathlib import Path

from ..model import codec
from ..errors import LogCorruptedError, RecordsExpiredError
from .manifest import (MANIFEST_NAME, MIN_SEGMENT_BYTES, SEALED_MODE, SEGMENT_BYTES, SEGMENT_PREFIX, ZST,
                       Boundary, Compressed, Manifest, ManifestError, Segment, _manifest_bytes, check_segment_bytes,
                       load_manifest, parse_manifest, segment_name, sha256_hex, write_manifest)
from .paths import LOG_NAME
from .records import data_end
from .segment_file import FRAME_BYTES, SegmentFile, compress, decompress_all, decompress_frame, frame_chunks


#: Below this many bytes :meth:`LogReader.find_seq` reads line by line instead of bisecting further.
_BISECT_BYTES = 1 << 20
#: How many times a reader looks again when a roll replaced a file between two of its looks, waiting a little
#: longer each time (from 1 ms up to 50 ms: about 0.6 s in all) so that a writer that rolls every few records,
#: on a loaded machine, cannot change the manifest during every look.
_ATTEMPTS = 20


#: File descriptors left free for the rest of the process when a reader opens a long log's segments.
_FD_SPARE = 256


def _room_for_files(n: int) -> None:
    """Make room for ``n`` more open files: a reader holds one per sealed segment (a session of 1,000 segments of
    64 MiB would pass the usual soft limit of 1,024), so the soft limit is raised toward the hard one when
    needed; where it cannot be, opening fails with the system's error (EMFILE), which names the cause."""
    if n < 64:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + _FD_SPARE
    if soft != resource.RLIM_INFINITY and soft < want:
        top = want * 2 if hard == resource.RLIM_INFINITY else min(hard, want * 2)
        if top > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))


def _open_ro(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


def _open_first(directory: Path, names: tuple[str, ...]) -> int:
    """The first of ``names`` that exists in ``directory``, opened read-only."""
    for name in names[:-1]:
        try:
            return _open_ro(directory / name)
        except FileNotFoundError:
            pass
    return _open_ro(directory / names[-1])


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class LogReader:
    """A consistent view of a session's log files for reading by global position (never takes the lock).

    Resolves at construction which file holds what: the manifest's sealed segments and the active segment
    ``events.jsonl`` (held open, so a roll that renames it meanwhile does not change what is read). Reads of
    the active segment see what was appended after construction too. Close it (or use ``with``).
    """

    def __init__(self, directory: str | os.PathLike[str], session_id: str | None = None) -> None:
        self.directory = Path(directory)
        self.session_id = session_id if session_id is not None else self.directory.name
        self._files: dict[int, SegmentFile] = {}
        self.active_fd = -1
        for attempt in range(_ATTEMPTS):
            try:
                self._resolve()
                return
            except FileNotFoundError:  # a roll or compression replaced a file between two looks: look again
                self.close()
                # (no session folder: no session, not a roll, which never removes it; a mistyped id is told at once)
                if attempt == _ATTEMPTS - 1 or not self.directory.is_dir():
                    raise
                time.sleep(min(0.001 * 2 ** attempt, 0.05))

    def _resolve(self) -> None:
        """Open ``events.jsonl``, read the manifest, and decide what the opened file is for that manifest.

        The manifest is read twice, before and after the checks, and must not change in between (else
        FileNotFoundError: look again). A writer renames files only while one manifest stands (a roll between
        its commit and its end lists a pending seal), so the checks see files that belong to that manifest: the
        opened file is the active segment, or the segment the manifest is sealing (renamed or not yet), or it
        is stale (look again). Inode numbers identify files: the one held open cannot be reused meanwhile."""
        try:
            self.active_fd = _open_ro(self.directory / LOG_NAME)
        except FileNotFoundError:
            self.active_fd = -1
        raw = _manifest_bytes(self.directory)
        path = self.directory / MANIFEST_NAME
        manifest = parse_manifest(raw, path, self.session_id) if raw is not None else None
        self.manifest = manifest if manifest is not None else Manifest(self.session_id)
        #: Set when the active file is in fact the last sealed segment (a roll between its two renames).
        self._active_is_last = False
        last = self.manifest.segments[-1] if self.manifest.segments else None
        if self.active_fd >= 0:
            ours = os.fstat(self.active_fd).st_ino
            active_now = _inode(self.directory / LOG_NAME)  # (first: the order matters, see below)
            last_now = _inode(self.directory / last.name) if last is not None else None
            sealing = last is not None and {"op": "seal", "name": last.name} in self.manifest.pending
            if last_now == ours:  # the manifest lists what we hold as its last segment, renamed already
                if sealing:
                    self._active_is_last = True
                else:  # (sealed before the manifest was read: what we hold is no longer the active one)
                    os.close(self.active_fd)
                    self.active_fd = -1
            elif active_now != ours:
                raise FileNotFoundError("the active segment changed while it was opened")  # (look again)
            elif sealing and last_now is None:
                # The seal's rename had not happened when the sealed name was looked at, after
                # events.jsonl was: what we hold is the file being sealed, not the next active one.
                self._active_is_last = True
        elif last is None:
            raise FileNotFoundError(f"no {LOG_NAME} in {self.directory}")
        elif not any(os.path.exists(self.directory / n) for n in (last.name, last.name + ZST)):
            raise FileNotFoundError(f"{self.directory / last.file} is missing")
        # Every file of this manifest is opened now, so that what is read later is this manifest's log even if
        # an erasure replaces files or an expiry moves them meanwhile. Between an erasure's commit and its
        # renames (pending ``replace`` steps), the committed contents are in the temp files.
        _room_for_files(len(self.manifest.segments))
        renaming = {p["name"]: p["tmp"] for p in self.manifest.pending if p["op"] == "replace"}
        if LOG_NAME in renaming and self.active_fd >= 0:
            fd = _open_first(self.directory, (renaming[LOG_NAME], LOG_NAME))
            os.close(self.active_fd)
            self.active_fd = fd
        for i, seg in enumerate(self.manifest.segments):
            if not (self._active_is_last and i == len(self.manifest.segments) - 1):
                self.segment_file(i, renaming.get(seg.file))
        if _manifest_bytes(self.directory) != raw:
            raise FileNotFoundError(f"{path} changed while the log's files were looked at")  # (look again)

    @property
    def base(self) -> int:
        """The global position where the active segment starts."""
        return self.manifest.base

    @property
    def start(self) -> int:
        """The global position of the first record the log still holds (0 unless segments expired)."""
        return self.manifest.start

    def expired(self, asked: str) -> RecordsExpiredError:
        """The error for a read of something before :attr:`start` (segment retention expired it)."""
        b = self.manifest.boundary
        assert b is not None
        return RecordsExpiredError(str(self.directory), asked, b.last_seq, b.start, b.expired_seq)

    @property
    def active_is_sealed(self) -> bool:
        """True while a roll is between its two steps: ``events.jsonl`` is still the segment just sealed."""
        return self._active_is_last

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.manifest.segments

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.active_fd >= 0:
            os.close(self.active_fd)
            self.active_fd = -1

    def segment_file(self, i: int, tmp: str | None = None) -> SegmentFile:
        """Sealed segment ``i`` (opened when the reader was made; ``tmp``: the temp file holding its committed
        contents, while a pending ``replace`` step has not renamed it yet)."""
        f = self._files.get(i)
        if f is None:
            seg = self.manifest.segments[i]
            if self._active_is_last and i == len(self.manifest.segments) - 1:
                fd = os.dup(self.active_fd)
            else:
                try:
                    fd = _open_ro(self.directory / tmp) if tmp is not None else -1
                except FileNotFoundError:  # renamed into place already
                    fd = -1
                if fd < 0:
                    seg, fd = self._open_segment(seg)
            f = self._files[i] = SegmentFile(self.directory, seg, fd)
        return f

    def copy(self) -> LogReader:
        """Another reader of the very files this one reads (descriptors duplicated): the same log, whatever
        a writer renamed or rewrote since. Close it too."""
        other = LogReader.__new__(LogReader)
        other.directory, other.session_id, other.manifest = self.directory, self.session_id, self.manifest
        other._active_is_last = self._active_is_last
        other._files = {}
        other.active_fd = -1
        try:
            other.active_fd = os.dup(self.active_fd) if self.active_fd >= 0 else -1
            for i, f in self._files.items():
                other._files[i] = SegmentFile(self.directory, f.seg, os.dup(f.fd))
        except BaseException:
            other.close()
            raise
        return other

    def _open_segment(self, seg: Segment) -> tuple[Segment, int]:
        """The file of sealed segment ``seg`` opened, and its entry as that file stores it: a compression
        may replace the plain file by ``.zst`` at any time (the ``.zst`` is in place before the plain one
        goes), so each form is looked for in turn until one is found."""
        for _ in range(_ATTEMPTS):
            if seg.compressed is None:
                try:
                    return seg, _open_ro(self.directory / seg.name)
                except FileNotFoundError:  # compressed since the manifest was read: the same bytes
                    seg = self._compressed_now(seg)
            try:
                return seg, _open_ro(self.directory / seg.file)
            except FileNotFoundError:
                pass
            try:  # compressed, the plain copy not yet removed
                return replace(seg, compressed=None), _open_ro(self.directory / seg.name)
            except FileNotFoundError:
                pass  # removed right after the .zst was put in place: look for it again
        raise FileNotFoundError(f"{self.directory / seg.file} is missing")

    def _compressed_now(self, seg: Segment) -> Segment:
        """The entry of ``seg`` in the manifest as it is now, if the writer compressed it meanwhile (same name,
        range and contents); FileNotFoundError if not."""
        now = load_manifest(self.directory, self.session_id)
        for other in now.segments if now is not None else ():
            if (other.name, other.start, other.end, other.sha256) == (seg.name, seg.start, seg.end, seg.sha256) \
                    and other.compressed is not None:
                return other
        raise FileNotFoundError(f"{self.directory / seg.file} is gone and the manifest lists no compressed copy")

    def active_size(self) -> int:
        """The active segment's data size now (its reserved tail excluded)."""
        if self.active_fd < 0 or self._active_is_last:
            return 0
        return data_end(self.active_fd)

    def end(self) -> int:
        """The global position of the end of the log's data now."""
        return self.base + self.active_size()

    def where(self, position: int) -> tuple[Path, int]:
        """``(file, offset inside its uncompressed bytes)`` of a global position (for messages)."""
        i = self.manifest.index_at(position)
        if i < 0:
            return self.directory / LOG_NAME, position - self.base
        seg = self.manifest.segments[i]
        return self.directory / seg.file, position - seg.start

    def line_number(self, position: int) -> int:
        """The 1-based line number, inside its file, of the line at global ``position`` (for messages)."""
        i = self.manifest.index_at(position)
        start = self.manifest.segments[i].start if i >= 0 else self.base
        return 1 + sum(data.count(b"\n") for _, data in self.chunks(start, position))

    def chunks(self, position: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
        """``(global position, bytes)`` pieces of the log's data from ``position`` (a record start) to ``end``
        (default: the data end now), across segments."""
        stop = self.end() if end is None else end
        pos = max(position, self.manifest.start)  # (before it: expired records, no longer in the log)
        segs = self.manifest.segments
        i = self.manifest.index_at(pos)
        while 0 <= i < len(segs) and pos < stop:
            seg = segs[i]
            for off, data in self.segment_file(i).chunks(pos - seg.start):
                g = seg.start + off
                if g >= stop:
                    break
                piece = data[: stop - g]
                yield g, piece
                pos = g + len(piece)
            self.segment_file(i).drop_cache()  # (a pass over many segments keeps no frame of each)
            i += 1
        while pos < stop and self.active_fd >= 0 and not self._active_is_last:
            data = os.pread(self.active_fd, min(1 << 20, stop - pos), pos - self.base)
            if not data:
                break
            yield pos, data
            pos += len(data)

    def lines(self, position: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
        """``(global position, line)`` of each line from ``position`` (a record start) to ``end``; a last
        line without its newline is yielded as it is. Lines never span segments."""
        carry = b""
        carry_at = position
        for g, data in self.chunks(position, end):
            if carry and g != carry_at + len(carry):
                yield carry_at, carry  # (a segment ended without a newline: not possible when sealed)
                carry = b""
            if not carry:
                carry_at = g
            buf = carry + data if carry else data
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                yield carry_at + start, buf[start:nl + 1]
                start = nl + 1
            carry = buf[start:]
            carry_at += start
        if carry:
            yield carry_at, carry

    def find_seq(self, seq: int) -> tuple[int, bytes] | None:
        """``(global position, line)`` of the record ``seq``, reading only the segment whose seq range holds it
        (the active one after the last); None if no line there has that seq. Inside it the record is found by
        bisection on the seqs of the records (they increase through the log), then read line by line from at
        most ``_BISECT_BYTES`` before it. Lines are not verified here, beyond the probes' checksums."""
        start, end = self.base, self.end()
        for s in self.manifest.segments:
            if s.first_seq <= seq <= s.last_seq:
                start, end = s.start, s.end
                break
        lo, hi = start, end  # the record, if there, starts in [lo, hi); lo is a record's start
        while hi - lo > _BISECT_BYTES:
            probe = self._line_from((lo + hi) // 2, hi)
            if probe is None:
                hi = (lo + hi) // 2
                continue
            at, line = probe
            try:
                found = codec.checked_seq(line)[0]
            except codec.RecordError:
                break  # (a damaged line: read on line by line from lo, as without bisection)
            if found == seq:
                return at, line
            if found < seq:
                lo = at
            else:
                hi = at
        needle = b'"seq":%d,' % seq
        for at, line in self.lines(lo, hi):
            if line[:40].find(needle) >= 0:
                return at, line
        return None

    def _line_from(self, position: int, end: int) -> tuple[int, bytes] | None:
        """``(global position, line)`` of the first line that starts at or after ``position`` and before
        ``end``, else None."""
        for g, data in self.chunks(position - 1, end):
            nl = data.find(b"\n")
            if nl >= 0:
                at = g + nl + 1
                return (at, self.read_line_at(at)) if at < end else None
        return None

    def anchor_for(self, seq: int) -> tuple[int, int] | None:
        """Where to start reading the records after ``seq``: ``(seq of a record, global position right after
        it)`` for record ``seq`` itself when the log holds it, else for the last record of the sealed segment
        before the first one that holds later seqs. Reads only the segment that holds ``seq`` (by bisection,
        :meth:`find_seq`). None: read from the start."""
        segs = self.manifest.segments
        if seq < 1 or seq <= (self.manifest.boundary.last_seq if self.manifest.boundary is not None else 0):
            return None
        i = bisect.bisect_left([s.last_seq for s in segs], seq)  # the first segment with a seq >= seq
        if i == len(segs) or segs[i].first_seq <= seq:
            found = self.find_seq(seq)
            if found is not None and _verified_seq(found[1]) == seq:
                return seq, found[0] + len(found[1])
        return (segs[i - 1].last_seq, segs[i - 1].end) if i > 0 else None

    def anchor_before_last(self, n: int, end: int | None = None) -> tuple[int, int] | None:
        """Where to start reading the last ``n`` records before global ``end`` (default: the data end now):
        ``(seq of the record before them, global position right after it)``, found from ``end`` backwards a
        line at a time, reading only the segments (and, compressed, the frames) that hold these lines. Lines
        that do not verify (a torn tail) are not counted: whoever reads on from the anchor judges them. None
        when the log holds no more than ``n`` records: read from the start."""
        position = self.end() if end is None else end
        while position > self.manifest.start:
            line = self.line_ending_at(position)
            if not line:
                break
            seq = _verified_seq(line)
            if seq is not None:
                if n == 0:
                    return seq, position
                n -= 1
            position -= len(line)
        return None

    def read_line_at(self, position: int) -> bytes:
        """The record line (with its newline) that starts at global ``position``.

        Reads only the file (and, for a compressed segment, the one frame) that holds it. Raises ValueError
        for a position that is not an integer >= 0, LogCorruptedError if no complete line starts there (the
        log ends before its newline: it is shorter than whoever recorded the position believes). The caller
        decodes and so verifies the line (``codec.decode``).
        """
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an integer >= 0, got {position!r}")
        if position < self.manifest.start:
            raise self.expired(f"the record at position {position}")
        i = self.manifest.index_at(position)
        if i >= 0:
            seg = self.manifest.segments[i]
            line = self.segment_file(i).line_at(position - seg.start)
            if not line.endswith(b"\n"):
                raise LogCorruptedError(str(self.directory / seg.file), 0, position - seg.start,
                                        "no complete record starts at this byte")
            return line
        if position < self.base or self.active_fd < 0 or self._active_is_last:
            raise self._past_end(position)
        out = bytearray()
        pos = position - self.base
        while True:
            data = os.pread(self.active_fd, 4096 if not out else 1 << 16, pos)
            if not data:
                break
            nl = data.find(b"\n")
            if nl >= 0:
                out += data[:nl + 1]
                break
            out += data
            pos += len(data)
        if not out.endswith(b"\n"):
            raise self._past_end(position)
        return bytes(out)

    def _past_end(self, position: int) -> LogCorruptedError:
        return LogCorruptedError(str(self.directory / LOG_NAME), 0, position,
                                 f"no complete record starts at global position {position}: the log ends at "
                                 f"{self.end()}, before its newline")

    def line_ending_at(self, position: int) -> bytes:
        """The line that ends exactly at global ``position`` (b"" at 0, and at or before the first record left
        when segments expired)."""
        if position <= self.manifest.start:
            return b""
        i = self.manifest.index_at(position - 1)
        if i >= 0:
            seg = self.manifest.segments[i]
            return self.segment_file(i).line_ending_at(position - seg.start)
        back = 0
        offset = position - self.base
        while True:
            back = min(offset, max(back * 16, 4096))
            chunk = os.pread(self.active_fd, back, offset - back)
            start = chunk.rfind(b"\n", 0, len(chunk) - 1) + 1
            if start > 0 or back == offset:
                return chunk[start:]


def _verified_seq(line: bytes) -> int | None:
    """The seq of a complete record line whose checksum verifies, else None."""
    try:
        return codec.checked_seq(line)[0] if line.endswith(b"\n") else None
    except codec.RecordError:
        return None


def has_log(directory: Path) -> bool:
    """Whether the session folder holds a log: ``events.jsonl`` or, segmented, a manifest (a roll killed
    between its renames leaves no ``events.jsonl`` until the next writer opens the log)."""
    return (directory / LOG_NAME).is_file() or (directory / MANIFEST_NAME).is_file()


def read_line_at(log_dir: str | os.PathLike[str], position: int, session_id: str | None = None) -> bytes:
    """The record line that starts at global byte ``position`` of the session log in folder ``log_dir`` (or
    given by its ``events.jsonl``). Raises as :meth:`LogReader.read_line_at`.

    For many reads keep a :class:`LogReader` open instead (this opens and closes one).
    """
    folder = Path(log_dir)
    if folder.name == LOG_NAME and not folder.is_dir():
        folder = folder.parent
    with LogReader(folder, session_id) as reader:
        return reader.read_line_at(position)


#: The manifest's names (manifest.py) and a sealed file's (segment_file.py) are importable from here too.
__all__ = ["Boundary", "Compressed", "FRAME_BYTES", "LogReader", "MANIFEST_NAME", "MIN_SEGMENT_BYTES", "Manifest",
           "ManifestError", "SEALED_MODE", "SEGMENT_BYTES", "SEGMENT_PREFIX", "Segment", "SegmentFile", "ZST",
           "check_segment_bytes", "compress", "decompress_all", "decompress_frame", "frame_chunks", "has_log",
           "load_manifest", "parse_manifest", "read_line_at", "segment_name", "sha256_hex", "write_manifest"]
