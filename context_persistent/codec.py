"""Record framing: one self-checking JSON line per event (pure).

A record is the orjson encoding of ``{"v", "seq", "ts", "type", "data"}`` with a CRC-32 of those bytes
appended as a last key: ``{"v":1,"seq":7,"ts":"…","type":"message_added","data":{…},"crc":"89abcdef"}``.
The checksum covers every byte of the record before ``,"crc"`` plus the closing brace, so it is verified
without re-serialising anything: take the line, cut the fixed-size tail, CRC the rest.
"""

from __future__ import annotations

import math
import zlib
from datetime import datetime, timezone
from typing import Any

import orjson

from .errors import UnsupportedFormatError

#: Major format version written into every record; a reader refuses a newer one.
FORMAT_VERSION = 1

_CRC_KEY = b',"crc":"'
_TAIL = len(_CRC_KEY) + 8 + 2  # ,"crc":"xxxxxxxx"}
_OPTS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS


class RecordError(ValueError):
    """A line is not a valid record; ``reason`` says why."""


def _refuse(obj: Any) -> Any:
    raise TypeError(f"{type(obj).__name__} is not JSON (allowed: dict, list, str, int, float, bool, None)")


def dumps(value: Any) -> bytes:
    """Encode a JSON value strictly: only JSON types, no NaN/Infinity, str keys (raises ValueError)."""
    try:
        out = orjson.dumps(value, default=_refuse, option=_OPTS)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise ValueError(f"not JSON-serialisable: {e}") from None
    if b"null" in out and _has_non_finite(value):
        raise ValueError("not JSON-serialisable: NaN and Infinity are not valid JSON numbers")
    return out


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_non_finite(v) for v in value)
    return False


def now_iso() -> str:
    """A timezone-aware UTC timestamp with microseconds."""
    return datetime.now(timezone.utc).isoformat()


def encode(seq: int, type_: str, data_json: bytes, ts: str | None = None) -> bytes:
    """One record line (with its trailing newline) from already-encoded ``data`` JSON bytes."""
    body = b'{"v":%d,"seq":%d,"ts":"%s","type":"%s","data":%s' % (
        FORMAT_VERSION, seq, (ts or now_iso()).encode(), type_.encode(), data_json,
    )
    crc = zlib.crc32(b"}", zlib.crc32(body))
    return b'%s,"crc":"%08x"}\n' % (body, crc)


def encode_event(seq: int, type_: str, data: dict[str, Any], ts: str | None = None) -> bytes:
    return encode(seq, type_, dumps(data), ts)


def decode(line: bytes | memoryview) -> dict[str, Any]:
    """Verify and parse one record line (with or without its newline); raises RecordError."""
    if line[-1:] == b"\n":
        line = line[:-1]
    n = len(line)
    if n < _TAIL + 2 or line[n - _TAIL : n - _TAIL + len(_CRC_KEY)] != _CRC_KEY or line[n - 2 :] != b'"}':
        raise RecordError("no checksum field at the end of the record (torn or not a record)")
    got = zlib.crc32(b"}", zlib.crc32(memoryview(line)[: n - _TAIL]))
    stored = bytes(line[n - 10 : n - 2])
    if stored != b"%08x" % got:
        raise RecordError(f"checksum mismatch (stored {stored.decode('ascii', 'replace')}, computed {got:08x})")
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise RecordError(f"checksum matches but JSON is invalid: {e}") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("seq"), int) or not isinstance(rec.get("type"), str):
        raise RecordError("record lacks an integer 'seq' or a string 'type'")
    v = rec.get("v")
    if v != FORMAT_VERSION:
        rec = upcast(rec)
    return rec


#: Named upcasters: ``{from_version: function(record) -> record of from_version + 1}``. Old records are
#: upgraded as they are read, never by rewriting the file.
UPCASTERS: dict[int, Any] = {}


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
        rec = UPCASTERS[v](rec)
        v = rec["v"]
    return rec
