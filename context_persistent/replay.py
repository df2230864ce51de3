"""Recognising a host that replays the loaded history through ``add_message`` (pure).

Amplifier resumes a sub-session by calling ``add_message`` once per message of its saved transcript (which
leaves out system and developer messages). A store that already loaded those messages from its own log would
store them twice. The recogniser compares each ``add_message`` right after open with the loaded history, in
order, from the start:

- while they match, the messages are *held* (not written);
- when the whole loaded transcript has been matched, the held messages were a replay: they are dropped and
  one ``replay_recognised`` audit event is written;
- at the first message that does not match (or any other write, or close), the held messages were real
  after all: they are written first, in order, then the new one. Nothing a caller added is ever lost.
"""

from __future__ import annotations

from typing import Any

TRANSCRIPT_SKIPS = frozenset({"system", "developer"})

HELD = "held"
COMPLETE = "complete"
MISMATCH = "mismatch"


class ReplayRecogniser:
    __slots__ = ("_history", "_pos", "_expected", "held")

    def __init__(self, history: Any) -> None:
        #: The loaded history (a list, or a projection's LazyList: only the messages compared are read).
        self._history = history
        self._pos = 0  # history index of the next message to compare
        self._expected: int | None = None  # messages a replay must repeat; counted at the first match
        #: ``(message, message_json)`` pairs offered and matched so far, in order.
        self.held: list[tuple[dict[str, Any], bytes]] = []

    @property
    def active(self) -> bool:
        """Whether the history holds anything a transcript would repeat (not only system messages)."""
        system = getattr(self._history, "system_indices", None)
        if system is not None:
            return len(self._history) > len(system)
        return any(m.get("role") not in TRANSCRIPT_SKIPS for m in self._history)  # (stops at the first)

    def _count(self) -> int:
        if self._expected is None:
            history = self._history
            system = getattr(history, "system_indices", None)
            if system is not None:
                self._expected = len(history) - len(system)  # complete for a lazy list: no scan needed
            else:
                self._expected = sum(1 for m in history if m.get("role") not in TRANSCRIPT_SKIPS)
        return self._expected

    def offer(self, message: dict[str, Any], message_json: bytes) -> str:
        """HELD (keep matching), COMPLETE (the whole transcript was replayed) or MISMATCH (stop).

        The usual resume adds a new message first: one comparison, and nothing else is read.
        """
        history, pos = self._history, self._pos
        while history[pos].get("role") in TRANSCRIPT_SKIPS:
            pos += 1
        if message != history[pos]:
            return MISMATCH
        self._pos = pos + 1
        self.held.append((message, message_json))
        return COMPLETE if len(self.held) == self._count() else HELD
