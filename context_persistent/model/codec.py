"""Record framing: one self-checking JSON line per event (pure).

A record is the orjson encoding of ``{"v", "seq", "prev", "ts", "type", "data"}`` with a CRC-32 of those
bytes appended as a last key:
``{"v":2,"seq":7,"prev":"01234567","ts":"…","type":"message_added","data":{…},"crc":"89abcdef"}``.
The checksum covers every byte of the record before ``,"crc"`` plus the closing brace, so it is verified
without re-serialising anything: take the line, cut the fixed-size tail, CRC the rest.

``prev`` binds the record to its log: it is the ``crc`` of the record before it, and for a session's first
record the CRC-32 of its session id (:func:`root_crc`). A record spliced in from another log, or records
removed or reordered, break that chain (:class:`Links`); version 1 records (no ``prev``) are upcast with
``prev: None`` and are not checked, up to the first chained record.
"""

from __future__ import annotations

import math
import re
import secrets
import time
import zlib
from datetime import datetime, timezone
from typing import Any

import orjson

from ..errors import FOREIGN_LOG, UnsupportedFormatError
from . import json_lossless

#: Major format version written into every record; a reader refuses a newer one. Version 2 added ``prev``.
FORMAT_VERSION = 2

_CRC_KEY = b',"crc":"'
#: How every record starts; orjson escapes quotes inside strings, so this never occurs inside a record.
RECORD_START = b'{"v":'
_TAIL = len(_CRC_KEY) + 8 + 2  # ,"crc":"xxxxxxxx"}
_crc32 = zlib.crc32
_loads = orjson.loads
_OPTS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


class RecordError(ValueError):
    """A line is not a valid record; ``reason`` says why."""


def _refuse(obj: Any) -> Any:
    raise TypeError(f"{type(obj).__name__} is not JSON (allowed: dict, list, str, int, float, bool, None)")


def dumps(value: Any) -> bytes:
    """Encode a JSON value strictly: only JSON types, no NaN/Infinity, str keys (raises ValueError).

    A lone surrogate in a string (``os.fsdecode`` of a non-UTF-8 file name) is written as its ``\\uXXXX``
    escape and read back unchanged (model/json_lossless.py); the common path is orjson alone."""
    try:
        out = orjson.dumps(value, default=_refuse, option=_OPTS)
    except (TypeError, orjson.JSONEncodeError) as e:
        if "surrogates" not in str(e):
            raise ValueError(f"not JSON-serialisable: {e}") from None
        try:
            out = json_lossless.dumps(value, option=_OPTS, default=_refuse)
        except (TypeError, orjson.JSONEncodeError) as e2:
            raise ValueError(f"not JSON-serialisable: {e2}") from None
    # orjson writes NaN and Infinity as null. ``find``, not ``in``: in CPython 3.11 ``bytes in bytes`` first
    # tries the needle as an integer and builds (then drops) a TypeError on every call.
    if out.find(b"null") >= 0 and _has_non_finite(value):
        raise ValueError("not JSON-serialisable: NaN and Infinity are not valid JSON numbers")
    return out


def dumps_stored(value: Any) -> bytes:
    """:func:`dumps` of a value equal to data the store already holds (checked when it was stored: no NaN or
    infinity, no nesting too deep), without looking for them again: the same bytes. Raises as orjson does
    (a lone surrogate, a subclass): the caller then takes :func:`dumps`'s path."""
    return orjson.dumps(value, default=_refuse, option=_OPTS)


#: The deepest nesting ``orjson.dumps`` accepts: 254 containers (255 raises "Recursion limit reached").
ORJSON_MAX_DEPTH = 254
#: The deepest the store ever wraps a message when it serialises it: two containers (a checkpoint's
#: ``{"messages": [...]}`` sections, a JSON export's ``{"header", "messages": [...]}``, a record printed as
#: JSON with its ``data``).
WRAP_DEPTH = 2
#: The deepest message (containers, the message dict itself counting as one) the store accepts: what orjson
#: can write inside the deepest wrapping, less 12 levels of margin. A deeper message would be written to the
#: log and then fail every checkpoint and JSON export, so it is refused up front with a ValueError.
MAX_DEPTH = ORJSON_MAX_DEPTH - WRAP_DEPTH - 12


