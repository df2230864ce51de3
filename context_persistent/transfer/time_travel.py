"""Time travel: a session as it was right after any seq (I/O: reads the log; the fold is model.projection).

``replay(log, at_seq)`` folds the log's records up to ``at_seq`` through ``Projection.apply``, from a separate
read-only handle on the log, and takes out every message redacted at any seq (a redaction hides its message at
every seq). ``open_at(store, at_seq)`` wraps that past state in a read-only store. ``export(at_seq=)``,
``fork(at_seq=)`` and ``show --at`` go through them (see docs/snapshots.md).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import orjson

from ..model import json_lossless
from ..model import events as ev
from ..errors import InvalidRecordError
from ..storage.backends import open_log
from ..model.projection import Projection, make_key

if TYPE_CHECKING:
    from ..storage.eventlog import EventLog
    from ..store.manager import PersistentContextManager


async def replay(log: EventLog, at_seq: int | None = None, pager: Any = None) -> Projection:
    """The projection after every record with ``seq <= at_seq`` (all records when None), less every message
    redacted at any seq. With a ``pager`` (pages.MessageReader of a file log), the history keeps refs to the
    log instead of messages, as a replay at open does (docs/architecture.md, "Bounded memory").

    A redaction hides its message from every view at every seq: the past state is the fold up to ``at_seq``
    with the messages that any ``redacted`` event of the log names taken out, and with them every message
    of that state identical to a redacted one (``set_messages`` re-adds the messages it keeps under new keys,
    so the message a past state holds may be an earlier copy of the one that was redacted). ``at``,
    ``export(at_seq=)``, ``fork(at_seq=)`` and ``show --at`` therefore never reveal what was redacted later.

    When the log's oldest segments expired, the fold starts from the ``expired`` record's state, and a state
    before that record (``at_seq`` below its seq) is a RecordsExpiredError: it needs the expired records.
    """
    manifest = getattr(log, "manifest", None)
    boundary = manifest.boundary if manifest is not None else None
    if boundary is not None and at_seq is not None and at_seq < boundary.expired_seq:
        from ..errors import RecordsExpiredError

        raise RecordsExpiredError(str(getattr(log, "directory", "")), f"the state at seq {at_seq} (the earliest "
                                  f"state the log still holds is at seq {boundary.expired_seq})", boundary.last_seq,
                                  boundary.start, boundary.expired_seq)
    redacted: set[int] = set()
    if at_seq is not None:  # (at the head, the fold has applied every redaction already)
        async for batch in log.read_batches():
            redacted.update(_redacted_key(rec) for rec in batch if rec["type"] == ev.REDACTED)
    from ..storage.checkpoint.policy import seed_state

    state = seed_state(log, pager)  # (empty, or seeded from the expired record when the oldest segments expired)
    apply = state.apply
    prints: set[bytes] = set()  # fingerprints of the redacted messages
    async for batch in log.read_batches():
        spans = getattr(log, "batch_spans", None) if pager is not None else None
        if spans is None or len(spans) != len(batch):
            spans = None
        for j, rec in enumerate(batch):
            if redacted:
                _note_redacted(rec, redacted, prints)
            if at_seq is None or rec["seq"] <= at_seq:
                if spans is None:
                    apply(rec)
                else:
                    start, end = spans[j]
                    apply(rec, start, end - start)
            elif not redacted:
                return state
    if redacted:
        _hide(state, redacted, prints)
    return state


def _redacted_key(rec: dict[str, Any]) -> int:
    key = rec["data"].get("key") if isinstance(rec.get("data"), dict) else None
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidRecordError(rec.get("seq"), rec.get("type"), f"data.key is {key!r}, not a message key")
    return key


def fingerprint(message: Any) -> bytes:
    """A message's identity by content: what hides every copy of a redacted message."""
    try:
        data = json_lossless.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # (an integer beyond 64 bits)
        data = repr(message).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def _note_redacted(rec: dict[str, Any], redacted: set[int], prints: set[bytes]) -> None:
    """Add the fingerprints of the messages of ``rec`` whose keys are redacted (every record holding messages:
    ``message_added``, ``messages_replaced``, ``system_prompt_set`` and the erasure tombstones of them)."""
    from ..operations.erasure import message_slots

    seq = rec["seq"]
    for i, m in message_slots(rec):
        if make_key(seq, i) in redacted:
            prints.add(fingerprint(m))


def _hide(state: Projection, keys: set[int], prints: set[bytes]) -> None:
    """Take the messages with these keys, or identical to a redacted one, out of ``state``."""
    gone = [i for i, (k, m) in enumerate(zip(state.keys, state.messages)) if k in keys or fingerprint(m) in prints]
    for i in reversed(gone):
        state.pinned.discard(state.keys[i])
        del state.messages[i], state.keys[i], state.tokens[i]
    state.pinned -= keys
    if gone:
        state.version += 1


def _check_at_seq(at_seq: Any, head: int) -> int:
    if isinstance(at_seq, bool) or not isinstance(at_seq, int) or at_seq < 1:
        raise ValueError(f"at_seq must be an integer >= 1, got {at_seq!r}")
    if at_seq > head:
        raise ValueError(f"at_seq {at_seq} is beyond the last event of the session (seq {head})")
    return at_seq


async def open_at(store: PersistentContextManager, at_seq: int) -> PersistentContextManager:
    """A read-only store showing the session as it was right after event ``at_seq``. Close it after use.

    It replays the log from a second, read-only handle (no lock; the writer is not disturbed) and offers
    every read method of the store (views, request view, token counts, stats) on that past state.
    """
    _check_at_seq(at_seq, store.head_seq)
    log = await open_log(store.storage_path, store.session_id, store.config, readonly=True)
    past = None
    try:
        past = type(store)(storage_path=store.storage_path, session_id=store.session_id, log=log,
                           config=store.config)
        past._state = await replay(log, at_seq, past._s.pager)  # (read through the past store's own pager)
        past._loaded_from_file = past._state.has_history
    except BaseException:
        if past is not None and past._s.pager is not None:
            past._s.pager.close()
        await log.close()
        raise
    return past
