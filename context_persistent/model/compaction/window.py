"""Windowed rebuilds: the input of a full request-view build reduced to what can end up in the view (pure).

On a long session a full rebuild walks (and tokenises) the whole history although only the newest part can
fit the budget. :func:`plan_window` walks back from the newest message, counting only the messages it
touches, until their tokens reach the budget: nothing older can fit beside them. The window then starts at
the nearest real user turn at or before that point (so no tool group is split). From the older part only
what the invariants and the strategies rely on is kept, with whole groups: system/developer messages,
pinned messages, the first task statement (first real user turn) and the first ``keep_head`` non-system
messages. One note (pinned in the reduced input, so every strategy keeps it) says how many earlier messages
are not shown. ``docs/compaction.md`` ("Windowed rebuilds") says how results can differ from a whole-history
build.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..grouping import has_result_blocks, analyse, is_real_user_turn, is_system, tool_calls_of
from . import CompactionConfig
from ._base import marker_message

Message = dict[str, Any]

#: Histories shorter than this are always built whole (the walk would save little).
WINDOW_MIN_MESSAGES = 4096
#: How many earlier user turns a group search may look back before giving up (then: a whole build).
MAX_WIDEN = 8


@dataclass(frozen=True, slots=True)
class Window:
    """A reduced input: ``indices`` of the history (in order) with ``note`` inserted at ``note_at``."""

    start: int            #: history index of the first message of the window (a real user turn)
    indices: list[int]    #: history indices of the reduced input, without the note
    note_at: int          #: position of the note in the reduced input
    note: Message
    omitted: int          #: history messages before ``start`` that are not in the reduced input


def _clean_turn(message: Message) -> bool:
    """A real user turn that carries no tool results: no group reaches from before it to it."""
    return is_real_user_turn(message) and not has_result_blocks(message)


def _turn_start(messages: Sequence[Message], i: int) -> int:
    while i > 0 and not _clean_turn(messages[i]):
        i -= 1
    return i


def _next_turn(messages: Sequence[Message], i: int, stop: int) -> int:
    while i < stop and not _clean_turn(messages[i]):
        i += 1
    return i


def _group_of(messages: Sequence[Message], i: int, stop: int) -> list[int] | None:
    """History indices from the first to the last message of the group holding message ``i`` (``[]`` for a
    result the repair drops), or None.

    Searched in the user turns around ``i`` (never at or past ``stop``, where no result answers an older call:
    :func:`_settle_start` made sure), widened a turn at a time while a result's call may be earlier or a
    call's result later. None when that takes more than ``MAX_WIDEN`` turns: the caller builds whole.
    """
    u = _turn_start(messages, i)
    v = _next_turn(messages, i + 1, stop)
    for _ in range(MAX_WIDEN):
        found = analyse(messages[u:v])
        sources: list[int | None] | None = None
        for group in found.groups:
            here = [found.sources[j] for j in group.indices]
            if i - u in here:
                sources = here
                break
        if found.report.orphan_results_dropped and u > 0:  # a result here may answer a call in an earlier turn
            u = _turn_start(messages, u - 1)
        elif sources is None:
            return []  # a result with no call before it anywhere: the whole-history repair drops it too
        elif any(s is None for s in sources) and v < stop:  # a placeholder: the result may come later
            v = _next_turn(messages, v + 1, stop)
        else:
            # The whole span from the call to its last result: the repair of a result depends on what lies
            # between it and its call (adjacent results stay as they are; others are moved or split).
            here_ = [s for s in sources if s is not None]
            return list(range(u + min(here_), u + max(here_) + 1))
    return None


def _settle_start(messages: Sequence[Message], start: int) -> int | None:
    """``start`` moved back until no result in the window answers a call before it (None: build whole)."""
    for _ in range(MAX_WIDEN):
        orphans = set(analyse(messages[start:]).report.orphan_results_dropped)
        if not orphans:
            return start
        # Rare (the repair exists for broken histories): look for the calls in the older part.
        first = next((j for j in range(start) if any(k in orphans for k, _, _ in tool_calls_of(messages[j]))), None)
        if first is None:
            return start  # true orphans: the whole-history repair drops them too
        start = _turn_start(messages, first)
        if start == 0:
            return None
    return None


def find_start(messages: Sequence[Message], token_of: Callable[[int], int], budget: int,
               min_messages: int = WINDOW_MIN_MESSAGES) -> int | None:
    """Where the window starts, or None for a whole build (short history, or the walk reached the start)."""
    n = len(messages)
    if n < min_messages:
        return None
    acc = 0
    i = n
    while i > 0 and acc < budget:
        i -= 1
        acc += token_of(i)
    if acc < budget:
        return None
    start = _turn_start(messages, i)
    return start if start > 0 else None


#: Messages the scan of the older history reads at a time (``_older_facts``).
SCAN_CHUNK = 1024


def _older_facts(messages: Sequence[Message], start: int, keep_head: int
                 ) -> tuple[set[int], list[int], int | None]:
    """System/developer indices before ``start``, the first ``keep_head`` other indices, the first real user turn.

    A history that lists its system messages (``system_indices``: a lazily opened projection) is read only
    up to the first user turn and the head; a plain list is scanned up to ``start``.
    """
    known = getattr(messages, "system_indices", None)
    wanted: set[int] = set() if known is None else {i for i in known if i < start}
    heads: list[int] = []
    first_user: int | None = None
    chunk: Sequence[Message] = ()
    at = 0
    for i in range(start):
        if known is not None:
            if len(heads) >= keep_head and first_user is not None:
                break  # everything else before start is known: the system messages are listed
            if i in wanted:
                continue
            m = messages[i]
        else:  # (read in slices: a paged history reads a slice's messages together)
            if i - at >= len(chunk):
                at, chunk = i, messages[i:min(start, i + SCAN_CHUNK)]
            m = chunk[i - at]
        if is_system(m):
            wanted.add(i)
            continue
        if len(heads) < keep_head:
            heads.append(i)
        if first_user is None and is_real_user_turn(m):
            first_user = i
    return wanted, heads, first_user


def plan_window(messages: Sequence[Message], token_of: Callable[[int], int], pinned: Sequence[int], budget: int,
                config: CompactionConfig, min_messages: int = WINDOW_MIN_MESSAGES) -> Window | None:
    """The reduced input for a rebuild of ``messages`` (the full history), or None to build from all of it.

    ``token_of(i)`` counts message ``i`` (and caches it); ``pinned`` lists the pinned history indices.
    Only a view that would be compacted anyway is windowed (the window alone reaches the budget).
    """
    if not config.auto_compact or config.strategy == "custom":
        return None
    start = find_start(messages, token_of, budget, min_messages)
    if start is None:
        return None
    start = _settle_start(messages, start)
    if start is None:
        return None
    wanted, heads, first_user = _older_facts(messages, start, config.keep_head)
    keep = set(wanted)
    searched: set[int] = set()
    for i in [*heads, *([first_user] if first_user is not None else []), *(p for p in pinned if p < start)]:
        if i in wanted or i in searched:  # (a message inside another group's span still needs its own group)
            continue
        searched.add(i)
        group = _group_of(messages, i, start)
        if group is None:
            return None
        keep.update(group)
    older = sorted(keep)
    omitted = start - len(older)
    if omitted <= 0:
        return None
    indices = older + list(range(start, len(messages)))
    for i in indices:
        token_of(i)
    return Window(start, indices, len(older), marker_message(omitted, None), omitted)


def reduced_input(messages: Sequence[Message], tokens: Sequence[int | None], pinned: Any,
                  window: Window, count: Callable[[Message], int]) -> tuple[list[Message], list[int], list[bool]]:
    """Messages, tokens and pinned flags of the reduced input (the note is pinned so strategies keep it).

    ``pinned[i]`` says whether history index ``i`` is pinned (a list, or any object indexable by int)."""
    idx = window.indices
    msgs = [messages[i] for i in idx]
    toks = [tokens[i] for i in idx]
    pins = [pinned[i] for i in idx]
    if any(t is None for t in toks):
        raise ValueError("every message of the reduced input must be counted (plan_window counts them)")
    at = window.note_at
    msgs.insert(at, window.note)
    toks.insert(at, count(window.note))
    pins.insert(at, True)
    return msgs, toks, pins  # type: ignore[return-value]
