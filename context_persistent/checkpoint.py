"""Checkpoints: the projection state at a seq, so opening a long session replays only the tail.

A checkpoint is a cache. Open = newest valid checkpoint + the records after it; a missing, stale,
truncated, corrupt, foreign or too-new checkpoint is ignored (full replay) and never changes the result.
Deleting one is always safe.

Three layers, so any backend can store the same payload:

* the payload (pure): :func:`snapshot` serialises a :class:`Projection` (one ``orjson.dumps`` call;
  :func:`dump_in_steps` does the same for a :meth:`Projection.capture` in steps between which the event loop
  runs), :func:`encode` frames it with a header and a CRC, :func:`decode` verifies and parses it,
  :func:`mismatch` and :func:`restore` decide whether it fits this session and rebuild the state;
* where it is stored: a :class:`CheckpointStore` (``load``/``save``/``discard`` of payload bytes);
  :class:`FileCheckpointStore` keeps ``<session>/checkpoint.json`` (temp file 0600, fsync, rename, fsync
  folder). Another backend exposes its own store as ``log.checkpoint_store``;
* when (:class:`Checkpointer`, used by the manager): every ``checkpoint_every`` events and on close.

Payload layout (bytes)::

    {"checkpoint":3,"format":1,"schema":[...],"session_id":"…","seq":N,"position":P,
     "first_crc":"…","last_crc":"…","tokenizer":"…"|null,"front_bytes":F,"state_bytes":L,
     "base":null|{"seq":B,"position":Q,"last_crc":"…"}}\\n                     <- header line
    <F bytes: the front section JSON, or null>\\n
    xxxxxxxx\\n                                          <- CRC-32 of the header line and the front section
    <L bytes: the state JSON, Projection.to_state()>\\n
    xxxxxxxx\\n                                          <- CRC-32 of the state section

The front section (:func:`front_of`) is what the first request view of a long session needs: the session
facts, every system/developer message, the first turns, each pinned message with the turns around it, and the
newest messages up to twice the largest budget seen, each with its index, key and token count (if known).
Opening a file checkpoint reads and verifies the header and the front only; the state section is read, verified
and parsed when something needs the whole history (:class:`~context_persistent.projection.LazyList`), from the file
descriptor opened at open (a newer checkpoint renamed over it later does not change what it reads). If the
state section then fails verification, the history is rebuilt from the log instead (it is the source of truth).

A *based* checkpoint (``base`` not null) is what a store writes while its history is still lazy: a new header
and front section, followed by the state section of the checkpoint it was opened from, copied byte for byte
(not loaded): that section is at ``base``, and loading the rest replays the log from ``base.position`` up to
``position``. So a periodic checkpoint never has to load a lazily opened history (seconds at a million
messages). The log between is bounded (``BASE_MAX_FACTOR``), and ``base`` is anchored like ``seq`` (its
record's seq and CRC at its position). Layout 2 (no ``base``) is still read.

Identity: ``session_id``, the log ``format``, the projection layout (``schema``: its slot names) and
``first_crc``, the checksum of the log's first record (``session_started``, unique by its timestamp), which
rejects a checkpoint of an older incarnation of the same session id. ``last_crc`` is the checksum of the
record at ``seq``; a backend that can look it up (``log.record_before(position)``) proves the log still holds
that exact record at that position. A log shorter than the checkpoint is detected after the tail read.

Cost: a checkpoint is O(state). In the caller's turn only the capture (shallow copies of three lists) and
the front section; the state is serialised in steps of ``DUMP_STEP`` items with the event loop free between
them, and framing, CRC and the file write + fsync run in a worker thread while appends continue. With
``checkpoint_every = K`` that is O(state / K) amortised per append.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import errno
import functools
import gc
import logging
import os
import stat
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson

from . import codec
from .grouping import has_result_blocks, is_real_user_turn, is_system
from .paths import CHECKPOINT_NAME, NOFOLLOW, create_private_file, fsync_dir, write_all
from .projection import BaseLoader, LazyList, LoadRefused, Projection

logger = logging.getLogger("context_persistent.checkpoint")

#: Version of the payload layout above; a version not in ``READABLE_VERSIONS`` is ignored. Version 3 added
#: ``base`` (a state section older than the front); version 2 payloads read the same without it.
CHECKPOINT_VERSION = 3
READABLE_VERSIONS = (2, 3)
#: The projection layout a payload was written for: a new field invalidates old checkpoints by itself.
SCHEMA = sorted(Projection.__slots__)
#: On close, a checkpoint is written only if at least this many events (or ``checkpoint_every``, if smaller)
#: are not covered yet: replaying a short tail costs less than writing the whole state again.
CLOSE_MIN_EVENTS = 256
#: ... or when the log grew by at least this many bytes (one set_messages can hold a whole long history).
CLOSE_MIN_BYTES = 1 << 20
#: Payloads larger than this are framed (CRC, copy) in a worker thread.
_THREAD_MIN = 1 << 20
#: List items (messages, keys, token counts) serialised per step of a background checkpoint write.
DUMP_STEP = 16_384
#: A store still lazy reuses its checkpoint's state section (copied, not parsed) as long as the log between
#: that section and the new front is at most this many times ``checkpoint_every`` events: loading the rest
#: then replays that much of the log (about 4 µs an event here).
BASE_MAX_FACTOR = 8
_TRAILER = 9  # 8 hex digits + newline
#: Front section: turns kept after the head and around each pinned message (what a group search may read),
#: and the most messages one span may hold (beyond it a rebuild simply loads the rest).
FRONT_EXTRA_TURNS = 2
FRONT_MAX_SPAN = 4096
#: The newest messages kept in the front cover this many times the largest budget seen.
FRONT_RECENT_FACTOR = 2


class CheckpointError(ValueError):
    """A payload cannot be used; the message says why (it is then ignored, never fatal)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A decoded payload: identity, the position after ``seq`` and the projection state at ``seq``."""

    session_id: str
    seq: int
    position: int | None
    first_crc: str | None
    last_crc: str | None
    tokenizer: str | None
    format: int
    schema: list[str]
    state: dict[str, Any] | None  #: None when only the front was read (:func:`read_front`)
    front: dict[str, Any] | None = None
    #: None: the state section is at ``seq``. Else ``{"seq", "position", "last_crc"}`` of the older record the
    #: state section is at; the log from there up to ``position`` brings it to ``seq`` (a "based" checkpoint).
    base: dict[str, Any] | None = None

    @property
    def state_seq(self) -> int:
        """The seq the state section is at."""
        return self.seq if self.base is None else int(self.base["seq"])


# -- the payload (pure) ------------------------------------------------------------------------------
def snapshot(state: Projection) -> bytes:
    """The projection state as JSON bytes, in one ``orjson.dumps`` call (O(state))."""
    return orjson.dumps(state.to_state())


async def dump_in_steps(captured: dict[str, Any], step: int | None = None) -> list[bytes]:
    """:func:`snapshot` of a :meth:`Projection.capture`, serialised ``step`` list items at a time.

    The event loop runs other tasks between steps, so a checkpoint of a large session never holds it for
    long: one ``orjson.dumps`` of a million messages takes a third of a second or more, a step of
    ``DUMP_STEP`` a few milliseconds (docs/operations.md). Returns the pieces, whose concatenation parses
    to the same state as :func:`snapshot`'s bytes; :func:`encode` joins them (in a worker thread when large).
    """
    step = step or DUMP_STEP
    parts = [b"{"]
    for name in ("messages", "keys", "tokens"):
        items = captured[name]
        parts.append(b'"%s":[' % name.encode())
        for start in range(0, len(items), step):
            if start:
                parts.append(b",")
                await asyncio.sleep(0)
            parts.append(orjson.dumps(items[start:start + step])[1:-1])
        parts.append(b"],")
    rest = {k: v for k, v in captured.items() if k not in ("messages", "keys", "tokens")}
    parts.append(orjson.dumps(rest)[1:])  # (the facts, without their opening brace)
    return parts


def encode_front(*, session_id: str, seq: int, position: int | None, first_crc: str | None,
                 last_crc: str | None, tokenizer: str | None, state_bytes: int, front_json: bytes = b"null",
                 base: dict[str, Any] | None = None) -> bytes:
    """The header line, the front section and its CRC line: what precedes a state section of
    ``state_bytes`` bytes (the section and its own CRC line follow)."""
    header = orjson.dumps({
        "checkpoint": CHECKPOINT_VERSION, "format": codec.FORMAT_VERSION, "schema": SCHEMA,
        "session_id": session_id, "seq": seq, "position": position, "first_crc": first_crc,
        "last_crc": last_crc, "tokenizer": tokenizer, "front_bytes": len(front_json), "state_bytes": state_bytes,
        "base": base,
    })
    crc1 = zlib.crc32(b"\n", zlib.crc32(front_json, zlib.crc32(header + b"\n")))
    return b"".join((header, b"\n", front_json, b"\n", b"%08x\n" % crc1))


def encode(*, session_id: str, seq: int, position: int | None, first_crc: str | None, last_crc: str | None,
           tokenizer: str | None, state_json: bytes | list[bytes], front_json: bytes = b"null",
           base: dict[str, Any] | None = None) -> bytes:
    """Frame a state snapshot (and its front section) into a self-checking payload (module docstring).

    ``state_json``: the state's JSON, or the pieces :func:`dump_in_steps` returns (joined here, once)."""
    parts = [state_json] if isinstance(state_json, bytes) else state_json
    prefix = encode_front(session_id=session_id, seq=seq, position=position, first_crc=first_crc,
                          last_crc=last_crc, tokenizer=tokenizer, state_bytes=sum(map(len, parts)),
                          front_json=front_json, base=base)
    crc2 = 0
    for part in parts:
        crc2 = zlib.crc32(part, crc2)
    crc2 = zlib.crc32(b"\n", crc2)
    return b"".join((prefix, *parts, b"\n", b"%08x\n" % crc2))  # one copy of the state


