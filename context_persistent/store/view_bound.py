"""The request view made without the tokenizer while an upper bound of its tokens fits the budget (#23).

A message's tokens are at most the UTF-8 bytes of its text plus its overheads (every token of a byte-level BPE
covers at least one byte; the chars/4 estimator counts fewer still), and its text is no longer than its JSON:
so ``bound(m) = len(JSON of m) + overheads`` is never below what any counter of ours says. When the bounds of a
history sum under the compaction threshold, the view needs no compaction and no exact count: it is the
history made valid for a provider, and the tokenizer (its encoding takes 0.2-0.6 s to load) stays off the
request path. The view says so (``stats["token_count_exact"]`` False, ``token_count`` the bound), and the
calibration gets no estimate for it (docs/tokens.md).

Checkpoints keep a *clean prefix* (``view_prefix`` in the front section, docs/format.md): the first ``h``
messages needed no repair and left no call open, so a view of the history is those messages as they are
plus the repaired rest; with their bound recorded, a process that resumes a long session builds its first
view from the messages after ``h`` only, instead of analysing the whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..model import codec
from ..model.compaction import RequestView
from ..model.grouping import analyse
from ..model.tokens import MESSAGE_OVERHEAD, TOOL_CALL_OVERHEAD
from .session import Session

#: Stats of a view made from bounds, besides what every view has.
_INEXACT = {"token_count_exact": False, "token_count_source": "upper bound (JSON bytes)"}


def bound(message: Any) -> int:
    """An upper bound of ``message``'s tokens under any counter of ours (see the module docstring)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return len(codec.dumps(message)) + MESSAGE_OVERHEAD + TOOL_CALL_OVERHEAD * len(calls or ())


class Bounds(Sequence[int]):
    """``bounds[i]``: the bound of ``history[i]``, computed when read (a view extension reads only its tail)."""

    __slots__ = ("_h",)

    def __init__(self, history: Sequence[Any]) -> None:
        self._h = history

    def __len__(self) -> int:
        return len(self._h)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [bound(m) for m in self._h[i]]
        return bound(self._h[i])


#: The least bound a message can have (``{}``): a history longer than the limit over this never fits.
MIN_BOUND = 2 + MESSAGE_OVERHEAD


def fits(total: int, budget: int, config: Any) -> bool:
    """Whether a view of ``total`` tokens at most needs no compaction and no warning at ``budget``."""
    return total <= budget and not (config.auto_compact and total >= config.compact_threshold * budget)


class BoundViews:
    """Makes the bounded view of one session and keeps its clean prefix for the next checkpoint."""

    def __init__(self, session: Session) -> None:
        self._s = session
        #: (epoch, h, key of message h - 1, bound of messages[:h]): the clean prefix of this epoch's history.
        self.prefix: tuple[int, int, int, int] | None = None
        #: (epoch, hint) a checkpoint recorded: checked against the history when it is first used (reading a
        #: key of a lazily opened history at open could load it).
        self._restored: tuple[int, Any] | None = None

    def restore(self, hint: Any) -> None:
        """Keep the clean prefix a checkpoint recorded (``{"h", "key", "bound"}``) for the first view."""
        self._restored = (self._s.epoch, hint) if isinstance(hint, dict) else None

    def may_fit(self, budget: int, config: Any) -> bool:
        """Whether the clean prefix the checkpoint recorded fits ``budget`` by its bound (without reading the
        history: the rest is known only once it is loaded)."""
        restored = self._restored
        hint = restored[1] if restored is not None and restored[0] == self._s.epoch else None
        total = hint.get("bound") if hint is not None else None
        return type(total) is int and fits(total, budget, config)

    def _check_restored(self, keys: Any) -> None:
        restored, self._restored = self._restored, None
        if restored is None or restored[0] != self._s.epoch:
            return
        hint = restored[1]
        h, key, total = hint.get("h"), hint.get("key"), hint.get("bound")
        if type(h) is not int or type(key) is not int or type(total) is not int or h < 1 or total < 0:
            return
        if h <= len(keys) and keys[h - 1] == key:  # (anything but appends since moves or replaces that key)
            self.prefix = (self._s.epoch, h, key, total)

    def hint(self) -> dict[str, Any] | None:
        """The clean prefix for a checkpoint's front section (None: none known for the current history)."""
        p = self.prefix
        if p is None or p[0] != self._s.epoch:
            restored = self._restored  # (not used in this process: pass it on while the history is the same)
            return restored[1] if restored is not None and restored[0] == self._s.epoch else None
        return {"h": p[1], "key": p[2], "bound": p[3]}

    def _keep(self, h: int, prefix_bound: int, keys: Any) -> None:
        self.prefix = (self._s.epoch, h, int(keys[h - 1]), prefix_bound) if h > 0 else None

    async def view(self, messages: Sequence[Any], keys: Any, budget: int, config: Any
                   ) -> tuple[RequestView, Any] | None:
        """``(view, anchor)`` made from bounds, or None when the bound does not fit (count, then build).

        ``messages`` is the whole history (loaded) and ``keys`` its keys. With a clean prefix only the messages
        after it are read for the bound and the repair; else the whole history is bounded first (cheap) and
        analysed only if that fits.
        """
        from ..model.compaction import build_request_view
        from ..model.compaction.incremental import anchor

        self._check_restored(keys)
        s = self._s
        p = self.prefix
        n = len(messages)
        bounds = Bounds(messages)
        if p is not None and p[0] == s.epoch and p[1] <= n:
            h, prefix_bound = p[1], p[3]
            history_bound = prefix_bound + sum(bounds[h:])
            if not fits(history_bound, budget, config):
                return None
            found = analyse(messages[h:])
            report = found.report
            if not (report.orphan_results_dropped or report.results_moved):
                messages = list(messages)
                out = messages[:h] + found.messages
                total = prefix_bound + sum(bound(m) for m in found.messages)
                if not fits(total, budget, config):
                    return None
                stats: dict[str, Any] = {
                    "budget": budget, "strategy": config.strategy, "strategy_used": None,
                    "before_tokens": history_bound, "before_messages": n, "groups_dropped": 0,
                    "outputs_masked": 0, "truncated": 0, "summarized": False, "warning": None,
                    "repairs": report.as_dict(), "message_count": len(out), "token_count": total,
                    "after_tokens": total, "after_messages": len(out), **_INEXACT,
                }
                view = RequestView(s.view_copy(out, messages), total, False, stats)
                return view, self._anchor(view, messages, keys, bounds, config, history_bound)
        total = sum(bound(m) for m in messages)  # (a paged history is read in runs, not kept)
        if not fits(total, budget, config):
            return None
        messages = list(messages)
        tokens = [bound(m) for m in messages]
        built = await build_request_view(messages, tokens, [False] * n, budget, config, bound, copy=False)
        if built.compacted or not fits(built.token_count, budget, config):
            return None
        view = RequestView(s.view_copy(built.messages, messages), built.token_count, False,
                           {**built.stats, **_INEXACT})
        return view, self._anchor(view, messages, keys, tokens, config, total)

    def _anchor(self, view: RequestView, messages: list[Any], keys: Any, tokens: Sequence[int], config: Any,
                total: int) -> Any:
        """The view's anchor; the messages before its user turn are a clean prefix when nothing was repaired."""
        from ..model.compaction.incremental import anchor

        base = anchor(view, messages, tokens, config, bound, history_tokens=total)
        if base is not None and not any(view.stats["repairs"].values()):
            self._keep(base.h, base.prefix_tokens, keys)
        return base
