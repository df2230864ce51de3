"""The front section of a checkpoint (pure): what the first request view of a long session needs, taken from a
loaded projection (:func:`front_of`) and turned back into a lazy one (:func:`restore_front`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from ...model import json_lossless
from ...model.grouping import has_result_blocks, is_real_user_turn, is_system
from ...model.projection import BaseLoader, LazyList, Projection
from .payload import Checkpoint, CheckpointError

#: Front section: turns kept after the head and around each pinned message (what a group search may read),
#: and the most messages one span may hold (beyond it a rebuild simply loads the rest).
FRONT_EXTRA_TURNS = 2
FRONT_MAX_SPAN = 4096
#: The newest messages kept in the front cover this many times the largest budget seen.
FRONT_RECENT_FACTOR = 2


def _clean_turn(message: dict[str, Any]) -> bool:
    return is_real_user_turn(message) and not has_result_blocks(message)


def _turns_back(messages: Any, i: int, turns: int, floor: int) -> int:
    """Start of the ``turns``-th clean user turn counting back from ``i`` (the turn holding ``i`` is the first)."""
    for t in range(turns):
        if t:
            i -= 1
        while i > floor and not _clean_turn(messages[i]):
            i -= 1
        if i <= floor:
            return floor
    return i


def _turns_ahead(messages: Any, i: int, turns: int, ceiling: int) -> int:
    """Index just before the ``turns``-th clean user turn after ``i`` (not above ``ceiling``)."""
    for _ in range(turns):
        i += 1
        while i < ceiling and not _clean_turn(messages[i]):
            i += 1
    return min(i, ceiling)


def _low_estimate(message: dict[str, Any]) -> int:
    """A deliberately low token estimate (JSON bytes / 6; English text runs at about 4 bytes a token): the
    newest-messages span then errs on the long side. Only its size depends on it, never a result."""
    return len(json_lossless.dumps(message)) // 6 + 1


class SystemIndex:
    """The indices of a projection's system/developer messages, rescanning only what was appended since.

    Keys increase strictly along the history, and only appends add items without giving every item a new
    key (``messages_replaced`` does), so finding the key last seen at the index last seen means the prefix up
    to it is unchanged; otherwise (a redaction, a replace, a clear) the whole history is scanned again.
    Without it, every checkpoint of a million-message session scanned them all on the event loop (~0.25 s).
    """

    __slots__ = ("scanned", "last_key", "found")

    def __init__(self) -> None:
        self.scanned = 0
        self.last_key: int | None = None
        self.found: list[int] = []

    def seed(self, state: Projection) -> None:
        """Take the indices a lazy history holds (it knows every system message), so that no checkpoint of
        this process scans the history, not even after the rest is loaded. Never loads anything."""
        messages, keys = state.messages, state.keys
        known = getattr(messages, "system_indices", None)
        n = len(messages)
        last = keys.get_known(n - 1) if n and isinstance(keys, LazyList) else None
        if known is not None and last is not None:
            self.found, self.scanned, self.last_key = list(known), n, last

    def seed_front(self, front: dict[str, Any], state: Projection, seq: int) -> None:
        """Take the indices a whole front section at ``seq`` lists (slim_front) for ``state``, read with it at
        open (policy.Checkpointer._load_whole), if they fit it; else nothing (the first checkpoint scans)."""
        system, n = front.get("system"), len(state.messages)
        if state.head_seq == seq and front.get("n") == n and n and isinstance(system, list) and all(type(i) is int and 0 <= i < n
                                                                           for i in system):
            self.found, self.scanned, self.last_key = sorted(system), n, state.keys[n - 1]

    def of(self, state: Projection) -> list[int]:
        messages, keys = state.messages, state.keys
        n, start, found = len(messages), self.scanned, self.found
        if start > n or (start and keys[start - 1] != self.last_key):
            start, found = 0, []
        # (assigned only at the end: a read that fails, e.g. LoadRefused on a lazy history, changes nothing)
        found = list(found)
        for off in range(start, n, 4096):  # (in slices: a paged history reads them in runs, a slice at a time)
            found.extend(off + j for j, m in enumerate(messages[off:min(n, off + 4096)]) if is_system(m))
        self.found, self.scanned, self.last_key = found, n, (keys[n - 1] if n else None)
        return list(found)


def front_of(state: Projection, *, keep_head: int, recent_tokens: int,
             system: list[int] | None = None) -> dict[str, Any]:
    """The front section of a (loaded) projection: see the package docstring.

    Runs on the event loop when a checkpoint is taken, so it tokenises nothing (the newest-messages span is
    measured with the counts already known and a low estimate for the others) and does not scan the history:
    ``system`` comes from a :class:`SystemIndex` and pinned messages are found by bisection over the keys.
    """
    messages, keys, tokens = state.messages, state.keys, state.tokens
    n = len(messages)
    if system is None:
        system = SystemIndex().of(state)
    keep: set[int] = set(system)
    # The head: the first keep_head non-system messages and the first real user turn, then a few turns more.
    i, seen, first_user = 0, 0, False
    while i < n and (seen < keep_head or not first_user) and i < FRONT_MAX_SPAN:
        m = messages[i]
        if not is_system(m):
            seen += 1
            first_user = first_user or is_real_user_turn(m)
        i += 1
    # (+1: the message at which a turn search stopped is read by it, so a front recomputed from this front
    # alone, as a checkpoint of a still lazy history does, finds it in memory)
    keep.update(range(min(_turns_ahead(messages, i, FRONT_EXTRA_TURNS, min(n, FRONT_MAX_SPAN)) + 1, n)))
    # The newest messages up to recent_tokens, from a clean user turn a few turns back.
    acc, r = 0, n
    while r > 0 and acc < recent_tokens:
        r -= 1
        t = tokens[r]
        acc += t if t is not None else _low_estimate(messages[r])
    if r < n:  # (recent_tokens 0: no newest span at all)
        r = _turns_back(messages, r, FRONT_EXTRA_TURNS + 1, max(0, r - FRONT_MAX_SPAN))
    keep.update(range(r, n))
    # Pinned messages, with the turns around them (their tool groups).
    # Keys increase strictly along the history (see SystemIndex): bisection, over the keys in memory first
    # while the history is lazy (a bisection over the whole list would read, so load, unknown items).
    known = keys.known_indices() if type(keys) is LazyList and not keys.loaded else None
    for k in state.pinned:
        p = -1
        if known is not None:
            j = bisect.bisect_left(known, k, key=keys.get_known)
            if j < len(known) and keys.get_known(known[j]) == k:
                p = known[j]
        if p < 0:
            p = bisect.bisect_left(keys, k)
        if p < r and keys[p] == k:
            lo = _turns_back(messages, p, FRONT_EXTRA_TURNS + 1, max(0, p - FRONT_MAX_SPAN))
            hi = min(_turns_ahead(messages, p, FRONT_EXTRA_TURNS, min(n, p + FRONT_MAX_SPAN)) + 1, n)
            keep.update(range(lo, hi))
    idx = sorted(keep)
    return {
        "meta": {"pinned": sorted(state.pinned), "head_seq": state.head_seq, "has_history": state.has_history,
                 "session": state.session, "counts": state.counts},
        "n": n, "system": system, "idx": idx,
        "messages": [messages[j] for j in idx], "keys": [keys[j] for j in idx],
        "tokens": [tokens[j] for j in idx],
    }


#: Layout 6: a front section that would hold at least this share of the history's messages is written
#: *whole* when a message section is written with it (:func:`slim_front`).
WHOLE_SHARE = 0.5


def covers_most(front: dict[str, Any]) -> bool:
    """Whether a front section (:func:`front_of`) holds at least ``WHOLE_SHARE`` of the history's messages: its
    messages would repeat most of a message section, and an open would load the rest anyway."""
    return len(front["idx"]) >= WHOLE_SHARE * front["n"] > 0


def slim_front(front: dict[str, Any]) -> dict[str, Any]:
    """The front section written *whole* (layout 6, docs/format.md): ``"whole": true`` and no messages, keys or
    token counts (``idx`` and the three lists empty); the reader loads the state and message sections at open
    instead of opening lazily, so no message is parsed twice."""
    return {**front, "whole": True, "idx": [], "messages": [], "keys": [], "tokens": []}


def is_whole(front: Any) -> bool:
    """Whether a front section was written whole (:func:`slim_front`): the open reads the whole state."""
    return isinstance(front, dict) and front.get("whole") is True


def front_section(state: Projection, hints: tuple[int, int], system: list[int], counted: int,
                  summed: tuple[int, int] | None, prefix: dict[str, Any] | None) -> dict[str, Any]:
    """The front section a checkpoint writes (:func:`front_of` at ``hints``: ``(keep_head, recent_tokens)``),
    with ``counted`` (messages counted), ``tokens_total`` (``summed``, or the loaded history's own sum when
    every message is counted) and the request view's clean prefix when known."""
    front = front_of(state, keep_head=hints[0], recent_tokens=hints[1], system=system)
    front["counted"] = counted
    if summed is None and not state.is_lazy and counted == front["n"]:
        summed = (front["n"], sum(state.tokens))  # type: ignore[arg-type]  # (a loaded history: read whole here anyway)
    front["tokens_total"] = list(summed) if summed is not None else None
    if prefix is not None:
        front["view_prefix"] = prefix
    return front


