"""What a ``set_messages`` on a store that loaded its own log is (pure; the rule is in docs/resume.md).

- a *filtered transcript*: the host's copy of our history (the Amplifier CLI's ``transcript.jsonl``): leave out
  every system and developer message on both sides, bring both to the CLI's normal form (replay.normalise:
  ``None`` fields and ``content_blocks`` dropped), and the offered messages are the history's first ones, in
  order: the same history, or one a turn or more behind. It is ignored (and audited).
- a *host repair*: what ``get_messages()`` returned, repaired (the CLI's pre-turn repair, amplifier_foundation's
  ``repair_transcript``): every message of the history is kept unchanged and in order (system and developer
  messages included), except ``tool`` results the repair moved; what is added is a ``tool`` result answering
  a call of the history that has no result, or an assistant message without calls right after a tool result
  (the reply closing an interrupted turn). It is stored as a replacement.
- anything else is neither: ignored and audited (a stale transcript must not undo a clear or a redaction).
"""

from __future__ import annotations

from typing import Any

from .grouping import result_key, tool_calls_of
from .replay import TRANSCRIPT_SKIPS, same_message

FILTERED = "filtered_transcript"
REPAIR = "host_repair"
OTHER = "not_recognised"


def _conversation(messages: Any) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") not in TRANSCRIPT_SKIPS]


def is_filtered_transcript(history: Any, offered: list[dict[str, Any]]) -> bool:
    """Whether ``offered`` is the history, or a prefix of it, as the host's transcript would hold it."""
    mine = _conversation(history)
    theirs = _conversation(offered)
    if len(theirs) > len(mine):
        return False
    if mine[:len(theirs)] == theirs:  # (the usual case, compared in C: the transcript holds our messages as they are)
        return True
    return all(same_message(h, o) for h, o in zip(mine, theirs))


def merge_repair(history: Any, offered: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The history with the host's repair applied, or None if ``offered`` is not a repair of it.

    The host repairs what ``get_messages()`` returned, so every message of the history it keeps is there
    unchanged (equal, not merely the same normal form), system and developer messages included, in order.
    A stale transcript (no system messages, the CLI's normal form) is therefore never taken for a repair.
    """
    calls: set[str] = set()
    answered: set[str] = set()
    for m in history:
        if m.get("role") == "assistant":
            calls.update(key for key, _, _ in tool_calls_of(m))
        key = result_key(m)
        if key:
            answered.add(key)
    orphans = calls - answered
    out: list[dict[str, Any]] = []
    changed = False
    j = 0

    def insertable(m: dict[str, Any]) -> bool:
        role = m.get("role")
        if role == "tool":
            key = result_key(m)
            if key in orphans:  # a result for a call of the history that has none (each call once)
                orphans.discard(key)  # type: ignore[arg-type]
                return True
            return False
        # the repair's reply closing an interrupted turn: right after a tool result, making no calls
        return role == "assistant" and not tool_calls_of(m) and bool(out) and out[-1].get("role") == "tool"

    for h in history:
        while j < len(offered) and offered[j] != h and insertable(offered[j]):
            out.append(offered[j])
            j += 1
            changed = True
        if j < len(offered) and offered[j] == h:
            out.append(h)
            j += 1
        elif h.get("role") == "tool":
            changed = True  # a result the repair moved or dropped
        else:
            return None
    while j < len(offered):
        if not insertable(offered[j]):
            return None
        out.append(offered[j])
        j += 1
        changed = True
    return out if changed else None


def classify(history: Any, offered: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]] | None]:
    """``(FILTERED, None)``, ``(REPAIR, merged history)`` or ``(OTHER, None)``."""
    if is_filtered_transcript(history, offered):
        return FILTERED, None
    merged = merge_repair(history, offered)
    if merged is not None:
        return REPAIR, merged
    return OTHER, None