def depth_error(limit: int = MAX_DEPTH) -> str:
    return (f"nested more than {limit} levels deep (dicts and lists, the message itself counting as one); the "
            f"store accepts at most {limit}, so that every checkpoint and export can carry it")


def check_depth(value: Any, encoded: bytes, limit: int = MAX_DEPTH) -> None:
    """Raise ValueError if ``value`` nests more than ``limit`` containers (dicts and lists).

    ``encoded`` is its JSON: each container opens and closes with a bracket, so JSON shorter than ``2 * limit``
    bytes, or with fewer opening brackets than ``limit``, cannot be too deep (the hot path: a length check for
    most messages, two byte counts for long ones); only the rest is walked.
    """
    if len(encoded) <= 2 * limit or encoded.count(b"[") + encoded.count(b"{") <= limit:
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is dict or t is list:
            if depth > limit:
                raise ValueError(depth_error(limit))
            stack.extend((x, depth + 1) for x in (v.values() if t is dict else v))


#: Types that hold no float: skipped without a call (a record's data is mostly these, and its ``null``s send
#: every ``dumps`` of it through this walk).
_NO_FLOAT = frozenset({str, int, bool, type(None)})


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return False
    for v in items:
        if type(v) not in _NO_FLOAT and _has_non_finite(v):
            return True
    return False


_second: tuple[int, str] = (-1, "")  # (unix second, its "YYYY-MM-DDTHH:MM:SS" text), replaced atomically


