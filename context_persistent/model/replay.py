"""Recognising a host that replays the loaded history through ``add_message``, and the host's normal form (pure).

The Amplifier CLI resumes a sub-session by calling ``add_message`` once per message of its saved transcript
(which leaves out system and developer messages and went through the CLI's normalisation, :func:`normalise`).
A store that already loaded those messages from its own log would show them twice.

Nothing is held back: the manager writes every ``add_message`` first, then offers it here. The recogniser
compares each one, in order from the start, with the loaded history (system and developer messages skipped,
both sides normalised):

- while they match, the written messages are remembered (their keys);
- when the whole loaded transcript has been matched, the replay is *complete*; it is *confirmed* by the next
  ``add_message`` (the host's new instruction), and only then does the manager write one
  ``replay_recognised`` event naming the repeated messages, which folds them out of the views (the log
  keeps them);
- a request for the model (``get_messages_for_request``), any other write, a message that differs, or
  ``close()`` ends the recognition: what was written stays as written. A user who types the same words again
  right after a resume therefore keeps that turn: the request that follows the message ends the recognition.

Only the Amplifier mount turns this on (``recognise_replay``), where the host can replay.
"""

from __future__ import annotations

import itertools
from typing import Any

TRANSCRIPT_SKIPS = frozenset({"system", "developer"})

HELD = "held"
COMPLETE = "complete"
MISMATCH = "mismatch"

#: Top-level fields the CLI's ``sanitize_message`` leaves out when it saves a transcript.
_DROPPED = ("content_blocks",)


def _strip_none(value: Any) -> Any:
    t = type(value)
    if t is dict:
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if t is list or t is tuple:
        return [_strip_none(v) for v in value if v is not None]
    return value


def normalise(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the Amplifier CLI saves it in ``transcript.jsonl`` (amplifier_foundation's
    ``sanitize_message``): ``None`` values dropped from every object and list, ``content_blocks`` dropped,
    ``thinking_block`` replaced by ``thinking_text`` (its ``text``). Keys keep their names; JSON objects
    compare without regard to key order."""
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key in _DROPPED:
            continue
        if key == "thinking_block":
            if isinstance(value, dict) and "text" in value:
                out["thinking_text"] = value["text"]
            continue
        if value is not None:
            out[key] = _strip_none(value)
    return out


def same_message(stored: dict[str, Any], offered: dict[str, Any]) -> bool:
    """Whether ``offered`` is ``stored`` or the host's normal form of it (:func:`normalise`)."""
    return stored == offered or normalise(stored) == normalise(offered)


def transcript_of(messages: Any) -> list[dict[str, Any]]:
    """What the host's transcript of ``messages`` would hold: no system/developer messages, normalised."""
    return [normalise(m) for m in messages if m.get("role") not in TRANSCRIPT_SKIPS]


class ReplayRecogniser:
    __slots__ = ("_history", "_loaded", "_pos", "_expected", "keys", "digests")

    def __init__(self, history: Any) -> None:
        #: The loaded history (a list, or a projection's LazyList: only the messages compared are read).
        self._history = history
        self._loaded = len(history)
        self._pos = 0  # history index of the next message to compare
        self._expected: int | None = None  # messages a replay must repeat; counted at the first match
        #: Keys of the written messages that matched so far, in order.
        self.keys: list[int] = []
        #: Their JSON, for the event's digest.
        self.digests: list[bytes] = []

    @property
    def active(self) -> bool:
        """Whether the history holds anything a transcript would repeat (not only system messages)."""
        system = getattr(self._history, "system_indices", None)
        if system is not None:
            return len(self._history) > len(system)
        return any(m.get("role") not in TRANSCRIPT_SKIPS for m in self._history)  # (stops at the first)

    @property
    def complete(self) -> bool:
        return bool(self.keys) and len(self.keys) == self._count()

    def _count(self) -> int:
        if self._expected is None:
            # Only the loaded part counts: the messages written since are appended to the same list.
            history, n = self._history, self._loaded
            system = getattr(history, "system_indices", None)
            if system is not None:  # complete for a lazy list: no scan needed
                self._expected = n - sum(1 for i in system if i < n)
            else:
                self._expected = sum(1 for m in itertools.islice(history, n) if m.get("role") not in TRANSCRIPT_SKIPS)
        return self._expected

    def offer(self, message: dict[str, Any], key: int, message_json: bytes) -> str:
        """HELD (keep matching), COMPLETE (the whole transcript was repeated) or MISMATCH (stop).

        ``message`` was already written with ``key``. The usual resume adds a new message first: one
        comparison, and nothing else is read.
        """
        if self.complete:
            return MISMATCH  # one more than the history: not a replay of it
        history, pos = self._history, self._pos
        while history[pos].get("role") in TRANSCRIPT_SKIPS:
            pos += 1
        if not same_message(history[pos], message):
            return MISMATCH
        self._pos = pos + 1
        self.keys.append(key)
        self.digests.append(message_json)
        return COMPLETE if self.complete else HELD
