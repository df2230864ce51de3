"""Whether a session's checkpoint is one open would trust (verify.py, repair.py): decoded, written for this
log, anchored at records the log still holds, and with a state equal to the log folded up to its seq.
``_check_checkpoint`` gives a status filled in while the walk (log_walk.py) passes the records."""

from __future__ import annotations

from collections.abc import Callable
from ..model.values import replace
from pathlib import Path
from typing import Any

from ..model import json_lossless
from ..model.projection import Counts, Projection, Refs, same_items
from ..errors import LogCorruptedError
from ..storage.checkpoint import CheckpointError, FileCheckpointStore, decode as decode_checkpoint, mismatch
from ..storage.checkpoint.sections import load_section, section_refs
from ..storage.pages import STREAM_CACHE_BYTES, MessageReader
from .log_walk import _Walk


_LISTS = ("messages", "keys", "tokens")


def _normal(state: dict[str, Any]) -> Any:
    """A projection state's facts as plain JSON values, its per-message lists left out."""
    return json_lossless.loads(json_lossless.dumps({k: v for k, v in state.items() if k not in _LISTS}))


def _stored_state(stored: dict[str, Any], pager: MessageReader) -> Projection | None:
    """A checkpoint's state as a projection, its lists packed (refs, keys and token counts: 24 bytes a message;
    the parsed lists can then be dropped before the log is walked); None if it does not load."""
    try:
        state = Projection.from_state(stored, pager)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return None
    state.tokens = Counts()  # (not compared: token counts are a cache inside the cache)
    return state


def _same_state(state: Projection, stored: Projection | dict[str, Any] | None, directory: Path) -> bool:
    """Whether a checkpoint's state (as stored, or :func:`_stored_state`) equals the fold, token counts left
    out; messages compared one at a time (refs to the same record are equal without reading it, all of them at
    once when all are; a ref and a message are compared by content, the ref read from the log in ``directory``)."""
    if isinstance(stored, dict):
        reader = MessageReader(directory)
        try:
            return _same_state(state, _stored_state(stored, reader), directory)
        finally:
            reader.close()
    if stored is None:
        return False
    mine, theirs = state.to_state(refs=True), stored.to_state(refs=True)
    a, b = mine["messages"], theirs["messages"]
    if _normal(mine) != _normal(theirs) or len(a) != len(b) or not same_items(mine["keys"], theirs["keys"]):
        return False
    if type(a) is Refs and not a.extras and not b.extras and a.a == b.a:
        return True
    pager: Any = state.pager or stored.pager

    def get(v: Any) -> Any:
        return pager.fetch(v) if type(v) is int else v

    return all(x == y if type(x) is int and type(y) is int else get(x) == get(y) for x, y in zip(a, b))


def _check_messages(cp: Any, stored: Projection, directory: Path, status: dict[str, Any]) -> None:
    """``status["messages"]``: whether the checkpoint's message section (docs/format.md) verifies and holds what
    the log's records hold at its refs ("valid"), else why not (and ``ok`` False: open reads those messages from
    the log instead, and repair removes the checkpoint)."""
    refs = section_refs(stored)
    section = memoryview(cp.messages_section)
    items, error, _ = load_section(lambda at, count: bytes(section[at:at + count]), 0, cp, len(refs))
    if items is not None:
        reader = MessageReader(directory, STREAM_CACHE_BYTES)
        try:
            for start in range(0, len(refs), 4096):
                chunk = [(r, m) for r, m in zip(refs[start:start + 4096], items[start:start + 4096]) if r >= 0]
                got = reader.fetch_many([r for r, _ in chunk])
                bad = next((i for i, ((_, m), g) in enumerate(zip(chunk, got)) if m != g), None)
                if bad is not None:
                    error = f"its message {start + bad} is not the message the log holds at its ref"
                    break
        except LogCorruptedError as e:  # (reported with the log's problems: the section is not compared)
            status["messages"] = f"not compared: {e.reason}"
            return
        finally:
            reader.close()
    if error is None:
        status["messages"] = "valid"
    else:
        status.update(messages=f"damaged: {error}", ok=False)


def _check_checkpoint(directory: Path, session_id: str
                      ) -> tuple[dict[str, Any], Callable[[dict[str, Any], int, Projection | None], None], Callable[[_Walk], None]]:
    """The checkpoint status, filled in during the walk (``on_record``) and after it (``finish``)."""
    status: dict[str, Any] = {"status": "missing", "ok": True}
    store = FileCheckpointStore(directory)
    try:
        payload = store.read_sync()  # (never blocks on a FIFO, never reads through a link)
    except CheckpointError as e:
        payload = None
        status.update(status="ignored", ok=False, reason=str(e))
    cp = None
    if payload is not None:
        try:
            cp = decode_checkpoint(payload, packed=True)
            status.update(seq=cp.seq, position=cp.position, bytes=len(payload))
            reason = mismatch(cp, session_id=session_id)
            if reason:
                status.update(status="ignored", ok=False, reason=reason)
                cp = None
        except CheckpointError as e:
            status.update(status="ignored", ok=False, reason=str(e))
    seen: dict[str, Any] = {}
    stored: Projection | None = None
    if cp is not None and cp.state is not None:
        stored = _stored_state(cp.state, MessageReader(directory))
        if stored is not None and cp.messages_section is not None:
            _check_messages(cp, stored, directory, status)
        cp = replace(cp, state=None, messages_section=None)  # (the parsed lists go: the walk folds the history)

    def on_record(rec: dict[str, Any], end: int, state: Projection | None) -> None:
        nonlocal stored
        if cp is None:
            return
        if rec["seq"] == cp.state_seq:  # the state section is at the base of a based checkpoint (or at seq)
            seen["same"] = state is not None and _same_state(state, stored, directory)
            if stored is not None:
                stored.pager.close()  # type: ignore[union-attr]
                stored = None
            if cp.base is not None:
                seen["base"] = end == cp.base["position"] and rec.get("crc") == cp.base["last_crc"]
        if rec["seq"] == cp.seq:
            seen["end"], seen["crc"] = end, rec.get("crc")

    def finish(walk: _Walk) -> None:
        if cp is None:
            return
        if walk.first_crc != cp.first_crc:
            reason = "its first-record fingerprint does not match the log (written for another log)"
        elif "end" not in seen:
            reason = f"it is at seq {cp.seq}, which the log does not hold (the log ends at seq {walk.last_seq})"
        elif seen["end"] != cp.position or seen["crc"] != cp.last_crc:
            reason = f"the record at its seq {cp.seq} is not the one it was written after (the log was rewritten)"
        elif cp.base is not None and not seen.get("base"):
            reason = (f"its state section's record (seq {cp.state_seq}) is not the one it was written after "
                      "(the log was rewritten)")
        elif not seen.get("same"):
            reason = f"its state differs from the log replayed up to seq {cp.state_seq}"
        else:
            status.update(status="valid", behind=walk.last_seq - cp.seq)
            return
        status.update(status="ignored", ok=False, reason=reason)

    return status, on_record, finish
