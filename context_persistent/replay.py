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
    __slots__ = ("_expected", "held")

    def __init__(self, history: list[dict[str, Any]]) -> None:
        self._expected = [m for m in history if m.get("role") not in TRANSCRIPT_SKIPS]
        #: ``(message, message_json)`` pairs offered and matched so far, in order.
        self.held: list[tuple[dict[str, Any], bytes]] = []

    @property
    def active(self) -> bool:
        return bool(self._expected)

    def offer(self, message: dict[str, Any], message_json: bytes) -> str:
        """HELD (keep matching), COMPLETE (the whole transcript was replayed) or MISMATCH (stop)."""
        if message != self._expected[len(self.held)]:
            return MISMATCH
        self.held.append((message, message_json))
        return COMPLETE if len(self.held) == len(self._expected) else HELD
