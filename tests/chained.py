"""Chained test records (codec.Links): each record names the one before it, the first one the session's root.

``lines(sid, first, n)`` is deterministic (fixed timestamp, content from seq and tag), so records made by two
calls chain onto each other exactly as if they were made in one: ``lines(s, 1, 3) + lines(s, 4, 7)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from context_persistent.model import codec
from context_persistent.storage.log import data_size

TS = "2026-01-01T00:00:00.000000+00:00"


def _content(seq: int, tag: str) -> dict[str, Any]:
    return {"role": "user", "content": f"{tag}{seq}"}


def lines(sid: str, first: int, n: int, tag: str = "m",
          message: Callable[[int, str], dict[str, Any]] = _content) -> list[bytes]:
    """Records ``first .. first + n - 1`` of a chain that starts at seq 1 (earlier records with tag "m").

    The same arguments give the same bytes: a record's random ``salt`` (codec.salt) is fixed per seq here, so
    that the records before ``first``, encoded again, have the crc the chain was built with."""
    prev = codec.root_crc(sid)
    out = []
    for seq in range(1, first + n):
        line = _salted(seq, lambda: codec.encode_event(
            seq, "message_added", {"message": message(seq, tag if seq >= first else "m")}, TS, prev))
        if seq >= first:
            out.append(line)
        prev = codec.crc_of(line)
    return out


def _salted(seq: int, encode: Callable[[], bytes]) -> bytes:
    real = codec.salt
    codec.salt = lambda: (b"ac" * 24)[seq % 2:][:24] + b"a" * 24  # type: ignore[assignment]
    try:
        return encode()
    finally:
        codec.salt = real  # type: ignore[assignment]


def last_crc(path: Path) -> bytes:
    """The crc of the last record of a log file (the next record's ``prev``)."""
    with open(path, "rb") as f:
        data = f.read(data_size(path))
    return codec.crc_of(data[data.rstrip(b"\n").rfind(b"\n") + 1:])


def record_after(path: Path, seq: int, type_: str, data: dict[str, Any]) -> bytes:
    """A record that chains onto the log file at ``path`` (to append by hand)."""
    return codec.encode_event(seq, type_, data, prev=last_crc(path))
