"""What a ``set_messages`` on a store that loaded its own log is (pure; the rule is in docs/resume.md).

- a *filtered transcript*: the host's copy of our history (the Amplifier CLI's ``transcript.jsonl``): leave out
  every system and developer message on both sides, bring both to the CLI's normal form (replay.normalise:
  ``None`` fields and ``content_blocks`` dropped), and the offered messages are the history's first ones, in
  order: the same history, or one a turn or more behind. It is ignored (and audited).
- a *host repair*: the history with synthetic results for unanswered tool calls (the CLI's pre-turn repair,
  amplifier_foundation's ``repair_transcript``): every message of the history is kept in order, except
  ``tool`` results the repair moved; what is added is a ``tool`` result answering a call of the history that
  has no result, or an assistant message without calls after such a result. It is applied to the complete
  history (our system and developer messages and exact forms stay) and stored as a replacement.
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
    return all(same_message(h, o) for h, o in zip(mine, theirs))


def merge_repair(history: Any, offered: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The history with the host's repair applied, or None if ``offered`` is not a repair of it."""
    calls: set[str] = set()
    answered: set[str] = set()
    for m in history:
        if m.get("role") == "assistant":
            calls.update(key for key, _, _ in tool_calls_of(m))
        key = result_key(m)
        if key:
            answered.add(key)
    orphans = calls - answered
    theirs = _conversation(offered)
    out: list[dict[str, Any]] = []
    added_results = added_other = removed = 0
    j = 0

    def insertable(m: dict[str, Any]) -> bool:
        nonlocal added_results, added_other
        if m.get("role") == "tool" and result_key(m) in orphans:
            orphans.discard(result_key(m))  # type: ignore[arg-type]
            added_results += 1
            return True
        if m.get("role") == "assistant" and not tool_calls_of(m):
            added_other += 1
            return True
        return False

    for h in history:
        if h.get("role") in TRANSCRIPT_SKIPS:
            out.append(h)  # ours stay where they are (the host's copies are not used)
            continue
        while j < len(theirs) and not same_message(h, theirs[j]) and insertable(theirs[j]):
            out.append(theirs[j])
            j += 1
        if j < len(theirs) and same_message(h, theirs[j]):
            out.append(h)
            j += 1
        elif h.get("role") == "tool":
            removed += 1  # a result the repair moved or dropped
        else:
            return None
    while j < len(theirs):
        if not insertable(theirs[j]):
            return None
        out.append(theirs[j])
        j += 1
    if not added_results and not removed:
        return None  # nothing a repair does: an assistant message alone is not one
    return out


def classify(history: Any, offered: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]] | None]:
    """``(FILTERED, None)``, ``(REPAIR, merged history)`` or ``(OTHER, None)``."""
    if is_filtered_transcript(history, offered):
        return FILTERED, None
    merged = merge_repair(history, offered)
    if merged is not None:
        return REPAIR, merged
    return OTHER, None
