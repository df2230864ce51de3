"""Test helpers on checkpoint files (not a test module)."""

from __future__ import annotations

import zlib
from pathlib import Path

import orjson


def section_at(data: bytes) -> tuple[int, int]:
    """(offset, length) of the message section in a checkpoint file holding its own state section."""
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    start = nl + 1 + head["front_bytes"] + 1 + 9 + head["state_bytes"] + 1 + 9
    return start, head["messages_bytes"]


def strip_message_section(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` as layout 4 would have written it: no ``messages_bytes``, nothing after
    the state section (its messages are then read from the log)."""
    data = path.read_bytes()
    start, _ = section_at(data)
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    del head["messages_bytes"]
    head["checkpoint"] = 4
    line = orjson.dumps(head)
    front_end = nl + 1 + head["front_bytes"] + 1
    front = data[nl + 1:front_end]
    crc = zlib.crc32(front, zlib.crc32(line + b"\n"))
    path.write_bytes(line + b"\n" + front + b"%08x\n" % crc + data[front_end + 9:start])


def set_layout(path: Path, layout: int) -> None:
    """Rewrite the header of the checkpoint at ``path`` to say ``layout`` (its front CRC line recomputed)."""
    data = path.read_bytes()
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    head["checkpoint"] = layout
    line = orjson.dumps(head)
    front_end = nl + 1 + head["front_bytes"] + 1
    front = data[nl + 1:front_end]
    crc = zlib.crc32(front, zlib.crc32(line + b"\n"))
    path.write_bytes(line + b"\n" + front + b"%08x\n" % crc + data[front_end + 9:])
