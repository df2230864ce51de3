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
  Among those, an *edited transcript* (:func:`transcript_edits`: messages of the history left out of it, or
  changed in it, between messages it shares with the history) is what a user editing ``transcript.jsonl``
  produces; the store warns about it once per session.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import orjson

from . import json_lossless
from .grouping import result_key, tool_calls_of
from .replay import TRANSCRIPT_SKIPS, normalise, same_message

FILTERED = "filtered_transcript"
REPAIR = "host_repair"
OTHER = "not_recognised"
EDITED = "edited_transcript"


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


def is_stored_transcript(history: Any, offered: Any) -> bool:
    """Whether ``offered`` is a list of the history's conversation messages (no system or developer message),
    each equal to the stored one as it is or to its normal form (replay.normalise: what the Amplifier CLI's
    ``transcript.jsonl`` holds of a message), in order, from the first: the host's transcript of the history.
    Such a transcript holds nothing the store did not check when it stored it (every message equals a stored
    one, or the same less some of its keys), so the resume rule can ignore it without checking it again
    (store/edits.py)."""
    if type(offered) is not list or not offered or len(history) < len(offered):
        return False
    mine = _conversation(history)
    if len(mine) < len(offered):
        return False
    del mine[len(offered):]
    # The usual case, checked in C: plain dicts (a subclass could answer == as it likes), each equal to a
    # conversation message of ours, so none is a system or developer message and none holds anything new.
    if mine == offered and set(map(type, offered)) == {dict}:
        return True
    skips = TRANSCRIPT_SKIPS
    for m in offered:
        if type(m) is not dict or m.get("role") in skips:
            return False
    return all(o == h or o == normalise(h) for h, o in zip(mine, offered))


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
    results = [m for m in history if m.get("role") == "tool"]
    out: list[dict[str, Any]] = []
    left_out: list[dict[str, Any]] = []  # results of the history not at their place...
    moved: list[dict[str, Any]] = []  # ...and results of the history the repair put elsewhere: the same lists
    changed = False
    j = 0

    def insertable(m: dict[str, Any]) -> bool:
        role = m.get("role")
        if role == "tool":
            key = result_key(m)
            if key in orphans:  # a result for a call of the history that has none (each call once)
                orphans.discard(key)  # type: ignore[arg-type]
                return True
            if any(m == r for r in results) and sum(m == r for r in moved) < sum(m == r for r in results):
                moved.append(m)  # a result of the history, moved by the repair
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
            changed = True  # a result the repair moved (checked below: a dropped one is no repair)
            left_out.append(h)
        else:
            return None
    while j < len(offered):
        if not insertable(offered[j]):
            return None
        out.append(offered[j])
        j += 1
        changed = True
    if not _same_items(left_out, moved):  # a result left out and not put elsewhere would leave every view
        return None
    return out if changed else None


def _same_items(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether ``a`` and ``b`` hold the same messages, each as often, in any order."""
    rest = list(b)
    for m in a:
        for i, r in enumerate(rest):
            if r == m:
                del rest[i]
                break
        else:
            return False
    return not rest


def classify(history: Any, offered: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]] | None]:
    """``(FILTERED, None)``, ``(REPAIR, merged history)`` or ``(OTHER, None)``."""
    if is_filtered_transcript(history, offered):
        return FILTERED, None
    merged = merge_repair(history, offered)
    if merged is not None:
        return REPAIR, merged
    return OTHER, None


def _canonical(message: dict[str, Any]) -> bytes:
    """A message's normal form as bytes (key order aside): equal for messages :func:`same_message` equates."""
    return json_lossless.dumps(normalise(message), option=orjson.OPT_SORT_KEYS)


def transcript_edits(history: Any, offered: list[dict[str, Any]]) -> dict[str, list[int]] | None:
    """How ``offered`` (neither a filtered transcript nor a repair of ``history``) shows an edit of the host's
    transcript, or None when it does not.

    The conversations are aligned in order (each offered message matched to the next equal one of the history):
    ``removed`` are history messages skipped before a match (left out of the transcript, not merely not saved
    yet), ``changed`` are history messages whose place an unmatched offered message of the same role takes,
    between two matches or after the last one. Offered messages with no counterpart (a copy taken before a
    redaction, an erasure or a clear) and history messages after the last match (the transcript behind the
    log) are no edit. Without any match the transcript shares nothing with the history: no edit is claimed.
    Indices are positions in ``history`` (system and developer messages included); one pass, each message
    normalised once.
    """
    positions: dict[bytes, list[int]] = {}
    conversation: list[int] = []  # history index of each conversation message
    for i, m in enumerate(history):
        if m.get("role") not in TRANSCRIPT_SKIPS:
            positions.setdefault(_canonical(m), []).append(len(conversation))
            conversation.append(i)
    theirs = _conversation(offered)
    removed: list[int] = []
    changed: list[int] = []
    matched = False
    pos = 0  # the next conversation position a match may take
    extra: list[dict[str, Any]] = []  # offered messages since the last match with no counterpart

    def settle(gap: range) -> list[int]:
        """Pair the offered messages with no counterpart with the history's skipped ones (same role: changed);
        returns the skipped ones left unpaired."""
        skipped = list(gap)
        for m in extra:
            k = next((x for x in skipped if history[conversation[x]].get("role") == m.get("role")), None)
            if k is not None:
                skipped.remove(k)
                changed.append(conversation[k])
        extra.clear()
        return skipped

    for m in theirs:
        found = positions.get(_canonical(m))
        at = bisect_left(found, pos) if found else 0
        if not found or at == len(found):
            extra.append(m)
            continue
        k = found[at]
        removed.extend(conversation[x] for x in settle(range(pos, k)))
        pos = k + 1
        matched = True
    if not matched:
        return None
    settle(range(pos, len(conversation)))  # (what stays unpaired there is the log ahead of the transcript)
    if not removed and not changed:
        return None
    return {"removed": sorted(removed), "changed": sorted(changed)}
