"""The checkpoint payload (pure): serialise a projection, frame it with a header and CRCs, verify and parse it,
and decide whether it fits a session (layout in the package docstring, :mod:`context_persistent.storage.checkpoint`)."""

from __future__ import annotations

import asyncio
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ...model import json_lossless
from ...model import codec
from ..paths import CHECKPOINT_BASE_NAME
from ...model.projection import Counts, PagedList, Projection, Refs, json_default, raw_items

#: Version of the payload layout above; a version not in ``READABLE_VERSIONS`` is ignored. Version 3 added
#: ``base`` (a state section older than the front); version 2 payloads read the same without it.
CHECKPOINT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
#: The projection layout a payload was written for: a new field invalidates old checkpoints by itself. (The
#: pager is where messages are read from, not state. The fields are slots of Projection's base, model/fold.py.)
SCHEMA = sorted(s for c in Projection.__mro__ for s in getattr(c, "__slots__", ()) if s != "pager")
#: List items (messages, keys, token counts) serialised per step of a background checkpoint write.
DUMP_STEP = 16_384
_TRAILER = 9  # 8 hex digits + newline


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
    #: None: the state section follows the front. Else ``{"file", "offset", "crc"}``: it is in that earlier
    #: checkpoint file of the session folder (``checkpoint.base``), at ``offset``, its CRC line ``crc``.
    state_in: dict[str, Any] | None = None

    @property
    def state_seq(self) -> int:
        """The seq the state section is at."""
        return self.seq if self.base is None else int(self.base["seq"])


def snapshot(state: Projection) -> bytes:
    """The projection state as JSON bytes, in one ``orjson.dumps`` call (O(state))."""
    return json_lossless.dumps(state.to_state(refs=True), default=json_default)


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
        packed = type(items) is not list
        for start in range(0, len(items), step):
            if start:
                parts.append(b",")
                await asyncio.sleep(0)
            piece = items[start:start + step]
            parts.append(json_lossless.dumps(piece.tolist() if packed and type(piece) is not list else piece)[1:-1])
        parts.append(b"],")
    rest = {k: v for k, v in captured.items() if k not in ("messages", "keys", "tokens")}
    parts.append(json_lossless.dumps(rest)[1:])  # (the facts, without their opening brace)
    return parts


def encode_front(*, session_id: str, seq: int, position: int | None, first_crc: str | None,
                 last_crc: str | None, tokenizer: str | None, state_bytes: int, front_json: bytes = b"null",
                 base: dict[str, Any] | None = None, state_in: dict[str, Any] | None = None) -> bytes:
    """The header line, the front section and its CRC line: what precedes a state section of
    ``state_bytes`` bytes (the section and its own CRC line follow)."""
    header = json_lossless.dumps({
        "checkpoint": CHECKPOINT_VERSION, "format": codec.FORMAT_VERSION, "schema": SCHEMA,
        "session_id": session_id, "seq": seq, "position": position, "first_crc": first_crc,
        "last_crc": last_crc, "tokenizer": tokenizer, "front_bytes": len(front_json), "state_bytes": state_bytes,
        "base": base, **({"state_in": state_in} if state_in is not None else {}),
    })
    crc1 = zlib.crc32(b"\n", zlib.crc32(front_json, zlib.crc32(header + b"\n")))
    return b"".join((header, b"\n", front_json, b"\n", b"%08x\n" % crc1))


def encode(*, session_id: str, seq: int, position: int | None, first_crc: str | None, last_crc: str | None,
           tokenizer: str | None, state_json: bytes | list[bytes], front_json: bytes = b"null",
           base: dict[str, Any] | None = None) -> bytes:
    """Frame a state snapshot (and its front section) into a self-checking payload (package docstring).

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
        head = json_lossless.loads(line)
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
                        base=head.get("base"), state_in=head.get("state_in"))
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
    where = cp.state_in
    if where is not None and not (
            cp.base is not None and isinstance(where, dict) and where.get("file") == CHECKPOINT_BASE_NAME
            and type(where.get("offset")) is int and where["offset"] > 0 and isinstance(where.get("crc"), str)
            and len(where["crc"]) == 8):
        raise CheckpointError(f"malformed payload: state_in {where!r} (only a based checkpoint names a state "
                              f"section in {CHECKPOINT_BASE_NAME})")
    if front is not None and not isinstance(front, dict):
        raise CheckpointError("malformed payload: the front section is not an object")
    return cp


def _front_size(head: dict[str, Any], nl: int) -> int:
    """Bytes from the start of the payload to the end of the front section's trailer."""
    return nl + 1 + head["front_bytes"] + 1 + _TRAILER


def decode(data: bytes, packed: bool = False) -> Checkpoint:
    """Verify and parse a whole payload; CheckpointError says what is wrong (truncated, corrupt, other layout).
    ``packed``: the state's lists as :func:`parse_state` gives them (to restore a long history), else plain JSON."""
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
    where = head.get("state_in")
    if isinstance(where, dict) and bytes(view[-_TRAILER:-1]) != str(where.get("crc")).encode():
        raise CheckpointError(f"the state section in {CHECKPOINT_BASE_NAME} is not the one the checkpoint names "
                              f"(CRC {bytes(view[-_TRAILER:-1]).decode('ascii', 'replace')}, expected "
                              f"{where.get('crc')})")
    try:
        front = json_lossless.loads(view[nl + 1 : nl + 1 + head["front_bytes"]])
        state = (parse_state(data, split, len(data) - _TRAILER - 1) if packed
                 else json_lossless.loads(view[split : len(data) - _TRAILER - 1]))
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed payload: {e}") from None
    return _checkpoint(head, front, state)