def _check_crc(data: bytes | memoryview, what: str) -> None:
    """``data`` ends with the CRC-32 (8 hex digits + newline) of everything before it."""
    if len(data) < _TRAILER + 1 or bytes(data[-1:]) != b"\n":
        raise CheckpointError(f"truncated {what} ({len(data)} bytes, no trailer)")
    stored = bytes(data[-_TRAILER:-1])
    got = zlib.crc32(memoryview(data)[:-_TRAILER])
    if stored != b"%08x" % got:
        raise CheckpointError(f"{what} checksum mismatch (stored {stored.decode('ascii', 'replace')}, "
                              f"computed {got:08x}): truncated or corrupt")


def _head(line: bytes) -> dict[str, Any]:
    try:
        head = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed header: {e}") from None
    if not isinstance(head, dict) or head.get("checkpoint") not in READABLE_VERSIONS:
        raise CheckpointError(f"payload layout {head.get('checkpoint') if isinstance(head, dict) else head!r}, "
                              f"this program reads {', '.join(map(str, READABLE_VERSIONS))}")
    for key in ("front_bytes", "state_bytes"):
        if not isinstance(head.get(key), int) or head[key] < 0:
            raise CheckpointError(f"malformed header: {key} {head.get(key)!r}")
    return head


def _checkpoint(head: dict[str, Any], front: Any, state: Any) -> Checkpoint:
    try:
        cp = Checkpoint(session_id=head["session_id"], seq=head["seq"], position=head["position"],
                        first_crc=head["first_crc"], last_crc=head["last_crc"], tokenizer=head["tokenizer"],
                        format=head["format"], schema=head["schema"], state=state, front=front,
                        base=head.get("base"))
    except KeyError as e:
        raise CheckpointError(f"malformed payload: header lacks {e}") from None
    if not isinstance(cp.seq, int) or cp.seq < 1 or not (state is None or isinstance(state, dict)):
        raise CheckpointError(f"malformed payload: seq {cp.seq!r}")
    base = cp.base
    if base is not None and not (
            isinstance(base, dict) and isinstance(base.get("seq"), int) and 1 <= base["seq"] < cp.seq
            and isinstance(base.get("position"), int) and isinstance(cp.position, int)
            and 0 < base["position"] < cp.position and isinstance(base.get("last_crc"), str)):
        raise CheckpointError(f"malformed payload: base {base!r} for seq {cp.seq}")
    if front is not None and not isinstance(front, dict):
        raise CheckpointError("malformed payload: the front section is not an object")
    return cp


