"""The calibrated meter (pure): how a provider counts a request compared with the store's own tokenizer,
learnt from the provider's reports, and the budget in the store's tokens that keeps the provider's count
inside the provider's budget (docs/tokens.md).

For each (provider, model) the store pairs what the provider reported for a request (``request_tokens``)
with what its own tokenizer counted for the request view it served (``estimated_tokens``), and fits
``reported = slope * estimated + overhead``: the slope is the tokenizers' ratio, the overhead the fixed part
the context never sees (tool schemas, the provider's framing). The fit leans high:

- the slope is the median of the slopes between reports at least ``SPREAD`` times apart in size (robust to a
  report that wobbles), raised by ``MARGIN``, and never above ``r``, the largest whole ratio
  ``reported / estimated`` among the largest requests (which already includes the overhead, so is at least
  the true slope); without two reports that far apart it is the provider's prior where that is a published
  upper end (Claude, OpenAI), also capped by ``r``, else ``r`` itself;
- the overhead is the smallest that puts every recent report on or under the line.

So every recent report is predicted at or above what was reported, and a request larger than the smallest
recent one is predicted at least ``(1 - e)`` times its true count, or ``(1 - 3e) * (1 + MARGIN)`` times,
whichever is less, when the provider's counts wobble by a factor ``1 +- e``, provided the reports span a
factor of ``SPREAD`` or the prior in use is at least the true slope (tests/test_usage_model.py checks this
with Hypothesis). Before that, a provider counting more than its published prior is under-estimated by at
most ``(true slope - prior) * (growth of the request since the largest report)``: one turn's growth.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from operator import truediv
from typing import Any, Final

from .usage import request_tokens
from .values import Frozen, set_field as _set

#: Reports kept per (provider, model): the fit follows the newest, so a model whose counting changes (a new
#: version behind the same name) is followed within this many reports.
WINDOW: Final = 32
#: How much the fitted slope is raised: room for a provider count that wobbles with the content.
MARGIN: Final = 0.05
#: Two reports give a slope only when one request is at least this many times the other's size (closer ones
#: amplify a wobble of the counts into a wrong slope).
SPREAD: Final = 2.0


class Prior(Frozen):
    """The slope assumed before a provider has reported, and where that number comes from."""

    __slots__ = ("slope", "source", "upper")
    slope: float
    source: str
    #: The slope is a published upper end for this provider: used as the slope until reports spread (else
    #: the whole ratio of the reports is, which needs no assumption).
    upper: bool

    def __init__(self, slope: float, source: str, upper: bool = True) -> None:
        _set(self, "slope", slope)
        _set(self, "source", source)
        _set(self, "upper", upper)


#: Per-provider priors, matched on the provider and model names (first match wins). Claude's tokenizer is not
#: public: published calibrations put it at about 1.18x OpenAI's o200k for earlier models and about 1.5x for
#: the newest (sammcj/ingest PR #65), and strands-agents measured tiktoken undercounting Claude by 23-40%
#: (strands-agents harness PR #2031): the prior takes the upper end. OpenAI's models are counted by tiktoken
#: exactly (cl100k for GPT-4/3.5, o200k for the newer ones, which counts fewer tokens than cl100k).
PRIORS: Final = (
    (("anthropic", "claude"), Prior(1.5, "Claude vs cl100k/o200k: 1.18-1.5x (sammcj/ingest PR #65; "
                                         "strands-agents harness PR #2031: tiktoken undercounts by 23-40%)")),
    (("openai", "azure", "gpt", "o1", "o3", "o4"), Prior(1.0, "OpenAI models: tiktoken counts them exactly")),
)
UNKNOWN_PRIOR: Final = Prior(1.0, "no published calibration: the store's own count until the first report",
                             upper=False)


def prior_for(provider: str | None, model: str | None) -> Prior:
    text = f"{provider or ''} {model or ''}".lower()
    for words, prior in PRIORS:
        if any(w in text for w in words):
            return prior
    return UNKNOWN_PRIOR


class Fit(Frozen):
    """``reported ~ slope * estimated + overhead`` for one (provider, model), and how it was made."""

    __slots__ = ("slope", "overhead", "reports", "calibrated", "prior")
    slope: float
    overhead: int
    reports: int
    calibrated: bool
    prior: Prior

    def __init__(self, slope: float, overhead: int, reports: int, calibrated: bool, prior: Prior) -> None:
        _set(self, "slope", slope)
        _set(self, "overhead", overhead)
        _set(self, "reports", reports)
        _set(self, "calibrated", calibrated)
        _set(self, "prior", prior)

    def predict(self, estimated: int) -> float:
        """The provider's count expected for a request the store counts ``estimated`` tokens."""
        return self.slope * estimated + self.overhead

    def budget(self, provider_budget: int) -> int:
        """The budget in the store's tokens whose prediction fits ``provider_budget`` (at least 1)."""
        return max(1, int((provider_budget - self.overhead) / self.slope))

    def describe(self) -> str:
        if not self.calibrated:
            return f"prior x{self.slope:.2f} ({self.prior.source})"
        plus = f" + {self.overhead:,} fixed" if self.overhead else ""
        return f"calibrated x{self.slope:.2f}{plus} from {self.reports} report{'s' * (self.reports != 1)}"


