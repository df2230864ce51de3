"""The checkpoint payload (pure): serialise a projection, frame it with a header and CRCs, verify and parse it,
and decide whether it fits a session (layout in the package docstring, :mod:`context_persistent.storage.checkpoint`)."""

from __future__ import annotations

import asyncio
import zlib
from array import array
from collections.abc import Callable
from typing import Any

import orjson

from ...model import json_lossless
from ...model import codec
from ..paths import CHECKPOINT_BASE_NAME
from ...model.projection import Counts, PagedList, Projection, Refs, json_default, raw_items
from ...model.values import Frozen, set_field as _set, replace

#: Version of the payload layout above; a version not in ``READABLE_VERSIONS`` is ignored. Version 3 added
#: ``base`` (a state section older than the front); version 2 payloads read the same without it. Version 5 added
#: the message section (``messages_bytes``); version 4 payloads read the same without it. Version 6 may write
#: the front section *whole* (``"whole": true``, no messages: front.slim_front) beside a message section;
#: version 5 payloads read the same (their fronts never are).
CHECKPOINT_VERSION = 6
READABLE_VERSIONS = (2, 3, 4, 5, 6)
#: The projection layout a payload was written for: a new field invalidates old checkpoints by itself. (The
#: pager is where messages are read from, not state. The fields are slots of Projection's base, model/fold.py.)
SCHEMA = sorted(s for c in Projection.__mro__ for s in getattr(c, "__slots__", ()) if s != "pager")
#: List items (messages, keys, token counts) serialised per step of a background checkpoint write.
DUMP_STEP = 16_384
#: Messages of the message section serialised per step (their contents: a step of 300-byte messages is about
#: 0.6 MB, a few milliseconds of the event loop).
MESSAGE_STEP = 2048
_TRAILER = 9  # 8 hex digits + newline


class CheckpointError(ValueError):
    """A payload cannot be used; the message says why (it is then ignored, never fatal)."""


class Checkpoint(Frozen):
    """A decoded payload: identity, the position after ``seq`` and the projection state at ``seq``."""

    __slots__ = ("session_id", "seq", "position", "first_crc", "last_crc", "tokenizer", "format", "schema", "state",
                 "front", "base", "state_in", "messages_bytes", "messages_section")
    session_id: str
    seq: int
    position: int | None
    first_crc: str | None
    last_crc: str | None
    tokenizer: str | None
    format: int
    schema: list[str]
    state: dict[str, Any] | None  #: None when only the front was read (:func:`read_front`)
    front: dict[str, Any] | None
    #: None: the state section is at ``seq``. Else ``{"seq", "position", "last_crc"}`` of the older record the
    #: state section is at; the log from there up to ``position`` brings it to ``seq`` (a "based" checkpoint).
    base: dict[str, Any] | None
    #: None: the state section follows the front. Else ``{"file", "offset", "crc"}``: it is in that earlier
    #: checkpoint file of the session folder (``checkpoint.base``), at ``offset``, its CRC line ``crc``.
    state_in: dict[str, Any] | None
    #: Length of the message section that follows the state section (wherever that is), 0 if there is none.
    messages_bytes: int
    #: The message section with its trailer, as :func:`decode` found it (not verified yet: :func:`parse_messages`),
    #: or None (none, or not read).
    messages_section: bytes | memoryview | None

    def __init__(self, session_id: str, seq: int, position: int | None, first_crc: str | None, last_crc: str | None,
                 tokenizer: str | None, format: int, schema: list[str], state: dict[str, Any] | None,
                 front: dict[str, Any] | None = None, base: dict[str, Any] | None = None,
                 state_in: dict[str, Any] | None = None, messages_bytes: int = 0,
                 messages_section: bytes | memoryview | None = None) -> None:
        _set(self, "session_id", session_id)
        _set(self, "seq", seq)
        _set(self, "position", position)
        _set(self, "first_crc", first_crc)
        _set(self, "last_crc", last_crc)
        _set(self, "tokenizer", tokenizer)
        _set(self, "format", format)
        _set(self, "schema", schema)
        _set(self, "state", state)
        _set(self, "front", front)
        _set(self, "base", base)
        _set(self, "state_in", state_in)
        _set(self, "messages_bytes", messages_bytes)
        _set(self, "messages_section", messages_section)

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
                 base: dict[str, Any] | None = None, state_in: dict[str, Any] | None = None,
                 messages_bytes: int = 0) -> bytes:
    """The header line, the front section and its CRC line: what precedes a state section of
    ``state_bytes`` bytes (the section and its own CRC line follow, then the message section of
    ``messages_bytes`` bytes and its CRC line, if any)."""
    header = json_lossless.dumps({
        "checkpoint": CHECKPOINT_VERSION, "format": codec.FORMAT_VERSION, "schema": SCHEMA,
        "session_id": session_id, "seq": seq, "position": position, "first_crc": first_crc,
        "last_crc": last_crc, "tokenizer": tokenizer, "front_bytes": len(front_json), "state_bytes": state_bytes,
        "base": base, **({"state_in": state_in} if state_in is not None else {}),
        **({"messages_bytes": messages_bytes} if messages_bytes else {}),
    })
    crc1 = zlib.crc32(b"\n", zlib.crc32(front_json, zlib.crc32(header + b"\n")))
    return b"".join((header, b"\n", front_json, b"\n", b"%08x\n" % crc1))