def _front_size(head: dict[str, Any], nl: int) -> int:
    """Bytes from the start of the payload to the end of the front section's trailer."""
    return nl + 1 + head["front_bytes"] + 1 + _TRAILER


def decode(data: bytes) -> Checkpoint:
    """Verify and parse a whole payload; CheckpointError says what is wrong (truncated, corrupt, other layout)."""
    nl = data.find(b"\n")
    if nl < 0:
        raise CheckpointError(f"truncated ({len(data)} bytes, no header line)")
    head = _head(data[:nl])
    split = _front_size(head, nl)
    if len(data) != split + head["state_bytes"] + 1 + _TRAILER:
        raise CheckpointError(f"payload is {len(data)} bytes, its header says "
                              f"{split + head['state_bytes'] + 1 + _TRAILER}: truncated or corrupt")
    view = memoryview(data)
    _check_crc(view[:split], "header/front")
    _check_crc(view[split:], "state")
    try:
        front = orjson.loads(view[nl + 1 : nl + 1 + head["front_bytes"]])
        state = orjson.loads(view[split : len(data) - _TRAILER - 1])
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed payload: {e}") from None
    return _checkpoint(head, front, state)


def read_front(f: Any) -> tuple[Checkpoint, int, int]:
    """Read and verify the header and front section from a binary file at offset 0.

    Returns the checkpoint (``state`` None), the offset of the state section and its length.
    """
    line = f.readline(1 << 20)
    if not line.endswith(b"\n"):
        raise CheckpointError(f"truncated ({len(line)} bytes, no header line)")
    head = _head(line[:-1])
    rest = f.read(head["front_bytes"] + 1 + _TRAILER)
    _check_crc(line + rest, "header/front")
    try:
        front = orjson.loads(memoryview(rest)[: head["front_bytes"]])
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed front section: {e}") from None
    offset, length = len(line) + len(rest), head["state_bytes"]
    size = os.fstat(f.fileno()).st_size
    if size != offset + length + 1 + _TRAILER:  # a truncated or extended state section, found without reading it
        raise CheckpointError(f"payload is {size} bytes, its header says {offset + length + 1 + _TRAILER}: "
                              "truncated or corrupt")
    return _checkpoint(head, front, None), offset, length


def read_state(f: Any, offset: int, length: int) -> dict[str, Any]:
    """Read, verify and parse the state section (``offset``/``length`` from :func:`read_front`)."""
    data = os.pread(f.fileno(), length + 1 + _TRAILER, offset)
    if len(data) != length + 1 + _TRAILER:
        raise CheckpointError(f"truncated state section ({len(data)} of {length + 1 + _TRAILER} bytes)")
    _check_crc(data, "state")
    try:
        state = orjson.loads(memoryview(data)[:length])
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed state section: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError("malformed state section: not an object")
    return state


# -- the front section (pure) ------------------------------------------------------------------------
def _clean_turn(message: dict[str, Any]) -> bool:
    return is_real_user_turn(message) and not has_result_blocks(message)


def _turns_back(messages: Any, i: int, turns: int, floor: int) -> int:
    """Start of the ``turns``-th clean user turn counting back from ``i`` (the turn holding ``i`` is the first)."""
    for t in range(turns):
        if t:
            i -= 1
        while i > floor and not _clean_turn(messages[i]):
            i -= 1
        if i <= floor:
            return floor
    return i


def _turns_ahead(messages: Any, i: int, turns: int, ceiling: int) -> int:
    """Index just before the ``turns``-th clean user turn after ``i`` (not above ``ceiling``)."""
    for _ in range(turns):
        i += 1
        while i < ceiling and not _clean_turn(messages[i]):
            i += 1
    return min(i, ceiling)


def _low_estimate(message: dict[str, Any]) -> int:
    """A deliberately low token estimate (JSON bytes / 6; English text runs at about 4 bytes a token): the
    newest-messages span then errs on the long side. Only its size depends on it, never a result."""
    return len(orjson.dumps(message)) // 6 + 1


class SystemIndex:
    """The indices of a projection's system/developer messages, rescanning only what was appended since.

    Keys increase strictly along the history, and only appends add items without giving every item a new
    key (``messages_replaced`` does), so finding the key last seen at the index last seen means the prefix up
    to it is unchanged; otherwise (a redaction, a replace, a clear) the whole history is scanned again.
    Without it, every checkpoint of a million-message session scanned them all on the event loop (~0.25 s).
    """

    __slots__ = ("scanned", "last_key", "found")

    def __init__(self) -> None:
        self.scanned = 0
        self.last_key: int | None = None
        self.found: list[int] = []

    def seed(self, state: Projection) -> None:
        """Take the indices a lazy history holds (it knows every system message), so that no checkpoint of
        this process scans the history, not even after the rest is loaded. Never loads anything."""
        messages, keys = state.messages, state.keys
        known = getattr(messages, "system_indices", None)
        n = len(messages)
        last = keys.get_known(n - 1) if n and isinstance(keys, LazyList) else None
        if known is not None and last is not None:
            self.found, self.scanned, self.last_key = list(known), n, last

    def of(self, state: Projection) -> list[int]:
        messages, keys = state.messages, state.keys
        n, start, found = len(messages), self.scanned, self.found
        if start > n or (start and keys[start - 1] != self.last_key):
            start, found = 0, []
        # (assigned only at the end: a read that fails, e.g. LoadRefused on a lazy history, changes nothing)
        found = found + [i for i in range(start, n) if is_system(messages[i])]
        self.found, self.scanned, self.last_key = found, n, (keys[n - 1] if n else None)
        return list(found)


