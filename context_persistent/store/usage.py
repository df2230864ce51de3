"""Provider-reported usage in one open store: recorded off the request path, folded into the calibrated meter
(model/calibration.py) that the request view's budget follows, rebuilt from the log's newest reports at open."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ..model import events as ev
from ..model.calibration import WINDOW, Calibration, Fit, Key
from ..model.usage import request_tokens, usage_data
from ..storage.log import FileEventLog
from .session import Session
from .view_bound import fits
from .writer import Writer

if TYPE_CHECKING:
    from .ledger import TokenLedger
    from .request_views import RequestViews

logger = logging.getLogger("context_persistent")

#: Reports read back at open: enough for the fit of the few models a session uses (``WINDOW`` each).
REBUILD_REPORTS = 8 * WINDOW
#: The fitted budget moves only when the calibration lowers it, or raises it by more than this fraction: a
#: budget that changed after every report would rebuild the request view every turn instead of extending it.
RAISE_STEP = 0.02
#: What a view's count function answers, asked not to load the tokenizer, when the count needs it.
PENDING: Any = type("Pending", (), {"__repr__": lambda self: "PENDING"})()


def provider_identity(provider: Any) -> tuple[str | None, str | None]:
    """(name, model) of a host's provider object, where it says: its ``name``, and the model of
    ``get_info().defaults`` or a ``default_model``/``model`` attribute."""
    if provider is None:
        return None, None
    name = getattr(provider, "name", None)
    model = None
    try:
        info = provider.get_info() if callable(getattr(provider, "get_info", None)) else None
        defaults = getattr(info, "defaults", None) if info is not None else None
        if isinstance(defaults, dict):
            model = defaults.get("model")
    except Exception as e:  # a provider's info is advice only
        logger.debug("provider.get_info() failed: %s", e)
    for attr in ("default_model", "model"):
        if model is None:
            model = getattr(provider, attr, None)
    return (name if isinstance(name, str) and name else None), (model if isinstance(model, str) and model else None)


class UsageMeter:
    """Records usage reports and keeps the calibration of one session."""

    def __init__(self, session: Session, writer: Writer, ledger: TokenLedger) -> None:
        self._s = session
        self._writer = writer
        self._ledger = ledger
        #: Reports folded before the store counted the view they answer (a view made from bounds: the count
        #: needs the tokenizer): ``(data, count function)``, paired by :meth:`pair` when something counts.
        self.pending: deque[tuple[dict[str, Any], Callable[..., Any]]] = deque(maxlen=REBUILD_REPORTS)
        #: Reports ever made pending (the newest's number; ``pending`` loses its oldest only, from the left) ...
        self._pending_no = 0
        #: ... and ``(number, provider's count, bound)`` of the pending reports that predict a view's count, each
        #: predicting more per token of bound than every later one: the first predicts the most (_pending_fit).
        self._worst: deque[tuple[int, int, int]] = deque()
        self.calibration = Calibration()
        #: Where the newest reports of the log start (its ``REBUILD_REPORTS`` newest, ascending), while known:
        #: checkpoints keep them (``usage_at``, :meth:`known_at`), so that the next open reads them there
        #: instead of reading the log back to the oldest (:meth:`rebuild`). None: not known.
        self.positions: deque[int] | None = None
        self._seen = 0  # (the reports the positions account for: the log's, once they are known)
        self._rewrites = session.rewrites
        writer.on_usage = self._applied
        session.checkpoints.usage_at = self.known_at
        #: (head seq, store's token count, provider key) of the request view served last: what a report answers.
        self.served: tuple[int, int | Callable[..., Any] | None, Key] | None = None
        self.last_report: dict[str, Any] | None = None
        #: ids of the reports recorded (or read back at open): a host recording one twice writes it once.
        self._ids: set[tuple[Any, str]] = set()
        #: (provider budget, key) -> budget in the store's tokens in use (see RAISE_STEP).
        self._budgets: dict[tuple[int, Key], int] = {}
        self.last_fit: tuple[Fit, int, int] | None = None  # (fit, provider budget, store budget) of the last request
        #: (provider budget, provider identity, calibration version, budget returned) of the last request: an
        #: unchanged request (no report since, same model) gets the same budget without a fit's arithmetic.
        self._last: tuple[int, tuple[str | None, str | None], int, int] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._s.config["calibrate"])

    async def rebuild(self) -> None:
        """Fold the log's newest reports (at open). A log that cannot be read back here keeps the prior (logged);
        the store's own reads report what is wrong with it.

        Those before the loaded checkpoint are read where its ``usage_at`` says they start (docs/format.md), the
        rest from the log's tail backwards: a session whose reports are fewer than ``REBUILD_REPORTS`` (every
        one is wanted) is not read back to its oldest. Positions that hold no such record, or fewer than
        wanted, are not used: the log is read back then, as without them (storage/newest.py)."""
        s = self._s
        reports = s.state.counts.get(ev.USAGE_REPORTED)
        file = isinstance(s.log, FileEventLog)
        if not reports:
            self.positions = deque(maxlen=REBUILD_REPORTS) if file else None
            return
        from ..storage.newest import newest_records

        limit = min(REBUILD_REPORTS, reports)
        at, cp = s.checkpoints.loaded_usage_at, s.checkpoints
        known = ((cp.position, at) if file and cp.loaded_seq and type(at) is list and len(at) <= REBUILD_REPORTS
                 and all(type(p) is int for p in at) and at == sorted(at) and (not at or 0 <= at[0]
                                                                                and at[-1] < cp.position) else None)
        where: list[int] = []
        try:  # (no more than the log holds: the backward read stops at its oldest report, not at the start)
            records = await newest_records(s.log, ev.USAGE_REPORTED, limit, known, where)
        except Exception as e:
            logger.warning("session %s: could not read the usage reports back (%s); the meter starts from the prior",
                           s.session_id, e)
            return
        if file and len(where) == len(records) == limit:
            self.positions, self._seen = deque(where, maxlen=REBUILD_REPORTS), reports
        for rec in records:
            data = rec["data"]
            self._fold(data)
            view = data.get("view")
            if data.get("estimated_tokens") is None and isinstance(view, dict):
                self._add_pending(data, self._logged_view(view))

    def _applied(self, start: int | None) -> None:
        """A report of this store was applied at ``start`` in the log (Writer.on_usage)."""
        if self.positions is not None:
            if start is None:
                self.positions = None
            else:
                self.positions.append(start)
        self._seen += 1

    def known_at(self) -> list[int] | None:
        """Where the log's newest reports start (a checkpoint's ``usage_at``), or None when that is not known for
        every one the log holds (an erasure in this process moved records; one was applied some other way)."""
        s = self._s
        if (self.positions is None or s.rewrites != self._rewrites
                or s.state.counts.get(ev.USAGE_REPORTED, 0) != self._seen):
            return None
        return list(self.positions)

    def _fold(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("id"), str):
            self._ids.add((data.get("provider"), data["id"]))
        self.calibration.apply(data)
        self.last_report = data

    def record(self, usage: Any, *, provider: str | None, model: str | None, request_seq: int | None,
               estimated_tokens: int | None, source: str, id: str | None,
               input_includes_cache: bool | None) -> dict[str, Any] | None:
        """Make, fold and queue a ``usage_reported`` event; returns its data (None: this id was recorded)."""
        s = self._s
        s.check_writable()
        served: tuple[int, int | None, Key] | None = None
        later: Callable[..., Any] | None = None  # (the count of the view answered, when it needs the tokenizer)
        if self.served is not None:
            head, counted, key = self.served
            if callable(counted):  # (a view made from bounds: counted now if that needs no tokenizer)
                known = counted(False)
                if known is PENDING:
                    later, known = (counted if getattr(counted, "view", None) is not None else None), None
                else:
                    self.served = (head, known, key)
                counted = known
            served = (head, counted, key)
        if served is not None and request_seq is None and estimated_tokens is None:
            request_seq, estimated_tokens = served[0], served[1]
            if provider is None and model is None:
                provider, model = served[2]
        elif served is not None and estimated_tokens is None and request_seq == served[0]:
            estimated_tokens = served[1]
        else:
            later = None
        data = usage_data(usage, provider=provider, model=model, request_seq=request_seq,
                          estimated_tokens=estimated_tokens, source=source, id=id,
                          input_includes_cache=input_includes_cache)
        if data["id"] is not None and (data["provider"], data["id"]) in self._ids:
            return None
        if later is not None:
            data["view"] = dict(later.view)  # type: ignore[attr-defined]
        self._fold(data)
        if later is not None:
            self._add_pending(data, later)
        self._write(data)
        return data

    def pair(self) -> bool:
        """Count the views the pending reports answer (the tokenizer loads if it has not) and pair them in the
        calibration; True when one was paired. A view the history no longer holds calibrates nothing."""
        paired = False
        while self.pending:
            data, count = self.pending.popleft()
            n = count(True)
            if type(n) is int and n >= 1:
                data["estimated_tokens"] = n
                self.calibration.add_point(data)
                paired = True
        return paired

    def _logged_view(self, view: dict[str, Any]) -> Callable[..., Any]:
        """The count function of a view a logged report answers (``view``: its ``messages``, the ``key`` of the
        last): the history's first messages while the message at that place still has that key."""
        s, ledger = self._s, self._ledger
        n, key = view.get("messages"), view.get("key")

        def count(load: bool = True) -> Any:
            state = s.state
            if type(n) is not int or n < 1 or len(state.messages) < n:
                return None
            if not load:
                known = ledger.prefix_total(n)
                keys = state.keys
                if known is None or getattr(keys, "get_known", lambda i: keys[i])(n - 1) != key:
                    return PENDING if known is None else None
                return known
            if state.keys[n - 1] != key:
                return None
            return sum(ledger.count_indices(range(n))[:n])  # type: ignore[arg-type]
        count.view = view  # type: ignore[attr-defined]
        return count

    async def view_for(self, views: RequestViews, budget: int, provider: Any, source: str, exact: bool = False
                       ) -> Any:
        """The request view at the provider's ``budget`` as the calibration fits it. Reports still pending are
        paired (the tokenizer loads) before the view is counted, or when a view made from bounds does not fit
        what they say: the provider's count of the view it answered, grown in proportion to the bound since.
        A view that fits both is served without them (and without the tokenizer)."""
        if not self.pending or not self.enabled:  # (with calibrate off the reports never change a budget)
            return await views.view(self.fitted_budget(budget, provider), source, exact)

        def refit() -> int:
            self.pair()
            return self.fitted_budget(budget, provider)
        view = await views.view(self.fitted_budget(budget, provider), source, exact, refit)
        if self.pending and not view.stats.get("token_count_exact", True) and not self._pending_fit(
                budget, view.token_count):
            view = await views.view(refit(), source)
        return view

    def _add_pending(self, data: dict[str, Any], count: Callable[..., Any]) -> None:
        self.pending.append((data, count))  # (at most REBUILD_REPORTS: the oldest is dropped)
        self._pending_no += 1
        reported, b = request_tokens(data), data["view"].get("bound")
        if reported and type(b) is int and b > 0:
            worst = self._worst
            while worst and worst[-1][1] * b <= reported * worst[-1][2]:  # (predicts no more than this one)
                worst.pop()
            worst.append((self._pending_no, reported, b))

    def _pending_fit(self, budget: int, bound: int) -> bool:
        """Whether a view of at most ``bound`` tokens fits the provider's ``budget`` by every pending report:
        the provider counted ``r`` for a view of bound ``b``, so this one is predicted at ``r * bound / b``.
        Only the report with the largest ``r / b`` is asked (the others predict no more): a turn's cost does
        not grow with the reports pending (up to REBUILD_REPORTS of them)."""
        worst = self._worst
        oldest = self._pending_no - len(self.pending) + 1  # (the number of the oldest report still pending)
        while worst and worst[0][0] < oldest:
            worst.popleft()
        if not worst:
            return True
        _, reported, b = worst[0]
        return fits(int(reported * bound / b) + 1, budget, self._s.compaction)

    def _write(self, data: dict[str, Any]) -> None:
        """Off the request path: an inline writer keeps the record for its next write (or close) as it does the
        compaction audit records; a group-committing writer (fsync batch, PostgreSQL) queues it for its next
        group, which runs in the background."""
        writer = self._writer
        if writer.inline:
            writer.defer(ev.USAGE_REPORTED, data)
            return
        from ..model import codec

        fut = writer.enqueue(ev.USAGE_REPORTED, data, codec.dumps(data))
        fut.add_done_callback(self._written)

    def _written(self, fut: asyncio.Future[int]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            logger.warning("session %s: a usage report was not recorded: %s", self._s.session_id, fut.exception())

    def fitted_budget(self, budget: int, provider: Any) -> int:
        """The budget the request view is fitted to: ``budget`` (the provider's tokens) turned into the store's
        tokens by the calibration of the provider in use; ``budget`` itself with ``calibrate: false``."""
        if not self.enabled:
            return budget
        ident = provider_identity(provider)
        last = self._last
        if last is not None and last[0] == budget and last[1] == ident and last[2] == self.calibration.version:
            return last[3]
        name, model = ident
        fitted, key = self.calibration.fit_for(name, model)
        target = fitted.budget(budget)
        held = self._budgets.get((budget, key))
        if held is not None and held <= target <= held * (1 + RAISE_STEP):
            target = held  # (a small rise: keep the cached view)
        self._budgets[(budget, key)] = target
        self.last_fit = (fitted, budget, target)
        self._last = (budget, ident, self.calibration.version, target)
        return target

    def serve(self, head_seq: int, tokens: int | Callable[..., Any] | None, provider: Any) -> None:
        """Note the request view just served: the next report answers it. ``tokens`` may be a function that
        counts them when a report needs them (a view made from bounds: store/view_bound.py)."""
        name, model = provider_identity(provider)
        key = (name, model) if provider is not None else (self.calibration.last_key or (None, None))
        self.served = (head_seq, tokens, key)

    def stats(self, tokenizer: str, exact: bool) -> dict[str, Any]:
        """Where the numbers come from (``stats()['sources']``), the calibration in use and the last report."""
        if self.pair() and self._last is not None:  # (the fit the next request gets, at the last one's budget)
            fitted, _ = self.calibration.fit_for(*self._last[1])
            self.last_fit = (fitted, self._last[0], fitted.budget(self._last[0]))
        counted = f"{'exact' if exact else 'estimated'} ({tokenizer})"
        budget: int | None = None
        target: int | None = None
        if self.last_fit is not None:
            fitted, budget, target = self.last_fit
        else:
            fitted, _ = self.calibration.fit_for(None, None)
        cal: dict[str, Any] = {"enabled": self.enabled, "slope": round(fitted.slope, 4), "overhead": fitted.overhead,
                               "reports": fitted.reports, "calibrated": fitted.calibrated,
                               "prior": fitted.prior.slope, "prior_source": fitted.prior.source,
                               "provider_budget": budget, "budget": target}
        return {
            "sources": {
                "tokens": counted,
                "budget": fitted.describe() if self.enabled else f"{counted}; calibration off",
                "last_usage": "reported by the provider" if self.last_report is not None else None,
            },
            "calibration": cal,
            "last_usage": None if self.last_report is None else dict(self.last_report),
        }
