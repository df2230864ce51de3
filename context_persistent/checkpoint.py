"""Checkpoints: the projection state at a seq, so opening a long session replays only the tail.

A checkpoint is a cache. Open = newest valid checkpoint + the records after it; a missing, stale,
truncated, corrupt, foreign or too-new checkpoint is ignored (full replay) and never changes the result.
Deleting one is always safe.

Three layers, so any backend can store the same payload:

* the payload (pure): :func:`snapshot` serialises a :class:`Projection` (one ``orjson.dumps`` call),
  :func:`encode` frames it with a header and a CRC, :func:`decode` verifies and parses it,
  :func:`mismatch` and :func:`restore` decide whether it fits this session and rebuild the state;
* where it is stored: a :class:`CheckpointStore` (``load``/``save``/``discard`` of payload bytes);
  :class:`FileCheckpointStore` keeps ``<session>/checkpoint.json`` (temp file 0600, fsync, rename, fsync
  folder). Another backend exposes its own store as ``log.checkpoint_store``;
* when (:class:`Checkpointer`, used by the manager): every ``checkpoint_every`` events and on close.

Payload layout (bytes)::

    {"checkpoint":1,"format":1,"schema":[...],"session_id":"…","seq":N,"position":P,
     "first_crc":"…","last_crc":"…","tokenizer":"…"|null,"state_bytes":L}\\n     <- header line
    <L bytes: the state JSON, Projection.to_state()>\\n
    xxxxxxxx\\n                                                                     <- CRC-32 of all above

Identity: ``session_id``, the log ``format``, the projection layout (``schema``: its slot names) and
``first_crc``, the checksum of the log's first record (``session_started``, unique by its timestamp), which
rejects a checkpoint of an older incarnation of the same session id. ``last_crc`` is the checksum of the
record at ``seq``; a backend that can look it up (``log.record_before(position)``) proves the log still holds
that exact record at that position. A log shorter than the checkpoint is detected after the tail read.

Cost: a checkpoint is O(state): serialising is one ``orjson.dumps`` of the projection on the caller (about
1 GB/s) so the state cannot change under it; framing, CRC and the file write + fsync run in a worker thread
while appends continue. With ``checkpoint_every = K`` that is O(state / K) amortised per append.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson

from . import codec
from .paths import CHECKPOINT_NAME, FILE_MODE, fsync_dir
from .projection import Projection

logger = logging.getLogger("context_persistent.checkpoint")

#: Version of the payload layout above; a different one is ignored.
CHECKPOINT_VERSION = 1
#: The projection layout a payload was written for: a new field invalidates old checkpoints by itself.
SCHEMA = sorted(Projection.__slots__)
#: On close, a checkpoint is written only if at least this many events (or ``checkpoint_every``, if smaller)
#: are not covered yet: replaying a short tail costs less than writing the whole state again.
CLOSE_MIN_EVENTS = 256
#: Payloads larger than this are framed (CRC, copy) in a worker thread.
_THREAD_MIN = 1 << 20
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
    state: dict[str, Any]


# -- the payload (pure) ------------------------------------------------------------------------------
def snapshot(state: Projection) -> bytes:
    """The projection state as JSON bytes, in one ``orjson.dumps`` call (O(state))."""
    return orjson.dumps(state.to_state())


def encode(*, session_id: str, seq: int, position: int | None, first_crc: str | None, last_crc: str | None,
           tokenizer: str | None, state_json: bytes) -> bytes:
    """Frame a state snapshot into a self-checking payload (see the module docstring for the layout)."""
    header = orjson.dumps({
        "checkpoint": CHECKPOINT_VERSION, "format": codec.FORMAT_VERSION, "schema": SCHEMA,
        "session_id": session_id, "seq": seq, "position": position, "first_crc": first_crc,
        "last_crc": last_crc, "tokenizer": tokenizer, "state_bytes": len(state_json),
    })
    crc = zlib.crc32(b"\n", zlib.crc32(state_json, zlib.crc32(header + b"\n")))
    return b"".join((header, b"\n", state_json, b"\n", b"%08x\n" % crc))  # one copy of the state


def decode(data: bytes) -> Checkpoint:
    """Verify and parse a payload; CheckpointError says what is wrong (truncated, corrupt, other layout)."""
    if len(data) < _TRAILER + 4 or data[-1:] != b"\n":
        raise CheckpointError(f"truncated ({len(data)} bytes, no trailer)")
    stored = data[-_TRAILER:-1]
    got = zlib.crc32(memoryview(data)[:-_TRAILER])
    if stored != b"%08x" % got:
        raise CheckpointError(f"checksum mismatch (stored {stored.decode('ascii', 'replace')}, computed {got:08x}): "
                              "truncated or corrupt")
    nl = data.find(b"\n")
    try:
        head = orjson.loads(data[:nl])
        if not isinstance(head, dict) or head.get("checkpoint") != CHECKPOINT_VERSION:
            raise CheckpointError(f"payload layout {head.get('checkpoint') if isinstance(head, dict) else head!r}, "
                                  f"this program writes {CHECKPOINT_VERSION}")
        body = memoryview(data)[nl + 1 : len(data) - _TRAILER - 1]
        if len(body) != head["state_bytes"]:
            raise CheckpointError(f"state is {len(body)} bytes, the header says {head['state_bytes']}")
        state = orjson.loads(body)
        cp = Checkpoint(session_id=head["session_id"], seq=head["seq"], position=head["position"],
                        first_crc=head["first_crc"], last_crc=head["last_crc"], tokenizer=head["tokenizer"],
                        format=head["format"], schema=head["schema"], state=state)
    except (KeyError, TypeError, orjson.JSONDecodeError) as e:
        raise CheckpointError(f"malformed payload: {type(e).__name__}: {e}") from None
    if not isinstance(cp.seq, int) or cp.seq < 1 or not isinstance(cp.state, dict):
        raise CheckpointError(f"malformed payload: seq {cp.seq!r}")
    return cp


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
    try:
        state = Projection.from_state(cp.state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"state does not load: {type(e).__name__}: {e}") from None
    if state.head_seq != cp.seq:
        raise CheckpointError(f"state is at seq {state.head_seq}, the header says {cp.seq}")
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
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    async def save(self, payload: bytes, seq: int) -> None:
        await asyncio.to_thread(self.save_sync, payload)

    def save_sync(self, payload: bytes) -> None:
        # A fixed temp name is safe: only the lock holder writes checkpoints. O_TRUNC reuses a leftover.
        try:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)

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
        self.loaded_seq = 0
        self.ignored: str | None = None
        self.first_crc: str | None = None
        self.counted = 0  # messages with a token count in the stored checkpoint
        self._task: asyncio.Future[None] | None = None

    # -- loading --------------------------------------------------------------------------------------
    async def load(self, log: Any, tokenizer: Callable[[], str]) -> Projection:
        """Checkpoint + tail replay when a valid checkpoint exists, else a full replay."""
        cp, state = await self._usable(log, tokenizer)
        if cp is None or state is None:
            return await self._replay(log, Projection(), 0, None)
        tail = await self._replay(log, state, cp.seq, cp.position)
        if log.last_seq < cp.seq:  # the log ends before the checkpoint (a backend that cannot check the anchor)
            await self._reject(f"it is at seq {cp.seq} but the log ends at seq {log.last_seq}")
            return await self._replay(log, Projection(), 0, None)
        self.seq = self.loaded_seq = cp.seq
        self.first_crc = cp.first_crc
        self.counted = _counted(state)
        logger.debug("session %s: resumed from the checkpoint at seq %d, replayed %d newer events",
                     self.session_id, cp.seq, tail.head_seq - cp.seq)
        return tail

    async def _usable(self, log: Any, tokenizer: Callable[[], str]) -> tuple[Checkpoint | None, Projection | None]:
        if self.store is None:
            return None, None
        try:
            payload = await self.store.load()
        except OSError as e:
            logger.info("session %s: checkpoint unreadable (%s); replaying the whole log", self.session_id, e)
            return None, None
        if payload is None:
            logger.debug("session %s: no checkpoint; replaying the whole log", self.session_id)
            return None, None
        try:
            cp = decode(payload)
            reason = mismatch(cp, session_id=self.session_id) or await self._anchor_mismatch(cp, log)
            if reason is None:
                return cp, restore(cp, tokenizer)
        except CheckpointError as e:
            reason = str(e)
        await self._reject(reason)
        return None, None

    async def _anchor_mismatch(self, cp: Checkpoint, log: Any) -> str | None:
        first = await first_record_crc(log)
        if first != cp.first_crc:
            return (f"its first-record fingerprint {cp.first_crc} does not match the log's ({first}): "
                    "it was written for another log under this session id")
        record_before = getattr(log, "record_before", None)
        if record_before is not None:
            if not isinstance(cp.position, int):
                return f"its position {cp.position!r} is not a byte offset"
            rec = record_before(cp.position)
            if rec is None or rec["seq"] != cp.seq or rec.get("crc") != cp.last_crc:
                found = "no record" if rec is None else f"seq {rec['seq']} (crc {rec.get('crc')})"
                return (f"the log does not hold its seq {cp.seq} (crc {cp.last_crc}) at byte {cp.position} "
                        f"(found {found}): the log is shorter or was rewritten")
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
                or state.head_seq - self.seq < self.every):
            return
        self._task = asyncio.ensure_future(self._write(*self._prepare(state, log, tokenizer), log))

    async def close(self, state: Projection, log: Any, tokenizer: Callable[[], str]) -> None:
        """Wait for a write in flight, then write a final checkpoint if enough events (or token counts) are
        not covered yet."""
        if self._task is not None:
            await asyncio.shield(self._task)
        if not self.writable or self.store is None or state.head_seq == 0:
            return
        enough = min(self.every, CLOSE_MIN_EVENTS)
        if state.head_seq - self.seq >= enough or _counted(state) - self.counted >= enough:
            await self._write(*self._prepare(state, log, tokenizer), log)

    def _prepare(self, state: Projection, log: Any, tokenizer: Callable[[], str]
                 ) -> tuple[int, int | None, str | None, str | None, bytes, int]:
        """What must be read from the live state now: seq, position, tokenizer, last crc, state JSON, counts."""
        counted = _counted(state)
        last = getattr(log, "record_before", None)
        position = log.position
        last_crc = None
        if last is not None:
            rec = last(position)
            last_crc = rec.get("crc") if rec is not None and rec["seq"] == state.head_seq else None
        return state.head_seq, position, tokenizer() if counted else None, last_crc, snapshot(state), counted

    async def _write(self, seq: int, position: int | None, tokenizer: str | None, last_crc: str | None,
                     state_json: bytes, counted: int, log: Any) -> None:
        store = self.store
        assert store is not None
        try:
            if self.first_crc is None:
                self.first_crc = await first_record_crc(log)
            fields = dict(session_id=self.session_id, seq=seq, position=position, first_crc=self.first_crc,
                          last_crc=last_crc, tokenizer=tokenizer, state_json=state_json)
            framing = functools.partial(encode, **fields)  # type: ignore[arg-type]
            payload = await asyncio.to_thread(framing) if len(state_json) >= _THREAD_MIN else framing()
            await store.save(payload, seq)
            self.seq = max(self.seq, seq)
            self.counted = counted
            logger.debug("session %s: checkpoint written at seq %d (%d bytes)", self.session_id, seq, len(payload))
        except Exception as e:  # a checkpoint is a cache: never let it break the store
            logger.warning("session %s: could not write a checkpoint at seq %d (%s); the log is unaffected "
                           "and the next open replays more of it", self.session_id, seq, e)
        finally:
            self._task = None