def fit(points: list[tuple[int, int]], prior: Prior, carried_overhead: int = 0, reports: int | None = None) -> Fit:
    """The fit of ``points`` (``(estimated, reported)`` pairs, both >= 1) under ``prior`` (module docstring).
    ``carried_overhead`` is the overhead to assume before this key's first report (another model's, same host)."""
    if not points:
        return Fit(prior.slope, carried_overhead, 0, False, prior)
    n = len(points)
    # Sorted by size, so the pairs at least SPREAD apart are found by bisection: a session whose requests grow
    # slowly has none, and the fit (made once per report) costs O(n log n), not a test of all n^2 pairs.
    pts = sorted(points)
    es = [e for e, _ in pts]
    rs = [r + 0.5 for _, r in pts]  # (a reported count is a rounded one: up to half a token under)
    e_max = es[-1]
    big = bisect_left(es, e_max / 2)  # (the largest requests: 2 * e >= e_max)
    ratio = max(map(truediv, rs[big:], es[big:]))
    slopes = []
    if SPREAD * es[0] <= e_max:
        for i, (ei, ri) in enumerate(zip(es, rs)):
            j = bisect_left(es, SPREAD * ei, i + 1)
            if j == n:
                break
            slopes += [(rj - ri) / (ej - ei) for ej, rj in zip(es[j:], rs[j:])]
    if slopes:
        from statistics import median  # (loaded by the first fit: the host's turn need not import it, #23)

        raised = median(slopes) * (1 + MARGIN)
    else:
        raised = prior.slope * (1 + MARGIN) if prior.upper else ratio
    slope = max(min(ratio, raised), 1e-3)
    overhead = max(0, max(r - slope * e for e, r in zip(es, rs)))
    return Fit(slope, int(overhead) + (overhead % 1 > 0), n if reports is None else reports, True, prior)


Key = tuple[str | None, str | None]


class Calibration:
    """The fold of ``usage_reported`` data into per-(provider, model) points; rebuilt from the log's newest
    reports at open (the newest ``WINDOW`` per key are all the fit reads, so a suffix of the log gives the
    same fit as the whole log when it holds them)."""

    __slots__ = ("points", "counts", "last_key", "version", "_fits")

    def __init__(self) -> None:
        self.points: dict[Key, deque[tuple[int, int]]] = {}
        self.counts: dict[Key, int] = {}
        #: The key of the newest report: the model in use when a request does not name one.
        self.last_key: Key | None = None
        #: Counts the reports folded: a fit (or a budget made from one) is good while this is unchanged.
        self.version = 0
        #: Fits made since the last report (a request asks for one; the fit reads up to WINDOW^2 pairs).
        self._fits: dict[Key, tuple[Fit, Key]] = {}

    def apply(self, data: Mapping[str, Any]) -> None:
        self.last_key = (data.get("provider"), data.get("model"))
        self.add_point(data)

    def add_point(self, data: Mapping[str, Any]) -> None:
        """Pair a report's ``estimated_tokens`` with what it reported (a report folded by :meth:`apply` before
        its view was counted is paired by this once it is: store/usage.py)."""
        key: Key = (data.get("provider"), data.get("model"))
        self.version += 1
        self._fits.clear()
        reported = request_tokens(data)
        estimated = data.get("estimated_tokens")
        if not reported or not isinstance(estimated, int) or estimated < 1:
            return  # (nothing to pair: the ledger still counts it)
        self.points.setdefault(key, deque(maxlen=WINDOW)).append((estimated, reported))
        self.counts[key] = self.counts.get(key, 0) + 1

    def key_for(self, provider: str | None, model: str | None) -> Key | None:
        """The key a request to ``provider``/``model`` is calibrated by: the exact one, else one with the same
        model, else (nothing named) the newest report's; None: a model with no report yet."""
        if provider is None and model is None:
            return self.last_key
        if (provider, model) in self.points:
            return (provider, model)
        if model is not None:
            same = [k for k in self.points if k[1] == model]
            if same:
                return same[0]
        if model is None:
            same = [k for k in self.points if k[0] == provider]
            if same:
                return same[-1]
        return None

    def fit_for(self, provider: str | None, model: str | None) -> tuple[Fit, Key]:
        """The fit a request to ``provider``/``model`` is made with, and the key it belongs to."""
        memo = (provider, model)
        made = self._fits.get(memo)
        if made is None:
            made = self._fits[memo] = self._fit_for(provider, model)
        return made

    def _fit_for(self, provider: str | None, model: str | None) -> tuple[Fit, Key]:
        key = self.key_for(provider, model)
        if key is None or key not in self.points:
            name = key or (provider, model)
            carried = max((fit(list(p), prior_for(*k)).overhead for k, p in self.points.items()), default=0)
            return fit([], prior_for(*name), carried), name
        return fit(list(self.points[key]), prior_for(*key), reports=self.counts[key]), key
