"""Segmented file logs: the manifest, the layout of a session's log files, and reading across them.

A session's log is a sequence of segments. The *active* segment is ``events.jsonl``, appended to exactly like
a single-file log; *sealed* segments (``segment-NNNNNN.jsonl``, or ``.jsonl.zst`` when compressed) are
earlier, immutable parts of the log listed in ``segments.json`` (the manifest) with their seq range, crc
range, byte range and SHA-256. A log without a manifest is a single-file log: a log with no sealed segments.

Positions are global: the byte offset as if the uncompressed contents of every segment, then the active one,
were one file. A sealed segment covers ``[start, end)``; the active segment starts at the last one's ``end``
(``Manifest.base``). Checkpoints, follow and erasure keep using byte positions unchanged.

Compressed segments are concatenated zstd frames, each holding whole records (about ``FRAME_BYTES`` of
them), with a frame index in the manifest: a random read decompresses one frame. ``zstdcat`` reads them as
one stream. ``zstandard`` is imported only when a compressed segment is read or written.

Readers never take the writer lock. A roll renames ``events.jsonl`` to the new sealed name after the manifest
lists it (docs/format.md, "Segments"); :class:`LogReader` resolves which file is which against a manifest that
did not change while it looked, and finds a segment compressed after that in its ``.zst``.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from ..model import codec
from ..errors import ContextPersistentError, LogCorruptedError, RecordsExpiredError
from .paths import LOG_NAME, create_private_file, fsync_dir, write_all
from .records import data_end

#: The default size at which the active segment is sealed and a new one started (docs/operations.md,
#: "Segments"): large enough that rolls are rare, small enough that a sealed segment is cheap to check,
#: compress or rewrite.
SEGMENT_BYTES = 64 << 20
#: The smallest ``segment_bytes`` allowed (besides 0, never roll): a segment holds at least a few records.
MIN_SEGMENT_BYTES = 4096


def check_segment_bytes(value: object) -> int:
    """``segment_bytes`` validated: an integer, 0 (or None) for "never roll", else at least MIN_SEGMENT_BYTES."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or 0 < value < MIN_SEGMENT_BYTES:
        raise ValueError(f"segment_bytes must be 0 or null (never roll) or an integer of at least "
                         f"{MIN_SEGMENT_BYTES} bytes, got {value!r}")
    return value


MANIFEST_NAME = "segments.json"
MANIFEST_VERSION = 1
SEGMENT_PREFIX = "segment-"
ZST = ".zst"
#: Uncompressed bytes of whole records per zstd frame of a compressed segment (a frame holds at least one).
FRAME_BYTES = 256 << 10
#: A sealed segment's mode: read-only for its owner (it is replaced by rename, never written in place).
SEALED_MODE = 0o400
_NAME_RE = re.compile(r"segment-[0-9]{6,}\.jsonl")
_CRC_RE = re.compile(r"[0-9a-f]{8}")
_SHA_RE = re.compile(r"sha256:[0-9a-f]{64}")
_PENDING_OPS = ("seal", "replace", "remove", "expire")


def segment_name(index: int) -> str:
    """The file name of the ``index``-th sealed segment (1-based)."""
    return f"{SEGMENT_PREFIX}{index:06d}.jsonl"


class ManifestError(LogCorruptedError):
    """``segments.json`` is not a valid manifest (names the file and what is wrong)."""

    def __init__(self, path: Path, reason: str) -> None:
        ContextPersistentError.__init__(
            self, f"{path}: the segment manifest is not valid: {reason}; nothing was loaded (the manifest is "
                  "written only by the store; restore it from a backup)")
        self.path, self.line, self.offset, self.reason = str(path), 0, -1, reason


@dataclass(frozen=True)
class Compressed:
    """A sealed segment stored as zstd frames: the file's size and SHA-256, and where each frame starts
    (``(uncompressed offset in the segment, offset in the file)``, the first is ``(0, 0)``)."""

    size: int
    sha256: str
    frames: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256, "frames": [list(f) for f in self.frames]}


