"""Record framing: checksums, strict JSON, versions (pure, no event loop)."""

from __future__ import annotations

import datetime as dt
import zlib

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from context_persistent.model import codec
from context_persistent.errors import UnsupportedFormatError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(seq=st.integers(1, 2**40), data=st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_decode_encode_round_trip(seq: int, data: dict) -> None:
    """decode(encode(e)) gives back the same seq, type and data."""
    line = codec.encode_event(seq, "message_added", data)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    rec = codec.decode(line)
    assert (rec["seq"], rec["type"], rec["data"], rec["v"]) == (seq, "message_added", data, codec.FORMAT_VERSION)


def test_checksum_covers_every_byte() -> None:
    """Flipping any single bit of a record makes decode fail."""
    line = codec.encode_event(3, "message_added", {"message": {"role": "user", "content": "héllo"}})
    for i in range(len(line) - 1):
        for bit in (0x01, 0x20):
            bad = bytearray(line)
            bad[i] ^= bit
            with pytest.raises(codec.RecordError):
                codec.decode(bytes(bad))


def test_truncated_record_is_rejected() -> None:
    """Every proper prefix of a record is rejected (a torn write is never accepted)."""
    line = codec.encode_event(9, "cleared", {})
    for cut in range(len(line) - 1):
        with pytest.raises(codec.RecordError):
            codec.decode(line[:cut])


@pytest.mark.parametrize("value, why", [
    ({"x": float("nan")}, "NaN"),
    ({"x": [float("inf")]}, "NaN and Infinity"),
    ({"x": dt.datetime(2026, 1, 1)}, "datetime"),
    ({1: "non-str key"}, "not JSON"),
    ({"x": {1, 2}}, "set"),
    ({"x": 2**64}, "not JSON"),
])
def test_dumps_is_strict(value: object, why: str) -> None:
    """Values that would not round-trip as the same JSON are refused with a ValueError saying why."""
    with pytest.raises(ValueError, match="not JSON-serialisable") as info:
        codec.dumps(value)
    assert why.split()[0].lower() in str(info.value).lower() or "json" in str(info.value).lower()


def test_newer_format_version_fails_clearly() -> None:
    """A record from a newer major format raises UnsupportedFormatError naming both versions."""
    body = orjson.dumps({"v": codec.FORMAT_VERSION + 1, "seq": 1, "ts": "t", "type": "cleared", "data": {}})
    crc = zlib.crc32(b"}", zlib.crc32(body[:-1]))
    line = body[:-1] + b',"crc":"%08x"}\n' % crc
    with pytest.raises(UnsupportedFormatError, match=f"format version {codec.FORMAT_VERSION + 1}"):
        codec.decode(line)
