"""The read path of a file log (:class:`~context_persistent.storage.log.FileEventLog`): its records from a
position, verified as they are read, across the sealed segments and the active file.

Each record must name the one before it (``codec.Links``); a bad line in a sealed segment is corruption (they
were verified when sealed), a bad tail of the active file is the torn tail (torn_tail.py), which the log
records for open to cut. :func:`record_before` finds the record that ends at a position: how a checkpoint's
anchor is checked. The log's methods of the same names call these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from ..model import codec
from ..errors import LogCorruptedError
from .records import line_at, scan
from .segments import LogReader
from .torn_tail import TornTail, tail_reason

if TYPE_CHECKING:
    from .log import FileEventLog


def record_before(log: FileEventLog, position: int) -> dict[str, Any] | None:
    """The valid record that ends exactly at global byte ``position``, else None (checkpoint anchor check)."""
    if position <= 0 or position > log.base + log.size:
        return None
    if position <= log.base or log._reader is not None:
        with log.reader() as reader:
            line = reader.line_ending_at(position)
        try:
            return codec.decode(line) if line.endswith(b"\n") else None
        except (codec.RecordError, ValueError):
            return None
    position -= log.base
    back = 0
    with open(log.path, "rb") as f:
        while True:  # look back 4 KiB, then 64 KiB, 1 MiB, ... for the newline before the record
            back = min(position, max(back * 16, 4096))
            f.seek(position - back)
            chunk = f.read(back)
            start = chunk.rfind(b"\n", 0, len(chunk) - 1) + 1
            if start > 0 or back == position:
                break
    if not chunk.endswith(b"\n"):
        return None
    try:
        return codec.decode(chunk[start:])
    except (codec.RecordError, ValueError):
        return None


def _checked_position(log: FileEventLog, after_seq: int, position: int | None) -> tuple[int, dict[str, Any] | None]:
    """``(position, its record)`` if the record ending there has seq ``after_seq``; else ``(0, None)``
    (read from the start)."""
    if not position or after_seq <= 0:
        return 0, None
    rec = record_before(log, position)
    return (position, rec) if rec is not None and rec["seq"] == after_seq else (0, None)


async def read_batches(log: FileEventLog, after_seq: int = 0, position: int | None = None,
                       batch: int = 4096) -> AsyncIterator[list[dict[str, Any]]]:
    """:meth:`FileEventLog.read_batches`: the records after ``after_seq`` (from ``position`` when the record
    ending there is ``after_seq``), verified; then ``log.last_seq``, ``last_crc`` and ``torn`` as read."""
    start, anchor = _checked_position(log, after_seq, position)
    floor = after_seq  # without a usable position we read from the start, yet still return seq > after_seq
    if start == 0:
        after_seq = 0
    out: list[dict[str, Any]] = []
    base = log.base
    end = start
    n = 0  # records read from the active segment
    last = after_seq
    # Each record must name the one before it (codec.Links); a break is corruption unless a repair recorded
    # the seq gap it sits on (``log_repaired`` comes after the breaks it explains: checked at the end).
    links = codec.Links(log.session_id, None if anchor is None else anchor["crc"],
                        anchor is not None and anchor.get("prev") is not None)
    boundary = log.manifest.boundary if log.manifest is not None else None
    if anchor is None and boundary is not None:  # the oldest segments expired: the log begins after them
        start, last = boundary.start, boundary.last_seq
        end = start
        links = codec.Links(log.session_id, boundary.last_crc, True)
    breaks: list[tuple[int, int, int, str]] = []
    explained: set[tuple[int, int]] = set()
    spans: list[tuple[int, int]] = []
    for rec, rec_end in records(log, start):
        if rec_end > base:
            n += 1
        seq = rec["seq"]
        if seq <= last:
            raise corrupt(log, end, f"seq {seq} does not follow seq {last}")
        prev = rec["prev"]
        if prev is None or prev != links.last:
            problem = links.check(rec)
            if problem is not None:
                breaks.append((last, seq, end, problem))
        else:
            links.last = rec["crc"]
        if breaks and rec["type"] == "log_repaired":
            explained.update((a, b) for a, b in rec["data"].get("gaps", ()))
        last = seq
        rec_start, end = end, rec_end
        if seq <= floor:
            continue
        out.append(rec)
        spans.append((rec_start, rec_end))
        if len(out) >= batch:
            log.batch_spans = spans
            yield out
            out, spans = [], []
    for after, seq, at, problem in breaks:
        if (after, seq) not in explained:
            raise corrupt(log, at, f"record seq {seq} {problem}")
    if out:
        log.batch_spans = spans
        yield out
    log.last_seq = max(log.last_seq, last)
    if links.last is not None:
        log.last_crc = links.last.encode()
    log.torn = None
    file_end = max(end - base, 0)
    if log.size > file_end:
        log.torn = TornTail(offset=file_end, length=log.size - file_end,
                            line=n + 1 if start <= base else line_at(log.path, file_end),
                            reason=tail_reason(log.path, file_end, log.size))


def records(log: FileEventLog, start: int) -> Iterator[tuple[dict[str, Any], int]]:
    """``(record, global end)`` of every valid record from global ``start``: the sealed segments (where
    any bad line is corruption: they were verified when sealed), then the active one (``scan``)."""
    base = log.base
    if start < base:
        with log.reader() as reader:
            decode = codec.decode
            for at, line in reader.lines(start, base):
                try:
                    if line[-1:] != b"\n":
                        raise codec.RecordError("a sealed segment ends inside a record")
                    rec = decode(line)
                except codec.RecordError as e:
                    raise corrupt(log, at, str(e), reader) from None
                yield rec, at + len(line)
        start = base
    active = log.path if log._reader is None else log._reader
    if log.size <= start - base:
        return
    for rec, end in scan(active, start - base, 1 if start == base else None, log.size,
                         strict_tail=log.fsync_mode != "never"):
        yield rec, base + end


def corrupt(log: FileEventLog, position: int, reason: str, reader: LogReader | None = None) -> LogCorruptedError:
    """LogCorruptedError naming the file, line and offset of global ``position``."""
    if position >= log.base:
        return LogCorruptedError(str(log.path), line_at(log.path, position - log.base), position - log.base, reason)
    if reader is None:
        with log.reader() as r:
            return corrupt(log, position, reason, r)
    path, offset = reader.where(position)
    return LogCorruptedError(str(path), reader.line_number(position), offset, reason)


__all__ = ["corrupt", "read_batches", "record_before", "records"]