@dataclass(frozen=True)
class Segment:
    """One sealed segment as the manifest records it."""

    name: str
    first_seq: int
    last_seq: int
    first_crc: str
    last_crc: str
    start: int
    end: int
    sha256: str
    compressed: Compressed | None = None

    @property
    def size(self) -> int:
        """Its uncompressed size in bytes."""
        return self.end - self.start

    @property
    def file(self) -> str:
        """The name of the file that holds it."""
        return self.name + ZST if self.compressed is not None else self.name

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "first_seq": self.first_seq, "last_seq": self.last_seq,
                               "first_crc": self.first_crc, "last_crc": self.last_crc, "start": self.start,
                               "end": self.end, "size": self.size, "sha256": self.sha256,
                               "compressed": None if self.compressed is None else self.compressed.to_json()}
        return out


@dataclass(frozen=True)
class Boundary:
    """Where a log begins after its oldest sealed segments expired (segment retention): every record up to
    ``last_seq`` (whose crc is ``last_crc``, the ``prev`` of the first record left) is gone, the first record
    left starts at global position ``start`` (positions stay what they were), ``expired_seq`` is the seq of the
    ``expired`` record that describes them (an open without a checkpoint seeds its state from it: found by its
    seq, since an erasure may move byte positions after the boundary), and ``last_segment`` the number of the
    last expired segment (new segment names continue after it)."""

    last_seq: int
    last_crc: str
    start: int
    expired_seq: int
    last_segment: int

    def to_json(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq, "last_crc": self.last_crc, "start": self.start,
                "expired_seq": self.expired_seq, "last_segment": self.last_segment}


@dataclass(frozen=True)
class Manifest:
    """The sealed segments of a session's log, in order, any step a writer had begun (``pending``), and
    where the log begins when its oldest segments expired (``boundary``; None: at byte 0, seq 1)."""

    session_id: str
    segments: tuple[Segment, ...] = ()
    #: Steps committed but perhaps not all carried out (a writer killed midway); the next writer finishes them.
    pending: tuple[dict[str, str], ...] = ()
    boundary: Boundary | None = None
    _starts: list[int] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._starts.extend(s.start for s in self.segments)

    @property
    def start(self) -> int:
        """The global position where the log's first record that is still there starts."""
        return self.boundary.start if self.boundary is not None else 0

    @property
    def base(self) -> int:
        """The global position where the active segment starts."""
        return self.segments[-1].end if self.segments else self.start

    def index_at(self, position: int) -> int:
        """The index of the sealed segment holding byte ``position`` (``start <= position < end``), else -1."""
        i = bisect.bisect_right(self._starts, position) - 1
        return i if i >= 0 and position < self.segments[i].end else -1

    def next_name(self) -> str:
        """The name of the next sealed segment: one past the highest number in use (never a reused name)."""
        last = max((int(s.name[len(SEGMENT_PREFIX):].split(".")[0]) for s in self.segments),
                   default=self.boundary.last_segment if self.boundary is not None else 0)
        return segment_name(last + 1)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {"manifest": MANIFEST_VERSION, "session_id": self.session_id,
                               "segments": [s.to_json() for s in self.segments], "pending": list(self.pending)}
        if self.boundary is not None:  # (absent otherwise: a manifest without expiry is unchanged)
            doc["boundary"] = self.boundary.to_json()
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"

    def with_segments(self, segments: tuple[Segment, ...], pending: tuple[dict[str, str], ...] = ()) -> Manifest:
        return Manifest(self.session_id, segments, pending, self.boundary)

    def with_boundary(self, boundary: Boundary, segments: tuple[Segment, ...],
                      pending: tuple[dict[str, str], ...] = ()) -> Manifest:
        return Manifest(self.session_id, segments, pending, boundary)


# -- parsing (pure) --------------------------------------------------------------------------------------
def _int(d: dict[str, Any], key: str, where: str, path: Path) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ManifestError(path, f"{where}: {key!r} must be an integer >= 0, got {v!r}")
    return v