def now_iso() -> str:
    """A timezone-aware UTC timestamp with microseconds (``2024-05-01T12:00:00.123456+00:00``).

    On every append: the date part is formatted once per second (2.5x faster than ``datetime.isoformat``).
    """
    global _second
    sec, ns = divmod(time.time_ns(), 1_000_000_000)
    cached, text = _second
    if sec != cached:
        text = datetime.fromtimestamp(sec, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        _second = (sec, text)
    return "%s.%06d+00:00" % (text, ns // 1000)


def root_crc(session_id: str) -> bytes:
    """The ``prev`` of a session's first record: the CRC-32 of ``session:<id>`` (binds the log to its id)."""
    return b"%08x" % zlib.crc32(b"session:" + session_id.encode())


def crc_of(line: bytes) -> bytes:
    """The ``crc`` of an encoded record line (with its newline): the next record's ``prev``."""
    return line[-11:-3]


#: Records that hold messages, which an erasure may replace by a tombstone keeping their CRC (the next record's
#: ``prev`` names it): each gets a random ``salt`` so that the CRC tells nothing about the erased bytes.
SALTED = frozenset({"message_added", "messages_replaced", "system_prompt_set", "expired"})
SALT_CHARS = 48
_SALT_BYTES = [format(b, "08b").encode().translate(bytes.maketrans(b"01", b"ac")) for b in range(256)]


def salt() -> bytes:
    """48 random characters, each ``a`` or ``c``: 48 random bits that CRC-32, affine over GF(2), spreads over all
    its 2**32 values (the same positions solve any CRC in the tombstone's pad), so a record's CRC is uniformly
    random whatever its other bytes are: erased, it confirms no guess of them (docs/format.md, "Erasure
    tombstones")."""
    return b"".join([_SALT_BYTES[b] for b in secrets.token_bytes(SALT_CHARS // 8)])


def encode(seq: int, type_: str, data_json: bytes, ts: str | None = None, prev: bytes = b"") -> bytes:
    """One record line (with its trailing newline) from already-encoded ``data`` JSON bytes.

    ``prev``: the ``crc`` of the record before it (:func:`crc_of`), or :func:`root_crc` for seq 1. A record
    holding messages (``SALTED``) ends with a random ``salt`` (:func:`salt`)."""
    body = b'{"v":%d,"seq":%d,"prev":"%s","ts":"%s","type":"%s","data":%s' % (
        FORMAT_VERSION, seq, prev, (ts or now_iso()).encode(), type_.encode(), data_json,
    )
    if type_ in SALTED:
        body += b',"salt":"%s"' % salt()
    crc = zlib.crc32(b"}", zlib.crc32(body))
    return b'%s,"crc":"%08x"}\n' % (body, crc)


def encode_event(seq: int, type_: str, data: dict[str, Any], ts: str | None = None, prev: bytes = b"") -> bytes:
    return encode(seq, type_, dumps(data), ts, prev)


def encode_chain(records: Any, prev: bytes) -> list[bytes]:
    """Encode ``(seq, type, data, ts)`` tuples as consecutive records, the first one after ``prev``."""
    out = []
    for seq, type_, data, ts in records:
        line = encode_event(seq, type_, data, ts, prev)
        out.append(line)
        prev = crc_of(line)
    return out


def decode(line: bytes | memoryview) -> dict[str, Any]:
    """Verify and parse one record line (with or without its newline); raises RecordError."""
    # The hot path of every replay: no copies of the line, no temporary objects we can avoid.
    if type(line) is not bytes:
        line = bytes(line)
    n = len(line)
    if line.endswith(b"\n"):
        n -= 1
    body = n - _TAIL
    if body < 2 or not line.startswith(_CRC_KEY, body) or not line.startswith(b'"}', n - 2):
        raise RecordError("no checksum field at the end of the record (torn or not a record)")
    got = _crc32(b"}", _crc32(line[:body]))
    stored = line[n - 10 : n - 2]
    if stored != b"%08x" % got:
        raise RecordError(f"checksum mismatch (stored {stored.decode('ascii', 'replace')}, computed {got:08x})")
    try:
        rec = _loads(line)  # a trailing newline is JSON whitespace
    except orjson.JSONDecodeError as e:
        try:
            rec = json_lossless.loads(line)  # (a lone surrogate's escape: orjson refuses it, JSON allows it)
        except orjson.JSONDecodeError:
            raise RecordError(f"checksum matches but JSON is invalid: {e}") from None
    if type(rec) is not dict or not isinstance(rec.get("seq"), int) or not isinstance(rec.get("type"), str):
        raise RecordError("record lacks an integer 'seq' or a string 'type'")
    if rec.get("v") != FORMAT_VERSION:
        rec = upcast(rec)
    elif type(rec.get("prev")) is not str:
        raise RecordError("a version 2 record lacks its 'prev' link")
    return rec


_SEQ_PREFIX = re.compile(rb'\{"v":[0-9]{1,4},"seq":([0-9]{1,20}),')


def checked_seq(line: bytes) -> tuple[int, bytes]:
    """``(seq, crc)`` of a record line whose checksum is verified, without parsing its JSON (sealing a
    segment: every byte is covered by the checksum; the records were parsed when written or replayed).
    Falls back to :func:`decode` for a line that does not start as this program writes records. Raises
    RecordError."""
    n = len(line) - 1 if line.endswith(b"\n") else len(line)
    body = n - _TAIL
    if body < 2 or not line.startswith(_CRC_KEY, body) or not line.startswith(b'"}', n - 2):
        raise RecordError("no checksum field at the end of the record (torn or not a record)")
    stored = line[n - 10 : n - 2]
    if stored != b"%08x" % _crc32(b"}", _crc32(line[:body])):
        raise RecordError(f"checksum mismatch (stored {stored.decode('ascii', 'replace')})")
    m = _SEQ_PREFIX.match(line)
    if m is None:
        rec = decode(line)
        return rec["seq"], str(rec["crc"]).encode()
    return int(m.group(1)), stored


def _v1_to_v2(rec: dict[str, Any]) -> dict[str, Any]:
    """Version 1 records were not chained: ``prev`` is None (:class:`Links` does not check them)."""
    rec["v"] = 2
    rec["prev"] = None
    return rec


#: Named upcasters: ``{from_version: function(record) -> record of from_version + 1}``. Old records are
#: upgraded as they are read, never by rewriting the file.
UPCASTERS: dict[int, Any] = {1: _v1_to_v2}


class Links:
    """Checks that each record names the one before it (``prev``), from a session's first record on.

    ``last``: the crc of the record before the first one checked (None: checking from the log's start, where
    the first record must name :func:`root_crc`). ``chained``: whether a chained (version 2) record came
    already; after one, an unchained record is a break too (old records spliced in).
    """

    __slots__ = ("root", "last", "chained")

    def __init__(self, session_id: str, last: str | None = None, chained: bool = False) -> None:
        self.root = root_crc(session_id).decode()
        self.last = last
        self.chained = chained

    def check(self, rec: dict[str, Any]) -> str | None:
        """Why ``rec`` does not follow the last record checked (None: it does); then it becomes the last."""
        prev = rec.get("prev")
        last = self.last
        problem = None
        if prev is None:
            if self.chained:
                problem = ("is an unchained (version 1) record after chained ones: it was not appended to this "
                           "log (records from an older log spliced in)")
        else:
            if last is None and prev != self.root:
                if rec.get("seq", 1) > 1:
                    problem = (f"is the log's first record but names crc {prev} as its predecessor: the records "
                               "before it are missing")
                else:
                    problem = (f"names {prev} as its predecessor instead of this session's root {self.root}: it "
                               f"{FOREIGN_LOG}")
            elif last is not None and prev != last:
                problem = (f"names crc {prev} as its predecessor, but the record before it has crc {last}: it "
                           "was not appended after that record (a record from another log, or records removed "
                           "or reordered)")
            self.chained = True
        self.last = rec.get("crc")
        return problem


def upcast(rec: dict[str, Any]) -> dict[str, Any]:
    v = rec.get("v")
    if not isinstance(v, int) or v < 1:
        raise RecordError(f"record has no valid format version 'v' (got {v!r})")
    if v > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"record seq {rec.get('seq')} has format version {v}, newer than this program's "
            f"{FORMAT_VERSION}: upgrade context-persistent to read this log"
        )
    while v < FORMAT_VERSION:
        upcaster = UPCASTERS.get(v)
        if upcaster is None:
            raise UnsupportedFormatError(
                f"record seq {rec.get('seq')} has format version {v} and no upcaster from version {v} to "
                f"{v + 1} is registered (codec.UPCASTERS); this program reads versions up to {FORMAT_VERSION}"
            )
        rec = upcaster(rec)
        if not isinstance(rec, dict) or rec.get("v") != v + 1:
            raise UnsupportedFormatError(f"the upcaster from format version {v} did not return a version {v + 1} record")
        v += 1
    return rec


def split_records(chunk: bytes) -> list[tuple[int, bytes, dict[str, Any] | None, str]]:
    """Split a line that failed verification into ``(offset, bytes, record or None, reason)`` pieces.

    A flipped or lost newline merges records into one line; every complete record inside it is still
    valid and is returned as such (``record`` set), the rest as bad pieces (``record`` None, ``reason``).
    Adjacent bad pieces are merged. ``chunk`` is one line without its newline. Raises
    UnsupportedFormatError for a valid record of a newer format.
    """
    starts = [0] + [m.start() for m in re.finditer(re.escape(RECORD_START), chunk) if m.start() > 0]
    pieces: list[tuple[int, bytes, dict[str, Any] | None, str]] = []
    for a, b in zip(starts, starts[1:] + [len(chunk)]):
        seg = chunk[a:b]
        try:
            pieces.append((a, seg, decode(seg), ""))
        except RecordError as e:
            if pieces and pieces[-1][2] is None:
                pa, pseg, _, preason = pieces[-1]
                pieces[-1] = (pa, pseg + seg, None, preason)
            else:
                pieces.append((a, seg, None, str(e)))
    return pieces