def front_of(state: Projection, *, keep_head: int, recent_tokens: int,
             system: list[int] | None = None) -> dict[str, Any]:
    """The front section of a (loaded) projection: see the module docstring.

    Runs on the event loop when a checkpoint is taken, so it tokenises nothing (the newest-messages span is
    measured with the counts already known and a low estimate for the others) and does not scan the history:
    ``system`` comes from a :class:`SystemIndex` and pinned messages are found by bisection over the keys.
    """
    messages, keys, tokens = state.messages, state.keys, state.tokens
    n = len(messages)
    if system is None:
        system = SystemIndex().of(state)
    keep: set[int] = set(system)
    # The head: the first keep_head non-system messages and the first real user turn, then a few turns more.
    i, seen, first_user = 0, 0, False
    while i < n and (seen < keep_head or not first_user) and i < FRONT_MAX_SPAN:
        m = messages[i]
        if not is_system(m):
            seen += 1
            first_user = first_user or is_real_user_turn(m)
        i += 1
    # (+1: the message at which a turn search stopped is read by it, so a front recomputed from this front
    # alone, as a checkpoint of a still lazy history does, finds it in memory)
    keep.update(range(min(_turns_ahead(messages, i, FRONT_EXTRA_TURNS, min(n, FRONT_MAX_SPAN)) + 1, n)))
    # The newest messages up to recent_tokens, from a clean user turn a few turns back.
    acc, r = 0, n
    while r > 0 and acc < recent_tokens:
        r -= 1
        t = tokens[r]
        acc += t if t is not None else _low_estimate(messages[r])
    if r < n:  # (recent_tokens 0: no newest span at all)
        r = _turns_back(messages, r, FRONT_EXTRA_TURNS + 1, max(0, r - FRONT_MAX_SPAN))
    keep.update(range(r, n))
    # Pinned messages, with the turns around them (their tool groups).
    # Keys increase strictly along the history (see SystemIndex): bisection, over the keys in memory first
    # while the history is lazy (a bisection over the whole list would read, so load, unknown items).
    known = keys.known_indices() if type(keys) is LazyList and not keys.loaded else None
    for k in state.pinned:
        p = -1
        if known is not None:
            j = bisect.bisect_left(known, k, key=keys.get_known)
            if j < len(known) and keys.get_known(known[j]) == k:
                p = known[j]
        if p < 0:
            p = bisect.bisect_left(keys, k)
        if p < r and keys[p] == k:
            lo = _turns_back(messages, p, FRONT_EXTRA_TURNS + 1, max(0, p - FRONT_MAX_SPAN))
            hi = min(_turns_ahead(messages, p, FRONT_EXTRA_TURNS, min(n, p + FRONT_MAX_SPAN)) + 1, n)
            keep.update(range(lo, hi))
    idx = sorted(keep)
    return {
        "meta": {"pinned": sorted(state.pinned), "head_seq": state.head_seq, "has_history": state.has_history,
                 "session": state.session, "counts": state.counts},
        "n": n, "system": system, "idx": idx,
        "messages": [messages[j] for j in idx], "keys": [keys[j] for j in idx],
        "tokens": [tokens[j] for j in idx],
    }


def restore_front(cp: Checkpoint, tokenizer: Callable[[], str], loader: BaseLoader) -> Projection:
    """A lazy projection from ``cp.front``; ``loader()`` returns the whole state's lists when needed."""
    front = cp.front
    assert front is not None
    try:
        n, idx, msgs, keys, toks = front["n"], front["idx"], front["messages"], front["keys"], front["tokens"]
        system = front["system"]
        ok = (isinstance(n, int) and n >= 0 and len(idx) == len(msgs) == len(keys) == len(toks)
              and all(isinstance(i, int) and 0 <= i < n for i in idx)
              and all(isinstance(i, int) and 0 <= i < n for i in system)
              and all(isinstance(k, int) for k in keys) and all(isinstance(m, dict) for m in msgs))
        if not ok:
            raise CheckpointError("front section has inconsistent lists")
        if not all(t is None or (isinstance(t, int) and t >= 0) for t in toks):
            raise CheckpointError("front section holds token counts that are not non-negative integers")
        if any(t is not None for t in toks) and (cp.tokenizer is None or cp.tokenizer != tokenizer()):
            toks = [None] * len(toks)  # counted by another tokenizer: count again, lazily
        state = Projection.lazy(front["meta"], n, {i: (m, k, t) for i, m, k, t in zip(idx, msgs, keys, toks)},
                                system, loader)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"front section does not load: {type(e).__name__}: {e}") from None
    if state.head_seq != cp.seq:
        raise CheckpointError(f"front section is at seq {state.head_seq}, the header says {cp.seq}")
    return state


def mismatch(cp: Checkpoint, *, session_id: str) -> str | None:
    """Why ``cp`` does not belong to this session and program, or None if it does (pure)."""
    if cp.session_id != session_id:
        return f"it belongs to session {cp.session_id!r}, not {session_id!r}"
    if cp.format != codec.FORMAT_VERSION:
        return f"it was written for log format {cp.format}, this program reads format {codec.FORMAT_VERSION}"
    if cp.schema != SCHEMA:
        return "it was written for a different projection layout (another program version)"
    return None