def _str(d: dict[str, Any], key: str, where: str, path: Path, pattern: re.Pattern[str]) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise ManifestError(path, f"{where}: {key!r} must match {pattern.pattern}, got {v!r}")
    return v


def parse_manifest(data: bytes, path: Path, session_id: str) -> Manifest:
    """The manifest in ``data``; ManifestError names what is wrong (nothing is guessed or skipped)."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ManifestError(path, f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("manifest") != MANIFEST_VERSION:
        raise ManifestError(path, f"expected a JSON object with \"manifest\": {MANIFEST_VERSION}")
    if doc.get("session_id") != session_id:
        raise ManifestError(path, f"it names session {doc.get('session_id')!r}, not {session_id!r} (a copied "
                                  "or renamed folder?)")
    raw_segments = doc.get("segments")
    raw_pending = doc.get("pending", [])
    if not isinstance(raw_segments, list) or not isinstance(raw_pending, list):
        raise ManifestError(path, "\"segments\" and \"pending\" must be lists")
    boundary = _boundary(doc.get("boundary"), path)
    segments: list[Segment] = []
    names: set[str] = set()
    for i, s in enumerate(raw_segments):
        where = f"segment {i + 1}"
        if not isinstance(s, dict):
            raise ManifestError(path, f"{where} is not an object")
        name = _str(s, "name", where, path, _NAME_RE)
        start, end = _int(s, "start", where, path), _int(s, "end", where, path)
        first_seq, last_seq = _int(s, "first_seq", where, path), _int(s, "last_seq", where, path)
        expected_start = segments[-1].end if segments else (boundary.start if boundary is not None else 0)
        if start != expected_start or end <= start:
            raise ManifestError(path, f"{where} ({name}) covers bytes {start}..{end}; it must start at "
                                      f"{expected_start}" + (" (the recorded boundary)" if boundary and not segments
                                                             else "") + " and not be empty")
        if boundary is not None and not segments and first_seq != boundary.last_seq + 1:
            raise ManifestError(path, f"{where} ({name}) begins at seq {first_seq}; after the recorded boundary "
                                      f"(seq {boundary.last_seq}) it must begin at {boundary.last_seq + 1}")
        if first_seq < 1 or last_seq < first_seq or (segments and first_seq <= segments[-1].last_seq):
            raise ManifestError(path, f"{where} ({name}) holds seqs {first_seq}..{last_seq}, which do not "
                                      "follow the segment before it")
        if name in names:
            raise ManifestError(path, f"{where}: the name {name} is listed twice")
        names.add(name)
        comp = s.get("compressed")
        compressed = None
        if comp is not None:
            if not isinstance(comp, dict) or not isinstance(comp.get("frames"), list) or not comp["frames"]:
                raise ManifestError(path, f"{where}: \"compressed\" must be null or an object with a non-empty "
                                          "\"frames\" list")
            frames: list[tuple[int, int]] = []
            for f in comp["frames"]:
                if (not isinstance(f, list) or len(f) != 2 or not all(type(x) is int for x in f)
                        or (frames and (f[0] <= frames[-1][0] or f[1] <= frames[-1][1]))
                        or (not frames and f != [0, 0]) or f[0] >= end - start):
                    raise ManifestError(path, f"{where}: frame {f!r} is not a pair of increasing offsets "
                                              "starting at [0, 0] inside the segment")
                frames.append((f[0], f[1]))
            csize = _int(comp, "size", where, path)
            if csize <= frames[-1][1]:
                raise ManifestError(path, f"{where}: the compressed size {csize} ends before its last frame")
            compressed = Compressed(csize, _str(comp, "sha256", where, path, _SHA_RE), tuple(frames))
        segments.append(Segment(name, first_seq, last_seq, _str(s, "first_crc", where, path, _CRC_RE),
                                _str(s, "last_crc", where, path, _CRC_RE), start, end,
                                _str(s, "sha256", where, path, _SHA_RE), compressed))
    pending: list[dict[str, str]] = []
    for p in raw_pending:
        if (not isinstance(p, dict) or p.get("op") not in _PENDING_OPS
                or not all(isinstance(v, str) and "/" not in v and v not in ("", ".", "..") for v in p.values())):
            raise ManifestError(path, f"pending step {p!r} is not one of {', '.join(_PENDING_OPS)} with file names")
        pending.append({str(k): str(v) for k, v in p.items()})
    return Manifest(session_id, tuple(segments), tuple(pending), boundary)


def _boundary(raw: Any, path: Path) -> Boundary | None:
    """The ``boundary`` of a manifest (None when absent: the log begins at byte 0)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ManifestError(path, "\"boundary\" must be null or an object")
    where = "the boundary"
    b = Boundary(_int(raw, "last_seq", where, path), _str(raw, "last_crc", where, path, _CRC_RE),
                 _int(raw, "start", where, path), _int(raw, "expired_seq", where, path),
                 _int(raw, "last_segment", where, path))
    if b.last_seq < 1 or b.start < 1 or b.expired_seq <= b.last_seq or b.last_segment < 1:
        raise ManifestError(path, f"the boundary {raw!r} must name seqs >= 1 with expired_seq after last_seq, "
                                  "a start > 0 and a last_segment >= 1")
    return b


