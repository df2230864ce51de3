"""The request view: the history fitted to a token budget, cached, extended after appends, rebuilt from a
window of a long history; with the compaction's hook events, audit records and optional exports.

The view is a read (docs/compaction.md): it never writes or syncs; its ``compacted`` audit record waits in
the writer for the next write.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model import codec
from ..model import events as ev
from .ledger import TokenLedger
from .usage import PENDING
from ..model.projection import LazyList
from ..storage.log import FileEventLog
from .session import EVENT_COMPACTION, EVENT_POST_COMPACT, EVENT_PRE_COMPACT, Session
from .view_bound import MIN_BOUND, BoundViews, Bounds, bound, fits
from .writer import Writer

if TYPE_CHECKING:  # compaction loads on the first request view: `import context_persistent` stays cheap
    from ..model.compaction import RequestView
    from ..model.compaction.incremental import Anchor
    from ..model.compaction.window import Window

logger = logging.getLogger("context_persistent")

#: What a ``compacted`` audit record keeps of a compaction's stats.
_AUDIT_FIELDS = ("budget", "budget_source", "strategy_used", "before_tokens", "after_tokens", "before_messages",
                 "after_messages", "groups_dropped", "outputs_masked", "truncated", "summarized", "warning")


class _Flags:
    """``flags[i]``: whether index ``i`` is in a set (pinned flags without a list as long as the history)."""

    __slots__ = ("_set",)

    def __init__(self, indices: set[int]) -> None:
        self._set = indices

    def __getitem__(self, i: int) -> bool:
        return i in self._set


class RequestViews:
    """Builds and caches the request view of one session.

    ``export_reasoning(path)`` writes the reasoning view to ``path`` (``export_on_compact``).
    """

    #: A rebuild of a history at least this long reads only the newest messages that can fit the budget
    #: (plus what must be kept): compaction/window.py.
    WINDOW_MIN_MESSAGES = 4096

    def __init__(self, session: Session, ledger: TokenLedger, writer: Writer,
                 export_reasoning: Callable[[Path], Awaitable[Any]]) -> None:
        self._s = session
        self._ledger = ledger
        self._writer = writer
        self._export_reasoning = export_reasoning
        self.window_min = self.WINDOW_MIN_MESSAGES
        #: (projection version, budget, epoch, anchor, view, bounded): the request view is reused while neither
        #: version nor budget changes, and extended (compaction/incremental.py) while only messages were
        #: appended; ``bounded``: made from upper bounds of the tokens, not counts (view_bound.py).
        self.cache: tuple[int, int, int, Anchor | None, RequestView, bool] | None = None
        #: The views made without the tokenizer while a bound fits, and the clean prefix checkpoints keep.
        self.bounds = BoundViews(session)
        #: The largest request budget seen: a checkpoint's front section keeps the newest messages up to twice
        #: this (and max_tokens), so the first request after the next open reads nothing else.
        self.max_budget = 0
        #: (budget, warning with its numbers blanked) already logged: a view warning is said once, not per request.
        self._warned: set[tuple[int, str]] = set()
        self._last_export_seq = 0
        #: The window of the last build (compaction/window.py; None: built from the whole history): the history
        #: messages a view it made can hold are those of ``window.indices`` and any appended since.
        self.window: Window | None = None

    def front_hints(self) -> tuple[int, int]:
        """What a checkpoint's front section must cover (checkpoint.front_of)."""
        from ..storage.checkpoint import FRONT_RECENT_FACTOR

        budget = max(self._s.config["max_tokens"], self.max_budget)
        return self._s.compaction.keep_head, FRONT_RECENT_FACTOR * budget

    def should_compact(self, token_count: int | None = None, budget: int | None = None) -> bool:
        """Whether a request view would be compacted (Amplifier's optional internal check)."""
        if token_count is None:
            token_count = self._ledger.total()
        if budget is None:
            budget = self._s.config["max_tokens"]
        cfg = self._s.compaction
        return bool(cfg.auto_compact and token_count >= cfg.compact_threshold * budget)

    async def view(self, budget: int, source: str, exact: bool = False,
                   refit: Callable[[], int] | None = None) -> RequestView:
        """The request view at ``budget`` (``source`` says where the budget came from, for the stats).

        While an upper bound of the history's tokens fits the budget the view is made without counting
        (view_bound.py; its stats say ``token_count_exact`` False); ``exact`` True always counts. ``refit``
        (store/usage.py, reports still to pair) is called before the view is counted and returns the budget
        to count it at."""
        if exact and refit is not None:
            budget, refit = refit(), None
        if self.cache is not None and not self.cache[5]:  # (a counted view, extended, counts what was appended)
            await self._ledger.count_large_off_loop()
        cached = self._cached(budget, exact)
        if cached is not None:
            return cached
        if not exact:
            made = await self._bounded(budget)
            if made is not None:
                return made
        if refit is not None:
            fitted = refit()
            if fitted != budget:
                budget = fitted
                made = self._cached(budget, exact) or (None if exact else await self._bounded(budget))
                if made is not None:
                    return made
        await self._ledger.count_large_off_loop()  # (before counting: large texts in a worker thread)
        return await self._build(budget, source)

    def exact_total(self, view: RequestView) -> Callable[..., Any]:
        """For a view made from bounds: a function that counts its tokens when a provider's report needs them
        (the calibration pairs them), so the tokenizer stays off the request path. A view that repaired
        nothing is the history as it is: its count is the history's (counted once per message, kept by the
        checkpoints); a repaired one's is not known (None: that report calibrates nothing). Called with
        ``load=False`` it answers only what is known without the tokenizer (else ``PENDING``: store/usage.py
        pairs the report later); its ``view`` says which view it counts (kept with such a report)."""
        s = self._s
        state, epoch, n = s.state, s.epoch, len(s.state.messages)
        repaired = any(view.stats.get("repairs", {}).values())
        ledger = self._ledger
        keys = state.keys
        last = (keys.get_known(n - 1) if type(keys) is LazyList and not keys.loaded else keys[n - 1]) if n else None

        def count(load: bool = True) -> Any:
            if repaired or s.state is not state or s.epoch != epoch or len(state.messages) < n:
                return None  # (changed since other than by appends)
            if not load:
                known = ledger.prefix_total(n)
                return PENDING if known is None else known
            if len(state.messages) == n:
                return ledger.total()
            return sum(ledger.count_indices(range(n))[:n])  # type: ignore[arg-type]
        count.view = None if repaired or last is None else {  # type: ignore[attr-defined]
            "messages": n, "key": last, "bound": view.token_count}
        return count

    async def _bounded(self, budget: int) -> RequestView | None:
        """The view made from upper bounds of the tokens, cached, or None when the bound does not fit."""
        s = self._s
        cfg = s.compaction
        summed = self._ledger.summed()  # (counts are never above bounds: a counted total that does not fit ...)
        if not fits(len(s.state.messages) * MIN_BOUND, budget, cfg) or (
                summed is not None and not fits(summed[1], budget, cfg)):
            return None  # (... or a history too long to fit even at the least bound a message has)
        if s.state.is_lazy and not self.bounds.may_fit(budget, cfg):
            return None  # (a lazily opened history is loaded only if its checkpoint says the bound may fit)
        state = s.full()
        version = state.version
        made = await self.bounds.view(state.messages, state.keys, budget, cfg)
        if made is None:
            return None
        view, base = made
        self.max_budget = max(self.max_budget, budget)
        self.window = None
        self.cache = (version, budget, s.epoch, base, view, True)
        return view

    def _cached(self, budget: int, exact: bool = False) -> RequestView | None:
        """The cached view when the history did not change, or the cached view extended by the messages
        appended since (None: rebuild). A budget below the one the view was built for keeps it while it fits
        under that budget's threshold (a calibrated budget falls a little with many reports: docs/tokens.md);
        a higher one rebuilds, so the view gets the room. The cache keeps the budget it was built for: a view
        checked against a lower budget fits the higher one too."""
        s = self._s
        state = s.state
        cached = self.cache
        if cached is None or cached[1] < budget or (exact and cached[5]):
            return None
        if cached[0] == state.version:
            view = cached[3].view if cached[3] is not None else cached[4]
            if cached[1] != budget:
                cfg = s.compaction
                if (cfg.auto_compact and view.token_count >= cfg.compact_threshold * budget) \
                        or view.token_count > budget:
                    return None
            return view
        if cached[2] == s.epoch and cached[3] is not None:
            # Only messages were appended since: extend the view unless it now needs compacting.
            # Only the tail (from the anchor's user turn) is read: count just that, not the history.
            from ..model.compaction.incremental import extend

            if cached[5]:  # (made from bounds: extended from bounds, counting nothing)
                tokens_now: Any = Bounds(state.messages)
                count: Callable[[Any], int] = bound
            else:
                tokens_now = self._ledger.count_indices(range(cached[3].h, len(state.messages)))
                count = s.counter.count_message
            h = cached[3].h
            # (in place: the view's list is this cache's own; get_messages_for_request hands out copies of it)
            grown = extend(cached[3], state.messages, tokens_now, budget, s.compaction, count,
                           lambda tail: s.view_copy(tail, state.messages[h:], h), in_place=True)
            if grown is not None:
                if cached[5]:
                    grown[0].stats.update(token_count_exact=False)
                self.cache = (state.version, cached[1], s.epoch, grown[1], grown[0], cached[5])
                return grown[0]
        return None

    async def _build(self, budget: int, source: str) -> RequestView:
        from ..model import compaction
        from ..model.compaction.incremental import anchor

        s = self._s
        state = s.state
        version = state.version
        cfg = s.compaction
        count = s.counter.count_message
        self.max_budget = max(self.max_budget, budget)
        built, window, tokens, total = await self._build_windowed(state.messages, budget)
        self.window = window
        messages = state.messages
        if built is None:  # a whole-history build: it reads everything (a lazy state loads the rest)
            # Read once, in runs (a paged history): the build reads each message more than once and tells the
            # messages it kept unchanged by identity, which two reads of one ref would not have.
            messages = list(s.full().messages)
            pinned_keys = state.pinned
            pinned = [k in pinned_keys for k in state.keys] if pinned_keys else [False] * len(messages)
            tokens = self._ledger.counts()
            total = sum(tokens)
        event_base = {"message_count": len(messages), "token_count": total, "budget": budget,
                      "budget_source": source, "strategy": cfg.strategy}
        if window is not None:
            event_base.update(token_count_exact=False, window={"start": window.start, "omitted": window.omitted})
        over = cfg.auto_compact and total >= cfg.compact_threshold * budget
        if over:
            await s.emit(EVENT_PRE_COMPACT, dict(event_base))
        if built is None:
            built = await compaction.build_request_view(messages, tokens, pinned, budget, cfg, count, copy=False)
        stats = {**built.stats, "budget_source": source}
        if window is not None:
            # Only part of the history was counted: its total is a lower bound (before_tokens_exact False).
            stats.update(before_tokens=total, before_tokens_exact=False, before_messages=len(messages),
                         window={"start": window.start, "omitted": window.omitted})
        # The view's dicts share nested values with the history: copy once per change, so nothing a caller does
        # to a request view can reach the stored history (the host's: get_messages' copies, Session.view_copy).
        view = compaction.RequestView(s.view_copy(built.messages, messages), built.token_count, built.compacted,
                                      stats)
        base = anchor(view, messages, tokens, cfg, count, history_tokens=total)
        self.cache = (version, budget, s.epoch, base, view, False)
        self._warn_once(budget, stats)
        if over or view.compacted:
            await s.emit(EVENT_POST_COMPACT, {**event_base, **stats})
        if view.compacted:
            await self._compacted(budget, source, stats)
        return view

    def _warn_once(self, budget: int, stats: dict[str, Any]) -> None:
        if stats.get("warning"):
            said = (budget, re.sub(r"\d[\d,]*", "N", stats["warning"]))
            level = logging.DEBUG if said in self._warned else logging.WARNING  # once per budget and kind
            self._warned.add(said)
            logger.log(level, "session %s: request view: %s", self._s.session_id, stats["warning"])

    async def _compacted(self, budget: int, source: str, stats: dict[str, Any]) -> None:
        """A compaction changed the view: note it, tell the hooks, keep its audit record, export if asked."""
        s = self._s
        s.last_compaction = {**stats, "at_seq": s.state.head_seq, "ts": codec.now_iso()}
        await s.emit(EVENT_COMPACTION, {
            "before_tokens": stats["before_tokens"], "after_tokens": stats["after_tokens"],
            "before_messages": stats["before_messages"], "after_messages": stats["after_messages"],
            "budget": budget, "budget_source": source, "strategy": stats.get("strategy_used") or s.compaction.strategy,
            **({"before_tokens_exact": False, "window": stats["window"]} if "window" in stats else {}),
        })
        self._record_compaction(stats)
        await self._maybe_export_on_compact(stats)

    async def _build_windowed(self, messages: list[dict[str, Any]], budget: int
                              ) -> tuple[RequestView | None, Any, Any, int]:
        """A windowed rebuild (compaction/window.py) when the history is long and far over the budget.

        Returns (view, window, tokens, counted total), or (None, None, tokens, 0) for a whole-history build:
        a short history, a walk that reached the start, a group the window cannot see whole, or a windowed
        view over the budget (or truncated) although the kept-always part fits (the note can tip it over).
        """
        from ..model import compaction
        from ..model.compaction.window import plan_window, reduced_input

        s = self._s
        tokens: Any = s.state.tokens
        if len(messages) < self.window_min:
            return None, None, tokens, 0
        pins = self._pinned_indices()
        window = plan_window(messages, self._ledger.count_one, pins, budget, s.compaction, self.window_min)
        if window is None:
            return None, None, tokens, 0
        count = s.counter.count_message
        msgs, toks, flags = reduced_input(messages, tokens, _Flags(set(pins)), window, count)
        built = await compaction.build_request_view(msgs, toks, flags, budget, s.compaction, count,
                                                    copy=False)
        if built.token_count > budget or built.stats.get("truncated"):
            # Over the budget or truncated to fit: fine when the kept-always part alone is over it (the whole
            # build would be too); otherwise the note tipped it over, so build from the whole history.
            request, _ = compaction._request(msgs, toks, flags, budget, s.compaction, count)
            if request.protected_tokens - toks[window.note_at] <= budget:
                return None, None, tokens, 0
        total = sum(toks) - toks[window.note_at]
        return built, window, tokens, total

    def _pinned_indices(self) -> list[int]:
        """History indices of the pinned messages, in order (a lazy state is searched in memory first)."""
        s = self._s
        state = s.state
        if not state.pinned:
            return []
        keys = state.keys
        if type(keys) is LazyList and not keys.loaded:
            where = {keys.get_known(i): i for i in keys.known_indices()}
            if all(k in where for k in state.pinned):
                return sorted(where[k] for k in state.pinned)
            keys = s.full().keys  # a message pinned outside what the front section kept
        return [i for i, k in enumerate(keys) if k in state.pinned]

    def _record_compaction(self, stats: dict[str, Any]) -> None:
        """Keep a ``compacted`` audit event (what the view left out, and why), for `stats` and operators.

        Made only when a compaction changed the view. A request view is a read: it does not write or sync, so
        the record waits in memory and is appended in the same write as the next event (a message, a pin, ...)
        or at close. A crash before then loses the audit record only, never history (docs/compaction.md).
        """
        s = self._s
        if s.readonly or s.closed:
            return
        record = {k: stats.get(k) for k in _AUDIT_FIELDS}
        if "window" in stats:
            record.update(before_tokens_exact=False, window=stats["window"])
        self._writer.defer(ev.COMPACTED, record)
        if s.config["roll_on_compaction"] and hasattr(s.log, "roll_after_next_append"):
            s.log.roll_after_next_append()  # a segment boundary right after the audit record (segments.py)

    async def _maybe_export_on_compact(self, stats: dict[str, Any]) -> None:
        """With ``export_on_compact``: snapshot the reasoning view when a compaction dropped something, at most
        once per ``export_on_compact_every`` new events."""
        s = self._s
        if not s.config["export_on_compact"] or s.readonly:
            return
        dropped = stats.get("groups_dropped", 0) or stats.get("outputs_masked", 0) or stats.get("truncated", 0)
        seq = s.state.head_seq
        if not dropped or (self._last_export_seq
                           and seq - self._last_export_seq < s.config["export_on_compact_every"]):
            return
        path = s.log_dir() / f"compaction-{seq:010d}.jsonl"
        try:
            async with s.rewriting:  # (an erase waits for this snapshot, or this one starts after it)
                await self._export_reasoning(path)
        except Exception as e:  # an audit snapshot must never break a request
            logger.warning("session %s: export_on_compact to %s failed: %s", s.session_id, path, e)
            return
        self._last_export_seq = seq
        logger.info("session %s: compaction dropped content; reasoning view saved to %s", s.session_id, path)