def restore_front(cp: Checkpoint, tokenizer: Callable[[], str], loader: BaseLoader, pager: Any = None) -> Projection:
    """A lazy projection from ``cp.front``; ``loader()`` returns the whole state's lists when needed."""
    front = cp.front
    assert front is not None
    try:
        n, idx, msgs, keys, toks = front["n"], front["idx"], front["messages"], front["keys"], front["tokens"]
        system = front["system"]
        ok = (isinstance(n, int) and n >= 0 and len(idx) == len(msgs) == len(keys) == len(toks)
              and all(isinstance(i, int) and 0 <= i < n for i in idx)
              and all(isinstance(i, int) and 0 <= i < n for i in system)
              and all(isinstance(k, int) for k in keys) and all(isinstance(m, dict) for m in msgs))
        if not ok:
            raise CheckpointError("front section has inconsistent lists")
        if not all(t is None or (isinstance(t, int) and t >= 0) for t in toks):
            raise CheckpointError("front section holds token counts that are not non-negative integers")
        if any(t is not None for t in toks) and (cp.tokenizer is None or cp.tokenizer != tokenizer()):
            toks = [None] * len(toks)  # counted by another tokenizer: count again, lazily
        state = Projection.lazy(front["meta"], n, {i: (m, k, t) for i, m, k, t in zip(idx, msgs, keys, toks)},
                                system, loader, pager)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"front section does not load: {type(e).__name__}: {e}") from None
    if state.head_seq != cp.seq:
        raise CheckpointError(f"front section is at seq {state.head_seq}, the header says {cp.seq}")
    return state

