"""The newest records of one type in a log, found without replaying it: read backwards from the end of a file
log, selected by the database on PostgreSQL, else (or when a line on the way does not decode) read forwards,
which reports any damage as every full read does."""

from __future__ import annotations

from collections import deque
from typing import Any

from ..model import codec
from .eventlog import EventLog
from .log import FileEventLog


#: How much of the log one backward step reads: the records of a type are found in it by a byte search, so a
#: scan that crosses the whole log (a session whose reports are far apart) costs a read of the log in large
#: pieces, not a read per record (docs/performance.md, #23).
WINDOW = 1 << 20


def _backwards(log: FileEventLog, kind: str, limit: int) -> list[dict[str, Any]] | None:
    """Newest first; None when a line on the way does not decode (the caller reads forwards)."""
    if not isinstance(log.position, int):
        return None
    wanted = f'"type":"{kind}"'.encode()
    out: list[dict[str, Any]] = []
    with log.reader() as reader:
        floor = reader.manifest.start  # (before it: expired records, no longer in the log)
        end = log.position
        tail = b""  # the start of the oldest line read so far, whose beginning is further back
        while end > floor and len(out) < limit:
            start = max(floor, end - WINDOW)
            data = b"".join(piece for _, piece in reader.chunks(start, end)) + tail
            if len(data) != end - start + len(tail):
                return None
            cut = data.find(b"\n") + 1 if start > floor else 0
            if start > floor and cut == 0:  # (a line longer than the window: read further back)
                tail, end = data, start
                continue
            tail, body = data[:cut], data[cut:]
            i = len(body)
            while len(out) < limit:
                j = body.rfind(wanted, 0, i)
                if j < 0:
                    break
                first = body.rfind(b"\n", 0, j) + 1
                line = body[first:body.find(b"\n", j) + 1]
                if not line.endswith(b"\n"):
                    return None
                try:  # (a cheap filter; the record is decoded and checked here)
                    rec = codec.decode(line)
                except (codec.RecordError, ValueError):
                    return None
                if rec.get("type") == kind:
                    out.append(rec)
                i = first
            end = start
    return out


async def _selected(log: Any, kind: str, limit: int) -> list[dict[str, Any]]:
    """PostgreSQL: the rows holding ``"type":"<kind>"``, newest first, each decoded and checked."""
    needle = f'"type":"{kind}"'.encode()
    async with log._io:
        conn = await log._live_conn()
        rows = await conn.fetch(log._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 AND "
                                       "position($2::bytea in record) > 0 ORDER BY seq DESC LIMIT $3"),
                                log.session_id, needle, limit, timeout=log.timeout)
    out = []
    for row in rows:
        rec = log._verify(row["seq"], bytes(row["record"]), row["seq"])
        if rec.get("type") == kind:
            out.append(rec)
    return out


async def newest_records(log: EventLog, kind: str, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` records of type ``kind``, oldest first, the newest of the log."""
    if isinstance(log, FileEventLog):
        try:
            found = _backwards(log, kind, limit)
        except (OSError, ValueError):
            found = None
        if found is not None:
            return found[::-1]
    elif type(log).__name__ == "PostgresEventLog":
        return (await _selected(log, kind, limit))[::-1]
    kept: deque[dict[str, Any]] = deque(maxlen=limit)
    async for batch in log.read_batches():
        kept.extend(r for r in batch if r.get("type") == kind)
    return list(kept)