# -- manifest I/O ----------------------------------------------------------------------------------------
def load_manifest(directory: Path, session_id: str) -> Manifest | None:
    """The manifest of the session folder ``directory``, or None for a single-file log (no manifest)."""
    data = _manifest_bytes(directory)
    return None if data is None else parse_manifest(data, directory / MANIFEST_NAME, session_id)


def _manifest_bytes(directory: Path) -> bytes | None:
    """The manifest file's bytes as they are now, or None when there is none."""
    try:
        with open(directory / MANIFEST_NAME, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest atomically: a temp file, fsync, rename, folder fsync."""
    tmp = MANIFEST_NAME + ".tmp"
    fd = create_private_file(directory, tmp)
    try:
        write_all(fd, manifest.to_bytes())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(directory / tmp, directory / MANIFEST_NAME)
    fsync_dir(directory)


def sha256_hex(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- compression (zstandard, imported lazily) ------------------------------------------------------------
def frame_chunks(data: bytes | memoryview, frame_bytes: int = FRAME_BYTES) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each frame's uncompressed bytes: whole lines, about ``frame_bytes`` each."""
    view = bytes(data) if isinstance(data, memoryview) else data
    start = 0
    n = len(view)
    while start < n:
        cut = start + frame_bytes
        if cut >= n:
            end = n
        else:
            nl = view.rfind(b"\n", start, cut)
            end = nl + 1 if nl >= start else view.find(b"\n", cut) + 1 or n
        yield start, end
        start = end


def compress(data: bytes, level: int = 3) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """``data`` (whole records) as concatenated zstd frames, and the frame index."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    out = bytearray()
    frames: list[tuple[int, int]] = []
    for start, end in frame_chunks(data):
        frames.append((start, len(out)))
        out += cctx.compress(data[start:end])
    return bytes(out), tuple(frames)


def decompress_frame(frame: bytes, size: int) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)


def decompress_all(data: bytes) -> bytes:
    """Every frame of ``data`` (as ``zstdcat`` reads it)."""
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)


# -- reading ---------------------------------------------------------------------------------------------
class SegmentFile:
    """Read access to one sealed segment's uncompressed bytes by offset inside the segment."""

    def __init__(self, directory: Path, seg: Segment, fd: int) -> None:
        self.seg = seg
        self.fd = fd
        self.directory = directory
        self._frame_starts = [u for u, _ in seg.compressed.frames] if seg.compressed else []
        self._cached: tuple[int, bytes] | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.seg.file

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def drop_cache(self) -> None:
        """Forget the frame kept for nearby reads (a reader done with this segment)."""
        self._cached = None

    def frame(self, i: int) -> bytes:
        """The uncompressed bytes of frame ``i`` (compressed segments)."""
        if self._cached is not None and self._cached[0] == i:
            return self._cached[1]
        comp = self.seg.compressed
        assert comp is not None
        frames = comp.frames
        c0 = frames[i][1]
        c1 = frames[i + 1][1] if i + 1 < len(frames) else comp.size
        u1 = frames[i + 1][0] if i + 1 < len(frames) else self.seg.size
        raw = os.pread(self.fd, c1 - c0, c0)
        try:
            data = decompress_frame(raw, u1 - frames[i][0])
        except Exception as e:  # zstandard.ZstdError: a damaged frame
            raise LogCorruptedError(str(self.path), 0, c0, f"zstd frame {i} cannot be decompressed ({e}); "
                                                           "`context-persistent verify` checks every segment") from None
        if len(data) != u1 - frames[i][0]:
            raise LogCorruptedError(str(self.path), 0, c0, f"zstd frame {i} holds {len(data)} bytes, the "
                                                           f"manifest says {u1 - frames[i][0]}")
        self._cached = (i, data)
        return data

    def chunks(self, offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """``(segment offset, bytes)`` pieces of the segment from ``offset`` to its end."""
        size = self.seg.size
        if self.seg.compressed is None:
            pos = offset
            while pos < size:
                data = os.pread(self.fd, min(1 << 20, size - pos), pos)
                if not data:
                    raise LogCorruptedError(str(self.path), 0, pos, f"the file ends at byte {pos}; the manifest "
                                                                    f"says it holds {size}")
                yield pos, data
                pos += len(data)
            return
        i = max(0, bisect.bisect_right(self._frame_starts, offset) - 1)
        for j in range(i, len(self._frame_starts)):
            data = self.frame(j)
            u0 = self._frame_starts[j]
            if j == i and offset > u0:
                yield offset, data[offset - u0:]
            else:
                yield u0, data

    def line_at(self, offset: int) -> bytes:
        """The line (with its newline) that starts at segment offset ``offset``."""
        if self.seg.compressed is None:  # a few KiB at a time: most records are small
            want = 4096
            while True:
                data = os.pread(self.fd, min(want, self.seg.size - offset), offset)
                nl = data.find(b"\n")
                if nl >= 0 or len(data) < want:
                    return data[:nl + 1] if nl >= 0 else data
                want *= 16
        out = bytearray()
        for _, data in self.chunks(offset):
            nl = data.find(b"\n")
            if nl >= 0:
                out += data[:nl + 1]
                return bytes(out)
            out += data
        return bytes(out)

    def line_ending_at(self, offset: int) -> bytes:
        """The line that ends exactly at segment offset ``offset`` (``offset`` follows a newline)."""
        if self.seg.compressed is not None:
            i = max(0, bisect.bisect_right(self._frame_starts, offset - 1) - 1)
            data = self.frame(i)[: offset - self._frame_starts[i]]
            start = data.rfind(b"\n", 0, len(data) - 1) + 1
            return data[start:]  # (frames hold whole lines: the line starts inside this frame)
        back = 0
        while True:
            back = min(offset, max(back * 16, 4096))
            chunk = os.pread(self.fd, back, offset - back)
            start = chunk.rfind(b"\n", 0, len(chunk) - 1) + 1
            if start > 0 or back == offset:
                return chunk[start:]


#: Below this many bytes :meth:`LogReader.find_seq` reads line by line instead of bisecting further.
_BISECT_BYTES = 1 << 20
#: How many times a reader looks again when a roll replaced a file between two of its looks.
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
                if attempt == _ATTEMPTS - 1:
                    raise

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


__all__ = ["Boundary", "Compressed", "LogReader", "MANIFEST_NAME", "Manifest", "ManifestError", "Segment", "load_manifest",
           "read_line_at", "segment_name"]
