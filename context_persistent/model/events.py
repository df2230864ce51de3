"""Event types and the validation of commands before they become events (pure)."""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from . import json_lossless
from .codec import MAX_DEPTH, check_depth, depth_error, dumps

SESSION_STARTED: Final = "session_started"
MESSAGE_ADDED: Final = "message_added"
MESSAGES_REPLACED: Final = "messages_replaced"
CLEARED: Final = "cleared"
TRANSCRIPT_IGNORED: Final = "transcript_ignored"
PINNED: Final = "pinned"
UNPINNED: Final = "unpinned"
REDACTED: Final = "redacted"
REPLAY_RECOGNISED: Final = "replay_recognised"
LOG_REPAIRED: Final = "log_repaired"
COMPACTED: Final = "compacted"
SEMANTIC_REPAIRED: Final = "semantic_repaired"
SYSTEM_PROMPT_SET: Final = "system_prompt_set"
ERASED: Final = "erased"
EXPIRED: Final = "expired"
USAGE_REPORTED: Final = "usage_reported"
#: A LangGraph checkpoint and a task's pending writes (integrations/langgraph.py): kept for the saver, no view.
GRAPH_CHECKPOINT: Final = "graph_checkpoint"
GRAPH_WRITES: Final = "graph_writes"
HOST_LINKED: Final = "host_linked"
TRANSCRIPT_EDITED: Final = "transcript_edited"

EVENT_TYPES: Final = frozenset(
    {SESSION_STARTED, MESSAGE_ADDED, MESSAGES_REPLACED, CLEARED, TRANSCRIPT_IGNORED, PINNED, UNPINNED, REDACTED,
     REPLAY_RECOGNISED, LOG_REPAIRED, COMPACTED, SEMANTIC_REPAIRED, SYSTEM_PROMPT_SET, ERASED, EXPIRED,
     USAGE_REPORTED, GRAPH_CHECKPOINT, GRAPH_WRITES, HOST_LINKED, TRANSCRIPT_EDITED}
)
#: Audit events: recorded for operators, they change no view (``usage_reported``: what a provider reported for a
#: request, model/usage.py; ``host_linked``: the host's session folder this session belongs to, which retention's
#: ``follow_host`` follows; ``transcript_edited``: the host offered an edited transcript, warned about once).
#: (``replay_recognised`` changes the views when it names the repeated messages' ``keys``; written without them
#: by older versions, it is audit only.)
AUDIT_EVENTS: Final = frozenset({SESSION_STARTED, TRANSCRIPT_IGNORED, LOG_REPAIRED, COMPACTED, SEMANTIC_REPAIRED,
                                 USAGE_REPORTED, GRAPH_CHECKPOINT, GRAPH_WRITES, HOST_LINKED, TRANSCRIPT_EDITED})
#: Events a host writes for its own state (``store.host_events``): they change no view.
HOST_EVENTS: Final = frozenset({GRAPH_CHECKPOINT, GRAPH_WRITES})

_SHALLOW: Final = 2 * MAX_DEPTH