def encode(*, session_id: str, seq: int, position: int | None, first_crc: str | None, last_crc: str | None,
           tokenizer: str | None, state_json: bytes | list[bytes], front_json: bytes = b"null",
           base: dict[str, Any] | None = None, messages_json: list[bytes] | None = None) -> bytes:
    """Frame a state snapshot (and its front section) into a self-checking payload (package docstring).

    ``state_json``: the state's JSON, or the pieces :func:`dump_in_steps` returns (joined here, once).
    ``messages_json``: the message section's pieces (:func:`dump_messages`), or None for none."""
    parts = [state_json] if isinstance(state_json, bytes) else state_json
    messages = messages_json or []
    prefix = encode_front(session_id=session_id, seq=seq, position=position, first_crc=first_crc,
                          last_crc=last_crc, tokenizer=tokenizer, state_bytes=sum(map(len, parts)),
                          front_json=front_json, base=base, messages_bytes=sum(map(len, messages)))
    tail = [b"\n", b"%08x\n" % _crc_of(parts)]
    if messages:
        tail += [*messages, b"\n", b"%08x\n" % _crc_of(messages)]
    return b"".join((prefix, *parts, *tail))  # one copy of the state


def _crc_of(parts: list[bytes]) -> int:
    """CRC-32 of the concatenation of ``parts`` and a newline (a section and the newline that ends it)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return zlib.crc32(b"\n", crc)


async def dump_messages(items: Any, cached: Callable[[list[int]], list[Any] | None], limit: int,
                        step: int | None = None) -> list[bytes] | None:
    """The message section of a captured history (``items``: its refs, a :class:`Refs`), serialised ``step``
    messages at a time with the event loop free between steps: JSON arrays, one line per step (newline
    separated), together holding for each item the message its ref names as ``cached(refs)`` gives it (the
    pager's cache, never the log), or null for an item that is not a ref (the state section holds it whole).
    Lines let a reader parse it a piece at a time (:func:`parse_messages`). None when the cache misses one of
    them (the history is not all in memory: it is read from the log after an open) or the section would pass
    ``limit`` bytes."""
    step = step or MESSAGE_STEP
    packed = items.a if type(items) is Refs else array("q", [v if type(v) is int else -1 for v in items])
    parts: list[bytes] = []
    size = -1
    for start in range(0, len(packed), step):
        if start:
            await asyncio.sleep(0)
        piece = packed[start:start + step].tolist()
        if min(piece) < 0:  # (an item that is not a ref: null in the section)
            refs = [v for v in piece if v >= 0]
            got = cached(refs)
            if got is None:
                return None
            it = iter(got)
            values: list[Any] = [next(it) if v >= 0 else None for v in piece]
        else:
            values = cached(piece)  # type: ignore[assignment]
            if values is None:
                return None
        chunk = json_lossless.dumps(values)
        size += len(chunk) + 1
        if size > limit:
            return None
        parts.append(b"\n" + chunk if start else chunk)
    return parts


def parse_messages(read: Callable[[int, int], bytes], start: int, length: int, n: int) -> list[Any]:
    """Verify and parse a message section of ``length`` bytes at ``start`` (``read(offset, count)`` reads it)
    for a state of ``n`` messages: newline-separated JSON arrays holding ``n`` items in all, each a message (an
    object) or null. Read and parsed a piece (``_PIECE``) at a time, so that loading it never holds the whole
    section's bytes beside its messages; its CRC line is checked before anything is returned (CheckpointError:
    damaged or malformed; the caller reads the messages from the log instead and says so). A ``read`` with an
    ``into(offset, buffer) -> count`` (a file's: store.message_reader) reads every piece into one buffer."""
    into = getattr(read, "into", None)
    items, crc, malformed = _pieces(read, start, length) if into is None else _pieces_into(into, start, length)
    trailer = read(start + length, 1 + _TRAILER)
    got = b"\n%08x\n" % zlib.crc32(b"\n", crc)
    if trailer != got:
        if len(trailer) != 1 + _TRAILER or trailer[:1] != b"\n" or trailer[-1:] != b"\n":
            raise CheckpointError(f"truncated message section (its trailer is {trailer!r})")
        raise CheckpointError(f"message section checksum mismatch (stored {trailer[1:-1].decode('ascii', 'replace')}, "
                              f"computed {got[1:-1].decode()}): truncated or corrupt")
    if malformed is not None:
        raise CheckpointError(f"malformed message section: {malformed}")
    if len(items) != n:
        raise CheckpointError(f"malformed message section: {len(items)} items for a state of {n} messages")
    if not set(map(type, items)) <= {dict, type(None)}:
        raise CheckpointError("malformed message section: an item is neither a message nor null")
    return items


def _lines(data: Any, view: memoryview, cut: int, items: list[Any]) -> None:
    """Parse the lines of ``data`` before ``cut`` where they lie (``view``: a view of it), into ``items``."""
    at = 0
    while True:
        nl = data.find(b"\n", at, cut)
        part = json_lossless.loads(view[at:cut if nl < 0 else nl])
        if type(part) is not list:
            raise ValueError(f"a line holds {type(part).__name__}, not an array")
        items.extend(part)
        if nl < 0:
            return
        at = nl + 1


def _pieces(read: Callable[[int, int], bytes], start: int, length: int) -> tuple[list[Any], int, str | None]:
    """:func:`parse_messages`' read: ``(items, CRC-32 of the section, why it is malformed or None)``."""
    items: list[Any] = []
    crc, pos = 0, 0
    pending = bytearray()  # (the start of a line not complete yet)
    malformed: str | None = None
    while pos < length:
        block = read(start + pos, min(_PIECE, length - pos))
        if not block:
            raise CheckpointError(f"truncated message section ({pos} of {length} bytes)")
        pos += len(block)
        crc = zlib.crc32(block, crc)
        if malformed is not None:
            continue  # (the rest only for the checksum: a damaged section is reported as damaged)
        if pending:
            pending += block
            data: Any = pending
        else:
            data = block
        cut = data.rfind(b"\n") if pos < length else len(data)
        if cut < 0:
            if data is block:
                pending += block
            continue
        try:  # (each line parsed where it lies: no copy of the piece split into lines)
            with memoryview(data) as view:
                _lines(data, view, cut, items)
                pending = bytearray(view[cut + 1:])
        except (orjson.JSONDecodeError, ValueError) as e:
            malformed, items, pending = str(e), [], bytearray()
    return items, crc, malformed


def _pieces_into(into: Callable[[int, memoryview], int], start: int, length: int
                 ) -> tuple[list[Any], int, str | None]:
    """:func:`_pieces` reading every piece into one buffer, after the start of a line not complete yet (moved to
    the buffer's front; a line longer than a piece grows it): no new bytes object per piece."""
    items: list[Any] = []
    crc, pos, held = 0, 0, 0
    malformed: str | None = None
    buf = bytearray(min(_PIECE, length))
    while pos < length:
        want = min(_PIECE, length - pos)
        if held + want > len(buf):
            buf.extend(bytes(held + want - len(buf)))
        with memoryview(buf) as view:
            got = into(start + pos, view[held:held + want])
            if got <= 0:
                raise CheckpointError(f"truncated message section ({pos} of {length} bytes)")
            crc = zlib.crc32(view[held:held + got], crc)
            pos += got
            if malformed is not None:
                continue  # (the rest only for the checksum: a damaged section is reported as damaged)
            end = held + got
            cut = buf.rfind(b"\n", held, end) if pos < length else end
            if cut < 0:
                held = end
                continue
            try:
                _lines(buf, view, cut, items)
            except (orjson.JSONDecodeError, ValueError) as e:
                malformed, items, held = str(e), [], 0
                continue
            held = end - cut - 1 if pos < length else 0
            if held:
                view[:held] = view[cut + 1:end]
    return items, crc, malformed


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
    messages = head.get("messages_bytes", 0)
    if type(messages) is not int or messages < 0:
        raise CheckpointError(f"malformed header: messages_bytes {messages!r}")
    return head


def section_tail(head: dict[str, Any]) -> int:
    """Bytes from the start of the state section to the end of the payload: the state section and its CRC
    line, then the message section and its CRC line if there is one."""
    messages = head.get("messages_bytes", 0)
    return head["state_bytes"] + 1 + _TRAILER + (messages + 1 + _TRAILER if messages else 0)


def _checkpoint(head: dict[str, Any], front: Any, state: Any) -> Checkpoint:
    try:
        cp = Checkpoint(session_id=head["session_id"], seq=head["seq"], position=head["position"],
                        first_crc=head["first_crc"], last_crc=head["last_crc"], tokenizer=head["tokenizer"],
                        format=head["format"], schema=head["schema"], state=state, front=front,
                        base=head.get("base"), state_in=head.get("state_in"),
                        messages_bytes=head.get("messages_bytes", 0))
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
    if len(data) != split + section_tail(head):
        raise CheckpointError(f"payload is {len(data)} bytes, its header says "
                              f"{split + section_tail(head)}: truncated or corrupt")
    view = memoryview(data)
    end = split + head["state_bytes"] + 1 + _TRAILER  # (the state section's end: the message section follows)
    _check_crc(view[:split], "header/front")
    _check_crc(view[split:end], "state")
    where = head.get("state_in")
    if isinstance(where, dict) and bytes(view[end - _TRAILER:end - 1]) != str(where.get("crc")).encode():
        raise CheckpointError(f"the state section in {CHECKPOINT_BASE_NAME} is not the one the checkpoint names "
                              f"(CRC {bytes(view[end - _TRAILER:end - 1]).decode('ascii', 'replace')}, expected "
                              f"{where.get('crc')})")
    try:
        front = json_lossless.loads(view[nl + 1 : nl + 1 + head["front_bytes"]])
        state = (parse_state(data, split, end - _TRAILER - 1) if packed
                 else json_lossless.loads(view[split : end - _TRAILER - 1]))
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"malformed payload: {e}") from None
    cp = _checkpoint(head, front, state)
    if cp.messages_bytes:  # (verified when used: a damaged message section costs only itself, parse_messages)
        cp = replace(cp, messages_section=view[end:])
    return cp