def restore(cp: Checkpoint, tokenizer: Callable[[], str]) -> Projection:
    """The projection stored in ``cp``; token counts are kept only if ``tokenizer()`` is the one that counted."""
    if cp.state is None:
        raise CheckpointError("the state section was not read")
    try:
        state = Projection.from_state(cp.state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"state does not load: {type(e).__name__}: {e}") from None
    if state.head_seq != cp.state_seq:
        raise CheckpointError(f"state is at seq {state.head_seq}, the header says {cp.state_seq}")
    if not all(isinstance(k, int) for k in state.keys) or not all(isinstance(m, dict) for m in state.messages):
        raise CheckpointError("state holds keys that are not integers or messages that are not objects")
    counted = any(t is not None for t in state.tokens)
    if counted and (cp.tokenizer is None or cp.tokenizer != tokenizer()):
        state.tokens = [None] * len(state.tokens)  # counted by another tokenizer: count again, lazily
    elif not all(t is None or (isinstance(t, int) and t >= 0) for t in state.tokens):
        raise CheckpointError("state holds token counts that are not non-negative integers")
    return state


# -- where it is stored ------------------------------------------------------------------------------
@runtime_checkable
class CheckpointStore(Protocol):
    """Where a session's single checkpoint payload lives. Errors may be raised; callers log and go on."""

    async def load(self) -> bytes | None:
        """The stored payload, or None if there is none."""
        ...

    async def save(self, payload: bytes, seq: int) -> None:
        """Replace the stored payload atomically (a reader sees the old one or the new one, whole)."""
        ...

    async def discard(self) -> None:
        """Remove the stored payload (no error if there is none)."""
        ...


class FileCheckpointStore:
    """``<session>/checkpoint.json``: written to a temp file (0600), fsynced, renamed, folder fsynced."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / CHECKPOINT_NAME
        self.tmp = directory / (CHECKPOINT_NAME + ".tmp")

    async def load(self) -> bytes | None:
        return self.read_sync()

    def read_sync(self) -> bytes | None:
        """The stored payload, or None if there is none (CheckpointError: not a regular file)."""
        f = self._open()
        if f is None:
            return None
        with f:
            return f.read()  # type: ignore[no-any-return]

    def _open(self) -> Any:
        """The checkpoint file opened for reading, or None: never through a symlink, and only a regular file
        (a FIFO or a device in its place would block or never end; CheckpointError, so it is ignored)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{self.path} is a symbolic link; checkpoints are never read through "
                                      "one") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path} is not a regular file")
        return os.fdopen(fd, "rb")

    async def save(self, payload: bytes, seq: int) -> None:
        await asyncio.to_thread(self.save_sync, payload)

    def save_sync(self, payload: bytes) -> None:
        self._save(lambda fd: write_all(fd, payload))

    def save_copying(self, prefix: bytes, src: int, offset: int, count: int) -> int:
        """:meth:`save_sync` of ``prefix`` followed by ``count`` bytes of the open file ``src`` from ``offset``,
        copied by the kernel where it can (``copy_file_range``); closes ``src``. Returns the payload's size."""

        def write(fd: int) -> None:
            write_all(fd, prefix)
            done = 0
            while done < count:
                try:
                    n = os.copy_file_range(src, fd, count - done, offset + done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    n = -1
                if n < 0:  # (a file system or kernel without it: copy through memory, 1 MiB at a time)
                    chunk = os.pread(src, min(count - done, 1 << 20), offset + done)
                    write_all(fd, chunk)
                    n = len(chunk)
                if n == 0:
                    raise CheckpointError(f"the checkpoint copied from ended {count - done} bytes early")
                done += n

        try:
            self._save(write)
        finally:
            os.close(src)
        return len(prefix) + count

    def _save(self, write: Callable[[int], None]) -> None:
        # A fixed temp name is safe: only the lock holder writes checkpoints. A leftover (or a link planted in
        # its place) is removed, never written through: the file is created anew, without following symlinks.
        try:
            fd = create_private_file(self.tmp.parent, self.tmp.name)
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)

    def open_front(self) -> tuple[Checkpoint, Any, int, int] | None:
        """Read and verify only the header and front section: ``(checkpoint, open file, state offset, state
        length)``, or None if there is no checkpoint. The caller owns the file (it reads the state from it)."""
        f = self._open()
        if f is None:
            return None
        try:
            cp, offset, length = read_front(f)
            return cp, f, offset, length
        except BaseException:
            f.close()
            raise

    async def discard(self) -> None:
        self.discard_sync()

    def discard_sync(self) -> None:
        existed = self.path.exists()
        self.path.unlink(missing_ok=True)
        self.tmp.unlink(missing_ok=True)
        if existed:
            fsync_dir(self.path.parent)


def checkpoint_store_for(log: Any) -> CheckpointStore | None:
    """The checkpoint store of a log backend: its ``checkpoint_store`` attribute, a file beside a file log."""
    store = getattr(log, "checkpoint_store", None)
    if store is not None:
        return store  # type: ignore[no-any-return]
    directory = getattr(log, "directory", None)
    if isinstance(directory, Path):
        return FileCheckpointStore(directory)
    return None


async def first_record_crc(log: Any) -> str | None:
    """The checksum of the log's first record (its identity), reading only that record."""
    batches = log.read_batches(0, None, batch=1)
    try:
        async for batch in batches:
            if batch:
                return batch[0].get("crc")  # type: ignore[no-any-return]
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
    return None


def _counted(state: Projection) -> int:
    return len(state.tokens) - state.tokens.count(None)


# -- when (used by the manager) -----------------------------------------------------------------------
@dataclass(slots=True)
class _Prepared:
    """A checkpoint as read from the live state in the caller's turn (:meth:`Checkpointer._prepare`)."""

    seq: int
    position: int | None
    tokenizer: str | None
    last_crc: str | None
    captured: dict[str, Any] | None  #: the state to serialise, or None when the state section is copied
    front_json: bytes
    counted: int
    base: dict[str, Any] | None = None
    #: (descriptor of the checkpoint file, owned by the write; offset, length) of the state section to copy
    splice: tuple[int, int, int] | None = None