def expired_of(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The ``expired`` data of a record: an ``expired`` record's own, or the one an erasure tombstone of an
    ``expired`` record keeps (``data.expired``, with ``null`` for each erased carried message); else None."""
    data = rec.get("data")
    if not isinstance(data, dict):
        return None
    if rec.get("type") == EXPIRED:
        return data
    if rec.get("type") == ERASED and data.get("of") == EXPIRED and isinstance(data.get("expired"), dict):
        return data["expired"]  # type: ignore[no-any-return]
    return None

ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")
_ROLE_SET: Final = frozenset(ROLES)


def validate_message(message: Any, where: str = "message") -> bytes:
    """Check a message and return its JSON bytes; ValueError says what is wrong and what is allowed."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with a 'role', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLE_SET:  # (a list or dict role is unhashable)
        if "role" not in message:
            raise ValueError(f"{where} has no 'role' key; allowed roles: {', '.join(ROLES)}")
        raise ValueError(f"{where} has unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
    try:
        encoded = dumps(message)
        if len(encoded) > _SHALLOW:  # (shorter JSON cannot nest MAX_DEPTH containers: no call on the hot path)
            check_depth(message, encoded)
    except ValueError as e:
        if "Recursion limit" in str(e):  # (orjson's own limit, deeper still)
            e = ValueError(depth_error())
        raise ValueError(f"{where} is {e}") from None
    return encoded


def validate_messages(messages: Any) -> list[bytes]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    return [validate_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def encode_messages(messages: Any) -> bytes:
    """``validate_messages`` as one JSON array: ``b"[" + b",".join(validate_messages(messages)) + b"]"``, the same
    bytes and the same errors, made by one encode of the whole list when every message is a plain dict with a
    known role and no deep nesting (5-10x faster than an encode per message; docs/performance.md, #23). Anything
    else goes through ``validate_messages``, which says what is wrong with which message."""
    if type(messages) is list or type(messages) is tuple:
        roles = _ROLE_SET
        for m in messages:
            if type(m) is not dict:
                break
            role = m.get("role")
            if type(role) is not str or role not in roles:
                break
        else:
            try:
                out = dumps(messages)
            except ValueError:
                out = None  # (the per-message encode below names the message and what is wrong with it)
            # A message nesting d containers writes at least d brackets (orjson escapes none in strings, so
            # brackets in texts only make the count larger): few brackets beyond one per message need no walk.
            if out is not None and (out.count(b"[") + out.count(b"{") - len(messages) - 1 < MAX_DEPTH
                                    or not _deeper_than(messages, MAX_DEPTH)):
                return out
    return b"[" + b",".join(validate_messages(messages)) + b"]"


def _deeper_than(messages: Any, limit: int) -> bool:
    """Whether a message of ``messages`` nests more than ``limit`` containers (itself counting as one): a walk of
    the containers only (a message of strings and numbers costs a look at its values)."""
    stack = [(v, 2) for m in messages for v in m.values() if type(v) is dict or type(v) is list]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in (v.values() if type(v) is dict else v)
                     if type(x) is dict or type(x) is list)
    return False


def digest(payload: bytes) -> str:
    return "sha256:" + hashlib.sha256(payload).hexdigest()


_ATOMIC: Final = frozenset((str, int, float, bool, type(None)))


#: A list of at least this many items is copied with the cyclic garbage collector paused (:func:`gc_paused`).
GC_PAUSE_ITEMS: Final = 1024


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many containers that hold no cycles (a copy of a
    history: 100k messages are 200k new dicts and lists, and the collections their allocations trigger walk the
    whole heap again and again: 0.15-0.17 s of copying at 100k x 300 B became 0.08-0.11 s, docs/performance.md).
    Reference counting still frees everything; only cycles wait until the collector runs again. Re-entrant: a
    pause inside a pause (or with the collector off already) leaves it as it was."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def copy_json(value: Any) -> Any:
    """A deep copy of JSON-shaped data: new dicts and lists; str, numbers, bools and None are immutable, so shared.

    The cost follows the number of containers, not the bytes: 2.5x faster than an orjson round trip for
    300-byte messages, 30x for 4 KB ones (docs/performance.md), and far faster than ``copy.deepcopy``. A list
    of ``GC_PAUSE_ITEMS`` items or more (a history) is copied with the garbage collector paused.
    """
    t = type(value)
    if t is list:
        if len(value) >= GC_PAUSE_ITEMS and gc.isenabled():
            with gc_paused():
                return [v if type(v) in _ATOMIC else copy_json(v) for v in value]
        return [v if type(v) in _ATOMIC else copy_json(v) for v in value]
    if t is dict:
        out = value.copy()
        for k, v in out.items():
            if type(v) not in _ATOMIC:
                out[k] = copy_json(v)  # replacing a value while iterating is allowed (the size does not change)
        return out
    if t in _ATOMIC:
        return value
    return json_lossless.loads(json_lossless.dumps(value))  # anything else (a tuple, a subclass): convert as JSON does