_INT_CHARS = b"0123456789,"
_INT_CHARS_NULL = b"0123456789,nul"
#: Bytes of a stored list parsed per piece by :func:`parse_state`.
_PIECE = 1 << 20


def _ints(buf: bytes, start: int, end: int, nulls: bool) -> "array[int]":
    """The items of the JSON list of non-negative integers (and ``null``, read as -1, where ``nulls``) between
    ``start`` and ``end``, parsed a piece at a time into an ``array('q')``; ValueError for anything else."""
    out = array("q")
    allowed = {int, type(None)} if nulls else {int}
    while start < end:
        stop = end
        if end - start > _PIECE:
            stop = buf.rfind(b",", start, start + _PIECE)
            if stop <= start:
                stop = end
        piece = buf[start:stop]
        try:
            values = orjson.loads(b"[" + piece + b"]")
        except orjson.JSONDecodeError:
            raise ValueError("not a list of non-negative integers") from None
        # (digits and commas alone, and null's letters: valid JSON of non-negative integers and nulls, checked in
        # one C-level pass instead of each item's type: the usual case of a long history's refs and keys)
        plain = not piece.translate(None, _INT_CHARS_NULL if nulls else _INT_CHARS)
        if plain and values and None not in values:
            try:
                out.extend(array("q", values))
            except TypeError:  # (digits beyond 64 bits: orjson gives a float)
                raise ValueError("not a list of non-negative integers") from None
        elif plain and values and values.count(None) == len(values):  # (counts not made: every item null)
            out.extend(array("q", [-1]) * len(values))
        elif values:
            if not set(map(type, values)) <= allowed:  # (no float, bool, string or object)
                raise ValueError("not a list of non-negative integers")
            known = [v for v in values if v is not None] if nulls and None in values else values
            if known and min(known) < 0:
                raise ValueError("not a list of non-negative integers")
            if known is not values:
                values = [-1 if v is None else v for v in values]
            out.extend(array("q", values))
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

