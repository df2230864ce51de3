"""The segment manifest (``segments.json``): the sealed segments of a session's log, parsed and checked
(pure: nothing is guessed or skipped) and written atomically.

A session's log is a sequence of segments. The *active* segment is ``events.jsonl``, appended to exactly like
a single-file log; *sealed* segments (``segment-NNNNNN.jsonl``, or ``.jsonl.zst`` when compressed) are
earlier, immutable parts of the log listed in the manifest with their seq range, crc range, byte range and
SHA-256. A log without a manifest is a single-file log: a log with no sealed segments.

Positions are global: the byte offset as if the uncompressed contents of every segment, then the active one,
were one file. A sealed segment covers ``[start, end)``; the active segment starts at the last one's ``end``
(``Manifest.base``). Reading across segments is segments.py (:class:`~context_persistent.storage.segments.LogReader`);
a sealed file's zstd frames are segment_file.py; the steps that change the manifest are segment_store.py.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import orjson

from ..errors import ContextPersistentError, LogCorruptedError
from ..model.values import Frozen, set_field as _set
from .paths import create_private_file, fsync_dir, write_all

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


class Compressed(Frozen):
    """A sealed segment stored as zstd frames: the file's size and SHA-256, and where each frame starts
    (``(uncompressed offset in the segment, offset in the file)``, the first is ``(0, 0)``)."""

    __slots__ = ("size", "sha256", "frames")
    size: int
    sha256: str
    frames: tuple[tuple[int, int], ...]

    def __init__(self, size: int, sha256: str, frames: tuple[tuple[int, int], ...]) -> None:
        _set(self, "size", size)
        _set(self, "sha256", sha256)
        _set(self, "frames", frames)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256, "frames": [list(f) for f in self.frames]}


class Segment(Frozen):
    """One sealed segment as the manifest records it."""

    __slots__ = ("name", "first_seq", "last_seq", "first_crc", "last_crc", "start", "end", "sha256", "compressed")
    name: str
    first_seq: int
    last_seq: int
    first_crc: str
    last_crc: str
    start: int
    end: int
    sha256: str
    compressed: Compressed | None

    def __init__(self, name: str, first_seq: int, last_seq: int, first_crc: str, last_crc: str, start: int, end: int,
                 sha256: str, compressed: Compressed | None = None) -> None:
        _set(self, "name", name)
        _set(self, "first_seq", first_seq)
        _set(self, "last_seq", last_seq)
        _set(self, "first_crc", first_crc)
        _set(self, "last_crc", last_crc)
        _set(self, "start", start)
        _set(self, "end", end)
        _set(self, "sha256", sha256)
        _set(self, "compressed", compressed)

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


class Boundary(Frozen):
    """Where a log begins after its oldest sealed segments expired (segment retention): every record up to
    ``last_seq`` (whose crc is ``last_crc``, the ``prev`` of the first record left) is gone, the first record
    left starts at global position ``start`` (positions stay what they were), ``expired_seq`` is the seq of the
    ``expired`` record that describes them (an open without a checkpoint seeds its state from it: found by its
    seq, since an erasure may move byte positions after the boundary), and ``last_segment`` the number of the
    last expired segment (new segment names continue after it)."""

    __slots__ = ("last_seq", "last_crc", "start", "expired_seq", "last_segment")
    last_seq: int
    last_crc: str
    start: int
    expired_seq: int
    last_segment: int

    def __init__(self, last_seq: int, last_crc: str, start: int, expired_seq: int, last_segment: int) -> None:
        _set(self, "last_seq", last_seq)
        _set(self, "last_crc", last_crc)
        _set(self, "start", start)
        _set(self, "expired_seq", expired_seq)
        _set(self, "last_segment", last_segment)

    def to_json(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq, "last_crc": self.last_crc, "start": self.start,
                "expired_seq": self.expired_seq, "last_segment": self.last_segment}


class Manifest(Frozen):
    """The sealed segments of a session's log, in order, any step a writer had begun (``pending``), and
    where the log begins when its oldest segments expired (``boundary``; None: at byte 0, seq 1)."""

    __slots__ = ("session_id", "segments", "pending", "boundary", "_starts")
    session_id: str
    segments: tuple[Segment, ...]
    #: Steps committed but perhaps not all carried out (a writer killed midway); the next writer finishes them.
    pending: tuple[dict[str, str], ...]
    boundary: Boundary | None
    _starts: list[int]  # (not compared or printed: derived from the segments)

    def __init__(self, session_id: str, segments: tuple[Segment, ...] = (), pending: tuple[dict[str, str], ...] = (),
                 boundary: Boundary | None = None) -> None:
        _set(self, "session_id", session_id)
        _set(self, "segments", segments)
        _set(self, "pending", pending)
        _set(self, "boundary", boundary)
        _set(self, "_starts", [s.start for s in segments])

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


__all__ = ["Boundary", "Compressed", "MANIFEST_NAME", "MIN_SEGMENT_BYTES", "Manifest", "ManifestError", "SEALED_MODE",
           "SEGMENT_BYTES", "SEGMENT_PREFIX", "Segment", "ZST", "check_segment_bytes", "load_manifest",
           "parse_manifest", "segment_name", "sha256_hex", "write_manifest"]
