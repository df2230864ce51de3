"""The state a session's events fold into (pure).

``Projection.apply(record)`` is the one fold function: replay on open, the incremental update after each
append, and checkpoint restore all go through it (a checkpoint is this state, serialised).

Every message has a key: ``seq << 20 | index`` where ``seq`` is the event that added it and ``index`` its
position inside that event (0 for ``message_added``; the list position for ``messages_replaced``). Keys are
stable across restarts, so pins and redactions can name a message.
"""

from __future__ import annotations

from typing import Any

from . import events as ev
from .codec import FORMAT_VERSION
from .errors import InvalidRecordError

INDEX_BITS = 20
MAX_BATCH = 1 << INDEX_BITS  # messages one messages_replaced event may hold


def make_key(seq: int, index: int = 0) -> int:
    return (seq << INDEX_BITS) | index


def split_key(key: int) -> tuple[int, int]:
    return key >> INDEX_BITS, key & (MAX_BATCH - 1)


class Projection:
    """Full history plus pins, as of ``head_seq``. Mutated only by :meth:`apply`."""

    __slots__ = ("messages", "keys", "tokens", "pinned", "head_seq", "has_history", "session", "version",
                 "counts", "counted_version")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.keys: list[int] = []
        #: Token count of each message under the manager's counter, ``None`` until first needed.
        self.tokens: list[int | None] = []
        self.pinned: set[int] = set()
        self.head_seq = 0
        #: True once any event that changes history (add, replace, clear) has been applied.
        self.has_history = False
        #: The ``session_started`` data (format, tokenizer, program, parent).
        self.session: dict[str, Any] = {}
        #: Bumped on every change that can alter a view; caches compare it.
        self.version = 0
        #: Events seen, by type (for stats).
        self.counts: dict[str, int] = {}
        #: The ``version`` at which every entry of ``tokens`` was last known to be counted (-1: never).
        self.counted_version = -1

    def apply(self, rec: dict[str, Any]) -> None:
        """Fold one record into the state; InvalidRecordError if its data lacks what its type needs."""
        try:
            self._apply(rec)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            raise InvalidRecordError(rec.get("seq"), rec.get("type"), f"{type(e).__name__}: {e}") from None

    def _apply(self, rec: dict[str, Any]) -> None:
        seq = rec["seq"]
        kind = rec["type"]
        data = rec["data"]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.head_seq = seq
        if kind == ev.MESSAGE_ADDED:
            message = data["message"]
            if type(message) is not dict:
                raise TypeError(f"data.message is {type(message).__name__}, not a message object")
            self.messages.append(message)
            self.keys.append(seq << INDEX_BITS)
            self.tokens.append(None)
            self.has_history = True
        elif kind == ev.MESSAGES_REPLACED:
            msgs = data["messages"]
            if type(msgs) is not list or any(type(m) is not dict for m in msgs):
                raise TypeError("data.messages is not a list of message objects")
            self.messages = list(msgs)
            self.keys = [make_key(seq, i) for i in range(len(msgs))]
            self.tokens = [None] * len(msgs)
            self.pinned = set()
            self.has_history = True
        elif kind == ev.CLEARED:
            self.messages = []
            self.keys = []
            self.tokens = []
            self.pinned = set()
            self.has_history = True
        elif kind == ev.PINNED:
            self.pinned.add(data["key"])
        elif kind == ev.UNPINNED:
            self.pinned.discard(data["key"])
        elif kind == ev.REDACTED:
            key = data["key"]
            try:
                i = self.keys.index(key)
            except ValueError:
                pass
            else:
                del self.messages[i], self.keys[i], self.tokens[i]
                self.pinned.discard(key)
        elif kind == ev.SESSION_STARTED:
            self.session = dict(data)
        elif kind in ev.EVENT_TYPES:
            return  # audit events (transcript_ignored, compacted, ...) leave the views as they are
        else:
            # A newer major format is refused by its version; within this one, an unknown type is damage.
            raise ValueError(f"unknown event type {kind!r}; format {FORMAT_VERSION} knows "
                             f"{', '.join(sorted(ev.EVENT_TYPES))}")
        self.version += 1

    def index_of(self, key: int) -> int | None:
        try:
            return self.keys.index(key)
        except ValueError:
            return None

    # -- checkpoint support -------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "keys": self.keys,
            "tokens": self.tokens,
            "pinned": sorted(self.pinned),
            "head_seq": self.head_seq,
            "has_history": self.has_history,
            "session": self.session,
            "counts": self.counts,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Projection":
        p = cls()
        p.messages = list(state["messages"])
        p.keys = list(state["keys"])
        p.tokens = list(state["tokens"])
        if not (len(p.messages) == len(p.keys) == len(p.tokens)):
            raise ValueError("checkpoint state has lists of different lengths")
        p.pinned = set(state["pinned"])
        p.head_seq = int(state["head_seq"])
        p.has_history = bool(state["has_history"])
        p.session = dict(state["session"])
        p.counts = dict(state.get("counts", {}))
        return p
