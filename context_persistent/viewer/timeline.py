"""A session's events, read from its log a page at a time, and the index of its notable events.

A page is found without reading what comes before it: on the file backend the record a page starts after is
located in the segment whose seq range holds it, by bisection (``LogReader.anchor_for``), and the last N
records from the end backwards (``anchor_before_last``), as ``tail`` does; PostgreSQL reads by seq.

The index of notable events (everything but ``message_added``: system prompt changes, pins, redactions,
compactions, repairs, replays, retention, erasure) is what the token chart marks and the timeline jumps to;
the provider's usage reports it meets go to a packed series of their own (usage.py).
Building it reads the log once, then only what was appended since; a session with redactions needs it
before its timeline shows a message, so a redacted message's text is never sent (docs/viewer.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..model import events as ev
from ..model.projection import make_key, split_key
from ..transfer.time_travel import fingerprint  # (the rule time travel hides redacted copies by)
from .shaping import message_slots, shape_record
from .usage import UsageSeries

#: The most records one page may hold.
PAGE_MAX = 1000
#: Notable events the index keeps (the newest; older ones are counted in ``omitted``).
MARKS_MAX = 10_000


def _anchor(log: Any, after: int) -> tuple[int, int | None]:
    """``(seq, position)`` to read a file log on from, right after record ``after`` (``(0, None)``: from the
    start; a database log reads by seq)."""
    reader_of = getattr(log, "reader", None)
    if after <= 0 or reader_of is None or not isinstance(getattr(log, "position", None), int):
        return after, None
    with reader_of() as reader:
        found = reader.anchor_for(after)
    return found if found is not None else (0, None)


def _anchor_last(log: Any, n: int) -> tuple[int, int | None]:
    """Where to read a log's last ``n`` records from."""
    reader_of = getattr(log, "reader", None)
    if reader_of is None:  # PostgreSQL: seqs have no gaps and ``position`` is the last seq
        return max(0, int(getattr(log, "position", 0)) - n), None
    with reader_of() as reader:
        found = reader.anchor_before_last(n, log.position)
    return found if found is not None else (0, None)


async def read_records(log: Any, *, after: int | None, limit: int, until: int | None = None
                       ) -> list[dict[str, Any]]:
    """Up to ``limit`` records (as stored) after seq ``after``, or the last ``limit`` ones when ``after`` is
    None; never one past seq ``until`` (time travel)."""
    if not 1 <= limit <= PAGE_MAX:
        raise ValueError(f"limit must be between 1 and {PAGE_MAX}, got {limit}")
    if after is None:
        seq, position = _anchor(log, until - limit) if until is not None else _anchor_last(log, limit)
        floor = max(0, until - limit) if until is not None else seq
    else:
        if after < 0:
            raise ValueError(f"after must be a seq >= 0, got {after}")
        seq, position = _anchor(log, after)
        floor = after
    out: deque[dict[str, Any]] = deque(maxlen=limit)
    batches = log.read_batches(after_seq=seq, position=position, batch=min(limit, 1024))
    try:
        async for batch in batches:
            for rec in batch:
                if rec["seq"] <= floor:
                    continue
                if until is not None and rec["seq"] > until:
                    return list(out)
                out.append(rec)
                if after is not None and len(out) >= limit:
                    return list(out)
    finally:
        await batches.aclose()
    return list(out)


