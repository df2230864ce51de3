"""A session's search documents, read from its log: one per message a record holds, with whether the views
show it (the history's keys, folded by the one fold, ``Projection``) and the redaction rule applied.

The rule, the same for a rebuild and for the incremental path (docs/search.md, "What is indexed"):

- every message slot a record of the log holds is a document: ``message_added``, each message of
  ``messages_replaced`` and ``system_prompt_set``, the slots an erasure tombstone keeps, and the copies an
  ``expired`` record carries (under the key of the message they stand for, with the ``expired`` record's time);
- ``in_view``: its key is in the history (``get_messages()``) after the last record;
- a document not in view whose key a ``redacted`` event names, or identical to such a message (the rule of
  ``at(seq)``: transfer/snapshot.py), is left out: the log still holds it, no view shows it at any seq.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ...model import events as ev
from ...model.projection import Projection, make_key, split_key
from ...model.values import Value
from ...storage.backends import pager_for
from .text import fingerprint, message_texts

#: Record types after which a session is indexed again from its log: they remove records or messages from
#: the log (an expiry, a repair), or stand where a removed message was (an erasure tombstone).
REINDEX_TYPES = frozenset({ev.EXPIRED, ev.LOG_REPAIRED, ev.ERASED})
#: Record types that change no view but by appending a message.
APPEND_TYPES = frozenset({ev.MESSAGE_ADDED, *ev.AUDIT_EVENTS})
_LIST_RECORDS = (ev.MESSAGES_REPLACED, ev.SYSTEM_PROMPT_SET)
#: The fold reads back a few messages (the leading system prompt); it needs no more cache than this.
_FOLD_CACHE = 4 << 20


class Doc(Value):
    """One message of a session as the index holds it. ``rec_seq``/``slot``/``pos`` say where the log holds
    it (``pos``: the record's byte position in a file log, None elsewhere), for checking a hit."""

    __slots__ = ("key", "rec_seq", "slot", "pos", "role", "ts", "body", "tools", "fp")
    key: int
    rec_seq: int
    slot: int
    pos: int | None
    role: str
    ts: str
    body: str
    tools: str
    fp: bytes

    def __init__(self, key: int, rec_seq: int, slot: int, pos: int | None, role: str, ts: str, body: str, tools: str,
                 fp: bytes) -> None:
        self.key = key
        self.rec_seq = rec_seq
        self.slot = slot
        self.pos = pos
        self.role = role
        self.ts = ts
        self.body = body
        self.tools = tools
        self.fp = fp

    @property
    def seq(self) -> int:
        return split_key(self.key)[0]


def slots(rec: dict[str, Any]) -> list[tuple[int, int, dict[str, Any]]]:
    """``(key, slot, message)`` of every message ``rec`` holds (erased slots left out; an ``expired``
    record's carried copies under the keys of the messages they stand for)."""
    kind, data, seq = rec["type"], rec["data"], rec["seq"]
    if kind == ev.MESSAGE_ADDED:
        return [(make_key(seq), 0, data["message"])]
    if kind in _LIST_RECORDS:
        return [(make_key(seq, i), i, m) for i, m in enumerate(data["messages"])]
    if kind == ev.ERASED and data.get("of") in _LIST_RECORDS:
        return [(make_key(seq, i), i, m) for i, m in enumerate(data["messages"]) if m is not None]
    expired = ev.expired_of(rec)
    if expired is not None:
        return [(c["key"], j, c["message"]) for j, c in enumerate(expired["carried"]) if c["message"] is not None]
    return []


def docs_of(rec: dict[str, Any], pos: int | None) -> list[Doc]:
    out = []
    for key, slot, m in slots(rec):
        if not isinstance(m, dict):
            continue
        body, tools = message_texts(m)
        out.append(Doc(key, rec["seq"], slot, pos, str(m.get("role")), rec["ts"], body, tools, fingerprint(m)))
    return out


def redacted_key(rec: dict[str, Any]) -> int | None:
    key = rec["data"].get("key") if isinstance(rec.get("data"), dict) else None
    return key if isinstance(key, int) and not isinstance(key, bool) else None


async def positioned(log: Any, after_seq: int = 0, position: int | None = None
                     ) -> AsyncIterator[tuple[list[dict[str, Any]], list[int | None], list[int]]]:
    """The log's records after ``after_seq`` in batches, each with its records' positions (a file log's byte
    positions; None elsewhere) and sizes in bytes."""
    async for batch in log.read_batches(after_seq, position):
        spans = getattr(log, "batch_spans", None)
        if spans is not None and len(spans) == len(batch):
            yield batch, [s for s, _ in spans], [e - s for s, e in spans]
            continue
        sizes = getattr(log, "batch_sizes", None)
        if sizes is None or len(sizes) != len(batch):
            sizes = [0] * len(batch)
        yield batch, [None] * len(batch), list(sizes)


class Folded(Value):
    """What a whole pass over a session's log found: the history's keys, the redacted keys, the last record."""

    __slots__ = ("keys", "redacted", "last_seq", "last_crc", "position", "first_ts", "last_ts", "bytes")
    keys: Any
    redacted: set[int]
    last_seq: int
    last_crc: str | None
    position: int | None
    first_ts: str | None
    last_ts: str | None
    bytes: int

    def __init__(self, keys: Any, redacted: set[int], last_seq: int, last_crc: str | None, position: int | None,
                 first_ts: str | None, last_ts: str | None, bytes: int) -> None:
        self.keys = keys
        self.redacted = redacted
        self.last_seq = last_seq
        self.last_crc = last_crc
        self.position = position
        self.first_ts = first_ts
        self.last_ts = last_ts
        self.bytes = bytes


async def fold(log: Any) -> Folded:
    """The history's keys after the log's last record (the store's fold, messages read back from the log only
    where it needs them), with the keys ``redacted`` events name."""
    from ...storage.checkpoint.policy import seed_state

    pager = pager_for(log, _FOLD_CACHE)
    try:
        state = seed_state(log, pager)
        redacted: set[int] = set()
        first_ts = last_ts = last_crc = None
        total = 0
        refs_are_keys = getattr(pager, "refs_are_keys", False)
        async for batch, positions, sizes in positioned(log):
            for rec, pos, size in zip(batch, positions, sizes):
                if pager is None:
                    state.apply(rec)
                else:
                    state.apply(rec, rec["seq"] if refs_are_keys else pos, size)
                if rec["type"] == ev.REDACTED:
                    key = redacted_key(rec)
                    if key is not None:
                        redacted.add(key)
                first_ts = first_ts or rec["ts"]
                last_ts, last_crc = rec["ts"], rec["crc"]
                total += size
        return Folded(state.keys, redacted, state.head_seq, last_crc, _end(log), first_ts, last_ts, total)
    finally:
        if pager is not None:
            pager.close()


def _end(log: Any) -> int | None:
    pos = getattr(log, "position", None)
    return pos if type(pos) is int and hasattr(log, "batch_spans") else None


async def redacted_prints(log: Any, redacted: set[int]) -> set[bytes]:
    """The fingerprints of the messages the log holds under ``redacted`` keys."""
    prints: set[bytes] = set()
    if not redacted:
        return prints
    async for batch in log.read_batches():
        for rec in batch:
            for key, _, m in slots(rec):
                if key in redacted:
                    prints.add(fingerprint(m))
    return prints


def hidden(doc: Doc, in_view: bool, redacted: set[int], prints: set[bytes]) -> bool:
    """The redaction rule: a document no view shows at any seq."""
    return not in_view and (doc.key in redacted or doc.fp in prints)