class Checkpointer:
    """Resumes a session from its checkpoint and writes new ones every ``every`` events and on close.

    At most one write is in flight; a failed write is logged and never affects the log or the caller.
    ``loaded_seq`` is the seq of the checkpoint used at open (0: full replay); ``ignored`` says why a
    stored checkpoint was not used; ``seq`` is the newest seq covered by a stored checkpoint.
    """

    def __init__(self, store: CheckpointStore | None, session_id: str, every: int, *, writable: bool) -> None:
        self.store = store
        self.session_id = session_id
        self.every = every
        self.writable = writable
        self.seq = 0
        self.position = 0  # log position covered by the stored checkpoint (when the backend has positions)
        self.loaded_seq = 0
        self.ignored: str | None = None
        self.first_crc: str | None = None
        self.counted = 0  # messages with a token count in the stored checkpoint
        #: Why the last checkpoint attempt failed (None once one succeeds): stats() shows it. A failed attempt
        #: is retried after another ``every`` events (``_failed_seq``), never on every append.
        self.error: str | None = None
        self._failed_seq = 0
        self._task: asyncio.Future[None] | None = None
        #: Set by the manager: ``() -> (keep_head, recent_tokens)`` for the front section; None: no front
        #: section is written (every open then loads the whole state).
        self.front_hints: Callable[[], tuple[int, int]] | None = None
        self._lazy_file: Any = None  # the checkpoint file the rest is read from (closed by close())
        #: While the history is lazy: (file, offset, length, checkpoint) of the state section not loaded yet,
        #: which a new checkpoint can copy instead of loading and serialising the whole history.
        self._lazy_source: tuple[Any, int, int, Checkpoint] | None = None
        self._system = SystemIndex()

    # -- loading --------------------------------------------------------------------------------------
    async def load(self, log: Any, tokenizer: Callable[[], str]) -> Projection:
        """Checkpoint + tail replay when a valid checkpoint exists, else a full replay."""
        cp, state = await self._usable(log, tokenizer)
        if cp is None or state is None:
            return await self._replay(log, Projection(), 0, None)
        if cp.base is not None and cp.state is not None:  # read whole: the state section is at the base
            tail = await self._replay(log, state, cp.base["seq"], cp.base["position"])
        else:
            tail = await self._replay(log, state, cp.seq, cp.position)
        if log.last_seq < cp.seq:  # the log ends before the checkpoint (a backend that cannot check the anchor)
            await self._reject(f"it is at seq {cp.seq} but the log ends at seq {log.last_seq}")
            return await self._replay(log, Projection(), 0, None)
        self.seq = self.loaded_seq = cp.seq
        self.position = cp.position if isinstance(cp.position, int) else 0
        self.first_crc = cp.first_crc
        if cp.state is None:  # lazy: the front section says how many counts the stored state holds
            counted = (cp.front or {}).get("counted")
            self.counted = counted if isinstance(counted, int) and cp.tokenizer == tokenizer() else 0
        else:
            self.counted = _counted(state)
        logger.debug("session %s: resumed from the checkpoint at seq %d, replayed %d newer events",
                     self.session_id, cp.seq, tail.head_seq - cp.seq)
        return tail

    async def _usable(self, log: Any, tokenizer: Callable[[], str]) -> tuple[Checkpoint | None, Projection | None]:
        """The stored checkpoint and its projection if it fits this session and log, else (None, None).

        A file checkpoint beside a file log is opened lazily: only its front section is read now (the
        projection holds the rest as :class:`LazyList`); other stores, and payloads without a front section,
        are read whole.
        """
        if self.store is None:
            return None, None
        from .log import FileEventLog

        opened: tuple[Checkpoint, Any, int, int] | None = None
        try:
            if isinstance(self.store, FileCheckpointStore) and isinstance(log, FileEventLog):
                opened = self.store.open_front()
                payload = None
                if opened is not None and opened[0].front is None:
                    opened[1].close()  # written without a front section: read it whole
                    opened = None
                    payload = await self.store.load()
            else:
                payload = await self.store.load()
        except OSError as e:
            logger.info("session %s: checkpoint unreadable (%s); replaying the whole log", self.session_id, e)
            return None, None
        except CheckpointError as e:
            await self._reject(str(e))
            return None, None
        if opened is None and payload is None:
            logger.debug("session %s: no checkpoint; replaying the whole log", self.session_id)
            return None, None
        try:
            if opened is not None:
                cp, f, offset, length = opened
                state_loader = functools.partial(self._load_rest, f, offset, length, cp, tokenizer, log)
            else:
                cp = decode(payload)  # type: ignore[arg-type]
            reason = mismatch(cp, session_id=self.session_id) or await self._anchor_mismatch(cp, log)
            if reason is None:
                if opened is None:
                    return cp, restore(cp, tokenizer)
                state = restore_front(cp, tokenizer, state_loader)
                self._system.seed(state)
                self._lazy_file = f
                self._lazy_source = (f, offset, length, cp)
                return cp, state
        except CheckpointError as e:
            reason = str(e)
        if opened is not None:
            opened[1].close()
        await self._reject(reason)
        return None, None

    def _load_rest(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                   log: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """The whole state of a lazily opened checkpoint: its state section, or, if that fails verification,
        the log replayed up to the checkpoint's seq (the log is the source of truth)."""
        gc_was_enabled = gc.isenabled()
        gc.disable()  # (as in the manager's open: millions of long-lived acyclic objects, nothing to collect)
        try:
            return self._read_rest(f, offset, length, cp, tokenizer, log)
        finally:
            self._lazy_source = None  # (the file is closed: a checkpoint can no longer copy its state section)
            if gc_was_enabled:
                gc.enable()

    def _read_rest(self, f: Any, offset: int, length: int, cp: Checkpoint, tokenizer: Callable[[], str],
                   log: Any) -> tuple[list[Any], list[Any], list[Any]]:
        try:
            try:
                state = restore(dataclasses.replace(cp, state=read_state(f, offset, length)), tokenizer)
            finally:
                f.close()
            if cp.base is not None:
                self._replay_from_base(log, state, cp)
            logger.debug("session %s: loaded the rest of the checkpoint at seq %d", self.session_id, cp.seq)
        except (CheckpointError, OSError, ValueError) as e:  # (ValueError: the file was closed by a failed try)
            self.ignored = f"state section: {e}"
            logger.warning("session %s: the checkpoint's state section cannot be used (%s); rebuilding the "
                           "history from the log instead", self.session_id, e)
            if self.writable and isinstance(self.store, FileCheckpointStore):
                try:
                    self.store.discard_sync()  # a cache we cannot use (the next checkpoint replaces it anyway)
                except OSError as err:
                    logger.info("session %s: could not remove the unusable checkpoint: %s", self.session_id, err)
            state = self._replay_sync(log, cp)
        return state.messages, state.keys, state.tokens

    def _replay_from_base(self, log: Any, state: Projection, cp: Checkpoint) -> None:
        """Bring a based checkpoint's state section (at ``cp.base``) to ``cp.seq`` with the log between."""
        from .log import scan

        assert cp.base is not None and isinstance(cp.position, int)
        for rec, _ in scan(log.path, cp.base["position"], None, cp.position):
            if rec["seq"] <= state.head_seq or rec["seq"] > cp.seq:
                raise CheckpointError(f"the log between the state section (seq {state.head_seq}) and the front "
                                      f"(seq {cp.seq}) holds seq {rec['seq']}")
            state.apply(rec)
        if state.head_seq != cp.seq:
            raise CheckpointError(f"the log from the state section's seq {cp.base['seq']} reaches seq "
                                  f"{state.head_seq}, the checkpoint is at seq {cp.seq}")

    def _replay_sync(self, log: Any, cp: Checkpoint) -> Projection:
        """The log folded up to ``cp``'s record (records verified as they are read)."""
        from .log import scan

        state = Projection()
        for rec, _ in scan(log.path, 0, 1, cp.position):
            if rec["seq"] > cp.seq:
                break
            state.apply(rec)
        if state.head_seq != cp.seq:
            raise CheckpointError(f"the log replayed to seq {state.head_seq}, the checkpoint is at seq {cp.seq}")
        return state

    async def _anchor_mismatch(self, cp: Checkpoint, log: Any) -> str | None:
        first = await first_record_crc(log)
        if first != cp.first_crc:
            return (f"its first-record fingerprint {cp.first_crc} does not match the log's ({first}): "
                    "it was written for another log under this session id")
        record_before = getattr(log, "record_before", None)
        if record_before is not None:
            if not isinstance(cp.position, int):
                return f"its position {cp.position!r} is not a byte offset"
            anchors = [(cp.seq, cp.position, cp.last_crc, "its")]
            if cp.base is not None:
                anchors.append((cp.base["seq"], cp.base["position"], cp.base["last_crc"], "its state section's"))
            for seq, position, crc, whose in anchors:
                rec = record_before(position)
                if rec is None or rec["seq"] != seq or rec.get("crc") != crc:
                    found = "no record" if rec is None else f"seq {rec['seq']} (crc {rec.get('crc')})"
                    return (f"the log does not hold {whose} seq {seq} (crc {crc}) at byte {position} "
                            f"(found {found}): the log is shorter or was rewritten")
        elif cp.base is not None:
            return "it is based on an older state section, which only a file log can bring up to date"
        return None

    async def _reject(self, reason: str) -> None:
        self.ignored = reason
        logger.info("session %s: ignoring the checkpoint: %s; replaying the whole log", self.session_id, reason)
        if self.writable and self.store is not None:
            try:
                await self.store.discard()  # a cache we cannot use: remove it so it is not read again
            except OSError as e:
                logger.info("session %s: could not remove the unusable checkpoint: %s", self.session_id, e)

    async def _replay(self, log: Any, state: Projection, after_seq: int, position: int | None) -> Projection:
        apply = state.apply
        async for batch in log.read_batches(after_seq, position):
            if after_seq == 0 and batch and self.first_crc is None:
                self.first_crc = batch[0].get("crc")
            for rec in batch:
                apply(rec)
        return state

    # -- writing --------------------------------------------------------------------------------------
    def maybe_write(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        """After an append: start a background write if ``every`` events are not covered and none is running."""
        if (self._task is not None or not self.writable or self.store is None
                or state.head_seq - max(self.seq, self._failed_seq) < self.every):
            return
        try:
            prep = self._prepare(state, log, tokenizer)
        except Exception as e:  # the record is durable: a cache that cannot be written must not fail its append
            self._failed(state.head_seq, e)
            return
        self._task = asyncio.ensure_future(self._write(prep, log))

    def _failed(self, seq: int, error: Exception) -> None:
        self.error = f"seq {seq}: {type(error).__name__}: {error}"
        self._failed_seq = seq
        logger.warning("session %s: could not write a checkpoint at seq %d (%s); the log is unaffected, the next "
                       "open replays more of it, and another attempt follows after %d more events",
                       self.session_id, seq, error, self.every)

    async def close(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        """Wait for a write in flight, then write a final checkpoint if enough events (or token counts) are
        not covered yet."""
        try:
            await self._close(state, log, tokenizer)
        finally:
            if self._lazy_file is not None:
                self._lazy_file.close()

    async def _close(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)
        if not self.writable or self.store is None or state.head_seq == 0:
            return
        try:
            await self._close_write(state, log, tokenizer)
        except Exception as e:  # a cache: closing the log must not fail for it
            self._failed(state.head_seq, e)

    async def _close_write(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        enough = min(self.every, CLOSE_MIN_EVENTS)
        grown = log.position - self.position if isinstance(log.position, int) else 0
        if state.is_lazy:
            # Counting tokens would load the history: the rule is events and bytes. A checkpoint that cannot
            # copy the state section would load and write it all, which only a long uncovered tail is worth.
            if self._splice_base(state, tokenizer) is None:
                enough, grown = self.every, 0
            if state.head_seq - self.seq >= enough or grown >= CLOSE_MIN_BYTES:
                await self._write(self._prepare(state, log, tokenizer), log)
            return
        if (state.head_seq - self.seq >= enough or _counted(state) - self.counted >= enough
                or grown >= CLOSE_MIN_BYTES):
            await self._write(self._prepare(state, log, tokenizer), log)

    def _splice_base(self, state: Projection, tokenizer: Callable[[], str]) -> dict[str, Any] | None:
        """The base a new checkpoint of this lazy history can copy its state section from, or None.

        Possible while the state section opened lazily is still on disk (not loaded), its token counts were
        made by the current tokenizer (or it holds none), and the log since its seq is short enough."""
        source = self._lazy_source
        if source is None or not state.is_lazy or not isinstance(self.store, FileCheckpointStore):
            return None
        cp = source[3]
        if not isinstance(cp.position, int) or cp.last_crc is None:
            return None
        if cp.tokenizer is not None and cp.tokenizer != tokenizer():  # (no name asked, no encoding loaded, else)
            return None
        base = cp.base or {"seq": cp.seq, "position": cp.position, "last_crc": cp.last_crc}
        if state.head_seq - base["seq"] > BASE_MAX_FACTOR * self.every:
            return None
        return dict(base)

    def _prepare(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> _Prepared:
        """What must be read from the live state now (this runs in the caller's turn; the rest is in the
        background): the anchor, the front section and either the captured state (serialised later, in steps)
        or, for a history still lazy, the state section to copy from the checkpoint it was opened from."""
        last = getattr(log, "record_before", None)
        position = log.position
        last_crc = None
        if last is not None:
            rec = last(position)
            last_crc = rec.get("crc") if rec is not None and rec["seq"] == state.head_seq else None
        base = self._splice_base(state, tokenizer) if self.front_hints is not None else None
        if base is not None and last_crc is not None:
            try:
                with state.loads_refused():  # only what is in memory: else load it all (below)
                    front, front_counts = self._front(state, counted=self.counted)
            except LoadRefused:
                pass
            else:
                assert self._lazy_source is not None
                f, offset, length, source = self._lazy_source
                # The counts in the copied section were made by source.tokenizer (checked: the current one).
                name = tokenizer() if source.tokenizer is not None or front_counts else None
                try:
                    # Our own descriptor, taken now: a read of the rest (get_messages) before the background
                    # write runs closes the file the section is copied from.
                    src = os.dup(f.fileno())
                except (OSError, ValueError):
                    pass  # (no descriptor left): capture the whole state instead, below
                else:
                    return _Prepared(state.head_seq, position, name, last_crc, None, front, self.counted, base,
                                     (src, offset, length))
        state.materialise()
        counted = _counted(state)
        front_json = b"null"
        if self.front_hints is not None and isinstance(self.store, FileCheckpointStore):  # (read lazily only there)
            front_json = self._front(state, counted=counted)[0]
        return _Prepared(state.head_seq, position, tokenizer() if counted else None, last_crc, state.capture(),
                         front_json, counted)

    def _front(self, state: Projection, *, counted: int) -> tuple[bytes, bool]:
        """The front section's JSON, and whether it holds any token count."""
        assert self.front_hints is not None
        keep_head, recent_tokens = self.front_hints()
        front = front_of(state, keep_head=keep_head, recent_tokens=recent_tokens, system=self._system.of(state))
        front["counted"] = counted
        return orjson.dumps(front), any(t is not None for t in front["tokens"])

    async def _write(self, prep: _Prepared, log: Any) -> None:
        store = self.store
        assert store is not None
        seq = prep.seq
        splice = prep.splice
        try:
            if self.first_crc is None:
                self.first_crc = await first_record_crc(log)
            fields = dict(session_id=self.session_id, seq=seq, position=prep.position, first_crc=self.first_crc,
                          last_crc=prep.last_crc, tokenizer=prep.tokenizer, front_json=prep.front_json,
                          base=prep.base)
            if splice is not None:
                src, offset, length = splice
                assert isinstance(store, FileCheckpointStore)
                prefix = encode_front(state_bytes=length, **fields)  # type: ignore[arg-type]
                splice = None  # save_copying closes src
                size = await asyncio.to_thread(store.save_copying, prefix, src, offset, length + 1 + _TRAILER)
            else:
                assert prep.captured is not None
                state_json = await dump_in_steps(prep.captured)
                prep.captured = None  # (the copies of the lists are not needed any more)
                framing = functools.partial(encode, state_json=state_json, **fields)  # type: ignore[arg-type]
                large = sum(map(len, state_json)) >= _THREAD_MIN
                payload = await asyncio.to_thread(framing) if large else framing()
                await store.save(payload, seq)
                size = len(payload)
            if seq >= self.seq:
                self.seq = seq
                self.position = prep.position if isinstance(prep.position, int) else 0
            self.counted = prep.counted
            logger.debug("session %s: checkpoint written at seq %d (%d bytes%s)", self.session_id, seq, size,
                         "" if prep.base is None else f", state section of seq {prep.base['seq']} copied")
        except Exception as e:  # a checkpoint is a cache: never let it break the store
            self._failed(seq, e)
        else:
            self.error = None
        finally:
            if splice is not None:  # (failed before the copy began)
                os.close(splice[0])
            self._task = None