#: Bytes of a stored list parsed per piece by :func:`parse_state`.
_PIECE = 1 << 20
_DIGITS = b"0123456789,"


def _ints(buf: bytes, start: int, end: int, nulls: bool) -> "array[int]":
    """The items of the JSON list of non-negative integers (and ``null``, read as -1, where ``nulls``) between
    ``start`` and ``end``, parsed a piece at a time into an ``array('q')``; ValueError for anything else."""
    out = array("q")
    allowed = _DIGITS + b"nul" if nulls else _DIGITS
    while start < end:
        stop = end
        if end - start > _PIECE:
            stop = buf.rfind(b",", start, start + _PIECE)
            if stop <= start:
                stop = end
        piece = buf[start:stop]
        if piece.translate(None, allowed):
            raise ValueError("not a list of non-negative integers")
        out.extend(array("q", map(int, (piece.replace(b"null", b"-1") if nulls else piece).split(b","))))
        start = stop + 1
    return out


def parse_state(buf: bytes, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """The state section ``buf[start:end]`` (verified) parsed into a state dict: the lists of a paged history
    (refs, keys, token counts: integers and nulls) straight into packed lists, a piece at a time, so that
    loading a long history never holds them as Python objects (24 bytes a message instead of about 120); any
    other state (messages stored whole, placeholders' negative keys, anything unexpected) is parsed as plain
    JSON (CheckpointError if malformed)."""
    end = len(buf) if end is None else end
    heads = (b'{"messages":[', b'],"keys":[', b'],"tokens":[', b'],')
    try:
        if not buf.startswith(heads[0], start, end):
            raise ValueError("another layout")
        pos = start + len(heads[0])
        lists = []
        for i, follow in enumerate(heads[1:]):
            stop = buf.index(b"]", pos, end)
            lists.append(_ints(buf, pos, stop, nulls=i == 2))
            if not buf.startswith(follow, stop, end):
                raise ValueError("another layout")
            pos = stop + len(follow)
        facts = json_lossless.loads(b"{" + buf[pos:end])
        if not isinstance(facts, dict):
            raise ValueError("another layout")
    except (ValueError, OverflowError):  # (orjson.JSONDecodeError too) another shape: parsed whole, as stored
        try:
            state = json_lossless.loads(memoryview(buf)[start:end])
        except orjson.JSONDecodeError as e:
            raise CheckpointError(f"malformed state section: {e}") from None
        if not isinstance(state, dict):
            raise CheckpointError("malformed state section: not an object")
        return state  # type: ignore[no-any-return]
    refs, tokens = Refs(), Counts()
    refs.a, tokens.a = lists[0], lists[2]
    return {"messages": refs, "keys": lists[1], "tokens": tokens, **facts}


def mismatch(cp: Checkpoint, *, session_id: str) -> str | None:
    """Why ``cp`` does not belong to this session and program, or None if it does (pure)."""
    if cp.session_id != session_id:
        return f"it belongs to session {cp.session_id!r}, not {session_id!r}"
    if cp.format != codec.FORMAT_VERSION:
        return f"it was written for log format {cp.format}, this program reads format {codec.FORMAT_VERSION}"
    if cp.schema != SCHEMA:
        return "it was written for a different projection layout (another program version)"
    return None


def restore(cp: Checkpoint, tokenizer: Callable[[], str], pager: Any = None) -> Projection:
    """The projection stored in ``cp``; token counts are kept only if ``tokenizer()`` is the one that counted.

    Messages stored as refs to the log (ints, layout 4) are read through ``pager``; without one such a state
    cannot be used. A pager whose refs are the messages' keys (PostgreSQL) gets every message as a ref, stored
    inline or not."""
    raw = cp.state
    if raw is None:
        raise CheckpointError("the state section was not read")
    # (checked as stored, before the lists are packed: a packed list holds ints only)
    keys, items, tokens = raw.get("keys"), raw.get("messages"), raw.get("tokens")
    if isinstance(keys, list) and isinstance(items, list) and isinstance(tokens, list):
        if not all(type(k) is int for k in keys) or not all(type(m) is dict or type(m) is int and m >= 0
                                                            for m in items):
            raise CheckpointError("state holds keys that are not integers or messages that are neither objects "
                                  "nor references to the log")
        if pager is None and any(type(m) is int for m in items):
            raise CheckpointError("state refers to messages by their place in the log, which only the log it "
                                  "was written beside can resolve")
        if not all(t is None or (isinstance(t, int) and t >= 0) for t in tokens):
            raise CheckpointError("state holds token counts that are not non-negative integers")
    elif pager is None and type(items) is Refs and len(items):  # (parse_state: every item a ref)
        raise CheckpointError("state refers to messages by their place in the log, which only the log it "
                              "was written beside can resolve")
    try:
        state = Projection.from_state(raw, pager)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"state does not load: {type(e).__name__}: {e}") from None
    if state.head_seq != cp.state_seq:
        raise CheckpointError(f"state is at seq {state.head_seq}, the header says {cp.state_seq}")
    if getattr(pager, "refs_are_keys", False):  # (PostgreSQL: a message's ref is its key, pg/pages.py)
        if any(k < 0 or type(m) is int and m != k for m, k in zip(raw_items(state.messages), state.keys)):
            raise CheckpointError("state refers to messages by refs that are not their keys")
        # A state written with the messages (before refs) is read as refs too: its history holds no message.
        state.messages = PagedList(Refs(state.keys), pager)  # type: ignore[assignment]
    if state.tokens.count(None) != len(state.tokens) and (cp.tokenizer is None or cp.tokenizer != tokenizer()):
        state.tokens = Counts.none(len(state.tokens))  # counted by another tokenizer: count again, lazily
    return state

