"""Extending a request view between compactions, at a cost that does not grow with the session (pure).

Compaction has hysteresis: it runs when the view reaches ``compact_threshold × budget`` and brings it down to
``target_usage × budget``. Between those two points nothing needs compacting, so a new view is the previous
one plus the new messages. The previous view's *tail* (the latest real user turn and everything after it) is
by invariant the repaired history from that turn on, so the new view is::

    previous_view[:k] + repair(history[h:])

where ``h``/``k`` are the latest real user turn's index in the history and in the view. Only the tail is
re-analysed, so a request after one new message costs O(tail), not O(history). The prefix of the view stays
byte-identical between compactions, which also lets providers' prompt caches hit.

A full rebuild is needed (``extend`` returns None) when the view would reach the threshold, when the tail's
repair would reach into the prefix (a result whose call is older than the latest user turn), or when the
previous view's tail is not the repaired history (a custom strategy, or last-resort truncation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..grouping import analyse, is_real_user_turn
from . import CompactionConfig, RequestView
from ..values import Frozen, set_field as _set

Message = dict[str, Any]


class Anchor(Frozen):
    """What a later request needs to extend ``view`` cheaply."""

    __slots__ = ("view", "hist_len", "history_tokens", "h", "k", "prefix_tokens")
    view: RequestView
    hist_len: int        #: messages in the history the view was made from
    history_tokens: int  #: their tokens
    h: int               #: history index of the latest real user turn
    k: int               #: view index of the same message
    prefix_tokens: int   #: tokens of ``view.messages[:k]``

    def __init__(self, view: RequestView, hist_len: int, history_tokens: int, h: int, k: int,
                 prefix_tokens: int) -> None:
        _set(self, "view", view)
        _set(self, "hist_len", hist_len)
        _set(self, "history_tokens", history_tokens)
        _set(self, "h", h)
        _set(self, "k", k)
        _set(self, "prefix_tokens", prefix_tokens)


def _tail(history: Sequence[Message], tokens: Sequence[int], h: int,
          count: Callable[[Message], int]) -> tuple[list[Message], list[int], list[int | None]] | None:
    found = analyse(history[h:])
    report = found.report
    if report.orphan_results_dropped or report.results_moved:
        return None  # the repair reaches beyond the tail: only a full rebuild sees the whole picture
    toks = [tokens[h + s] if s is not None and m is history[h + s] else count(m)
            for m, s in zip(found.messages, found.sources)]
    return found.messages, toks, found.sources


def _latest_user_turn(messages: Sequence[Message], stop: int = 0) -> int | None:
    for i in range(len(messages) - 1, stop - 1, -1):
        if is_real_user_turn(messages[i]):
            return i
    return None


def anchor(view: RequestView, history: Sequence[Message], tokens: Sequence[int], config: CompactionConfig,
           count: Callable[[Message], int], history_tokens: int | None = None) -> Anchor | None:
    """An anchor for ``view`` (built from ``history``, maybe windowed), or None when it cannot be extended.

    Only ``tokens[h:]`` (the latest user turn on) is read, plus ``sum(tokens)`` unless ``history_tokens``
    gives the total (a windowed rebuild passes what it counted: a lower bound).
    """
    if config.strategy == "custom" or view.stats.get("truncated"):
        return None
    h = _latest_user_turn(history)
    k = _latest_user_turn(view.messages)
    if h is None or k is None:
        return None
    tail = _tail(history, tokens, h, count)
    if tail is None or len(tail[0]) != len(view.messages) - k:
        return None
    total = sum(tokens) if history_tokens is None else history_tokens
    return Anchor(view, len(history), total, h, k, view.token_count - sum(tail[1]))


def extend(base: Anchor, history: Sequence[Message], tokens: Sequence[int], budget: int, config: CompactionConfig,
           count: Callable[[Message], int], copy: Callable[[Any], Any], in_place: bool = False
           ) -> tuple[RequestView, Anchor] | None:
    """The view after messages were appended to the history (nothing else changed), or None to rebuild.

    ``in_place``: the new view's message list is the previous view's, its tail replaced (O(tail), where a new
    list costs O(view)); only for a list nobody else holds (the store hands out copies of it). Nothing is
    changed when None is returned."""
    n = len(history)
    if n < base.hist_len:
        return None
    tail = _tail(history, tokens, base.h, count)
    if tail is None:
        return None
    msgs, toks, sources = tail
    total = base.prefix_tokens + sum(toks)
    if (config.auto_compact and total >= config.compact_threshold * budget) or total > budget:
        return None
    if in_place:
        view_msgs = base.view.messages
        tail_copy = copy(msgs)  # (before the list changes: a failing copy leaves the previous view whole)
        del view_msgs[base.k:]
        view_msgs += tail_copy
    else:
        view_msgs = base.view.messages[: base.k] + copy(msgs)
    history_tokens = base.history_tokens + sum(tokens[base.hist_len:n])
    stats = {**base.view.stats, "message_count": len(view_msgs), "token_count": total, "after_tokens": total,
             "after_messages": len(view_msgs), "before_tokens": history_tokens, "before_messages": n,
             "incremental": True}
    view = RequestView(view_msgs, total, base.view.compacted, stats)
    j = _latest_user_turn(msgs, 1) or 0
    src = sources[j]
    if src is None:
        j = 0
        src = 0
    return view, Anchor(view, n, history_tokens, base.h + src, base.k + j, base.prefix_tokens + sum(toks[:j]))