@dataclass(slots=True)
class Marks:
    """The notable events of one session, as far as its log was read (``last_seq``)."""

    last_seq: int = 0
    position: int | None = None
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MARKS_MAX))
    omitted: int = 0
    redacted: set[int] = field(default_factory=set)
    prints: set[bytes] = field(default_factory=set)
    usage: UsageSeries = field(default_factory=UsageSeries)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def hidden(self, key: int, message: Any) -> bool:
        """Whether a message is redacted: by its key, or as a copy of a redacted message (time travel's rule)."""
        return key in self.redacted or (bool(self.prints) and fingerprint(message) in self.prints)

    async def update(self, log: Any) -> None:
        """Read what the log holds after ``last_seq`` (from the start the first time)."""
        async with self.lock:
            new_keys: list[int] = []
            batches = log.read_batches(after_seq=self.last_seq, position=self.position)
            try:
                async for batch in batches:
                    for rec in batch:
                        if rec["seq"] <= self.last_seq:
                            continue
                        self._note(rec, new_keys)
                    if batch:
                        self.last_seq = batch[-1]["seq"]
                        spans = getattr(log, "batch_spans", None)
                        self.position = spans[-1][1] if spans and len(spans) == len(batch) else None
                    await asyncio.sleep(0)  # (a long first read lets other requests run between batches)
            finally:
                await batches.aclose()
            for key in new_keys:
                await self._fingerprint(log, key)

    def _note(self, rec: dict[str, Any], new_keys: list[int]) -> None:
        kind = rec.get("type")
        if kind == ev.MESSAGE_ADDED:
            return
        if kind == ev.USAGE_REPORTED:  # (one a request: packed apart, so they never crowd out the others)
            self.usage.note(rec)
            return
        if kind == ev.REDACTED:
            data = rec.get("data") or {}
            key = data.get("key")
            if isinstance(key, int) and not isinstance(key, bool):
                self.redacted.add(key)
                new_keys.append(key)
        if len(self.events) == self.events.maxlen:
            self.omitted += 1
        self.events.append(shape_record(rec, self.hidden, limit=300))

    async def _fingerprint(self, log: Any, key: int) -> None:
        """Note the content of the redacted message ``key``, so its copies are hidden too."""
        seq, index = split_key(key)
        for rec in await read_records(log, after=seq - 1, limit=1):
            if rec["seq"] == seq:
                for i, m in message_slots(rec):
                    if i == index and m is not None:
                        self.prints.add(fingerprint(m))


class MarkIndex:
    """The :class:`Marks` of each session a viewer has looked at (a session's log that changed in a way an
    append cannot, such as a repair or an erasure, starts its index again)."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[Any, Marks]] = {}

    async def of(self, source: Any, session_id: str) -> Marks:
        identity = await source.signature(session_id)
        known = self._marks.get(session_id)
        marks = known[1] if known is not None and _same_log(known[0], identity) else Marks()
        async with source.log(session_id) as log:
            await marks.update(log)
        self._marks[session_id] = (identity, marks)
        return marks


def _same_log(before: Any, now: Any) -> bool:
    """Whether ``now`` can be the same log as ``before`` grown by appends (same files, none smaller)."""
    if not isinstance(before, tuple) or not isinstance(now, tuple):
        return before is None or now is None or now >= before
    for a, b in zip(before, now):
        if a is not None and (b is None or a[0] != b[0] or b[1] < a[1]):
            return False
    return True


async def timeline_page(source: Any, index: MarkIndex, session_id: str, *, after: int | None, limit: int,
                        until: int | None) -> dict[str, Any]:
    """A page of the timeline: the records, shaped (redacted messages hidden), and where the log ends."""
    async with source.store(session_id) as store:
        head = store.head_seq
        has_redactions = bool(store._state.counts.get(ev.REDACTED))
    if until is not None and not 1 <= until <= head:
        raise ValueError(f"at must be a seq between 1 and {head} (the head), got {until}")
    marks = await index.of(source, session_id) if has_redactions else None
    async with source.log(session_id) as log:
        records = await read_records(log, after=after, limit=limit, until=until)
    hidden = marks.hidden if marks is not None else None
    return {"head_seq": head, "records": [shape_record(r, hidden) for r in records]}


async def follow_records(source: Any, index: MarkIndex, session_id: str, after: int) -> Any:
    """The records appended after seq ``after``, shaped, as they arrive (forever; cancel to stop)."""
    async with source.store(session_id) as store:
        has_redactions = bool(store._state.counts.get(ev.REDACTED))
    marks = await index.of(source, session_id) if has_redactions else None
    async with source.log(session_id) as log:
        stream = log.follow(after)
        async with contextlib.aclosing(stream) as records:
            async for rec in records:
                if rec.get("type") == ev.REDACTED:
                    marks = await index.of(source, session_id)
                yield shape_record(rec, marks.hidden if marks is not None else None)


__all__ = ["MarkIndex", "Marks", "follow_records", "make_key", "read_records", "timeline_page"]
