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


def _backwards(log: FileEventLog, kind: str, limit: int, stop: int = 0, where: list[int] | None = None
               ) -> list[dict[str, Any]] | None:
    """Newest first, none before position ``stop``, each one's position put in ``where``; None when a line on
    the way does not decode (the caller reads forwards)."""
    if not isinstance(log.position, int):
        return None
    wanted = f'"type":"{kind}"'.encode()
    out: list[dict[str, Any]] = []
    with log.reader() as reader:
        floor = max(reader.manifest.start, stop)  # (before the manifest's start: expired records, not in the log)
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
                    if where is not None:
                        where.append(start + cut + first)
                i = first
            end = start
    return out


def _known(log: FileEventLog, kind: str, limit: int, known: tuple[int, list[int]], where: list[int] | None
           ) -> list[dict[str, Any]] | None:
    """:func:`newest_records` with ``known`` (newest first, as :func:`_backwards`), or None."""
    position, positions = known
    tail: list[int] = []
    found = _backwards(log, kind, limit, position, tail)
    if found is None:
        return None
    older = limit - len(found)
    if older > len(positions):  # (the log holds more before ``position`` than the list says: read it)
        return None
    if older:
        before = _at(log, kind, positions[-older:], position)
        if before is None or found and before[-1]["seq"] >= found[-1]["seq"]:
            return None
        found += before[::-1]
        tail += positions[-older:][::-1]
    if where is not None:
        where += tail
    return found


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


def _at(log: FileEventLog, kind: str, positions: list[int], after: int) -> list[dict[str, Any]] | None:
    """The records of type ``kind`` that start at ``positions`` (ascending, each before ``after``), in order, or
    None if one is not such a record (its line does not decode, or is of another type)."""
    out: list[dict[str, Any]] = []
    with log.reader() as reader:
        if positions and positions[0] < reader.manifest.start:  # (expired: no longer in the log)
            return None
        for pos in positions:
            size = 2048
            while True:
                stop = min(pos + size, after)
                data = b"".join(piece for _, piece in reader.chunks(pos, stop))
                nl = data.find(b"\n")
                if nl >= 0 or stop >= after or len(data) < stop - pos:
                    break
                size *= 8
            if nl < 0:
                return None
            try:
                rec = codec.decode(data[:nl + 1])
            except (codec.RecordError, ValueError):
                return None
            if rec.get("type") != kind or out and rec["seq"] <= out[-1]["seq"]:
                return None
            out.append(rec)
    return out


async def newest_records(log: EventLog, kind: str, limit: int, known: tuple[int, list[int]] | None = None,
                         where: list[int] | None = None) -> list[dict[str, Any]]:
    """Up to ``limit`` records of type ``kind``, oldest first, the newest of the log.

    ``known`` (a file log's): ``(position, positions)``: ``positions`` are where the newest such records before
    ``position`` start (ascending). The log is then read backwards down to ``position`` only, and the older
    records the limit wants are read where ``positions`` say; if there are fewer positions than that, or one
    is not such a record, the log is read backwards as without them (``limit`` must be no more than the log
    holds: the caller knows how many it holds). ``where`` gets the
    position of each record returned, oldest first, when the log was read backwards (else it is left empty)."""
    if isinstance(log, FileEventLog):
        found = None
        try:
            if known is not None:
                found = _known(log, kind, limit, known, where)
            if found is None:
                if where is not None:
                    where.clear()
                found = _backwards(log, kind, limit, 0, where)
        except (OSError, ValueError):
            found = None
        if found is not None:
            if where is not None:
                where.reverse()
            return found[::-1]
    if where is not None:
        where.clear()
    if type(log).__name__ == "PostgresEventLog":
        return (await _selected(log, kind, limit))[::-1]
    kept: deque[dict[str, Any]] = deque(maxlen=limit)
    async for batch in log.read_batches():
        kept.extend(r for r in batch if r.get("type") == kind)
    return list(kept)
