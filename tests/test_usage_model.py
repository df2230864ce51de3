"""The pure parts of usage: reports made into event data, the ledger fold, prices, and the calibration's fit
(Hypothesis: it never under-estimates a provider's count beyond its stated bound)."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from context_persistent.model.calibration import MARGIN, Calibration, Prior, fit, prior_for
from context_persistent.model.usage import (MAX_USAGE_FIELDS, MAX_USAGE_TEXT, Prices, UsageLedger, parse_usage_text,
                                           request_tokens, usage_data)


def test_usage_data_takes_every_spelling() -> None:
    """amplifier_core's Usage (a pydantic model), OpenAI's prompt/completion names and Anthropic's cache names
    all become the same fields; a Decimal cost becomes a float."""
    from amplifier_core.message_models import Usage

    amp = usage_data(Usage(input_tokens=10, output_tokens=2, total_tokens=12, cache_read_tokens=5,
                           cost_usd=Decimal("0.25")), provider="anthropic")
    assert (amp["input_tokens"], amp["output_tokens"], amp["cache_read_tokens"], amp["cost_usd"]) == (10, 2, 5, 0.25)
    oai = usage_data({"prompt_tokens": 7, "completion_tokens": 1})
    assert (oai["input_tokens"], oai["output_tokens"], oai["cache_write_tokens"]) == (7, 1, None)
    ant = usage_data(SimpleNamespace(input_tokens=3, output_tokens=1, cache_creation_input_tokens=4,
                                     cache_read_input_tokens=9))
    assert (ant["cache_write_tokens"], ant["cache_read_tokens"]) == (4, 9)


def test_usage_text_is_read_as_amplifier_core_prints_it() -> None:
    """The str() of amplifier_core's Usage (what its 2.0.2 hook registry hands provider:response handlers) gives
    back every field: None, ints, a Decimal cost, and extra fields holding spaces, '=' or containers."""
    from amplifier_core.message_models import Usage

    usage = Usage(input_tokens=876, output_tokens=28, total_tokens=904, cost_usd=Decimal("0.0123"),
                  cache_creation_input_tokens=5, note="a b=c 'q'", details={"x": 1, "y": [1, 2]}, flag=True)
    assert parse_usage_text(str(usage)) == {
        "input_tokens": 876, "output_tokens": 28, "total_tokens": 904, "reasoning_tokens": None,
        "cache_read_tokens": None, "cache_write_tokens": None, "cost_usd": Decimal("0.0123"),
        "cache_creation_input_tokens": 5, "note": "a b=c 'q'", "details": {"x": 1, "y": [1, 2]}, "flag": True}
    assert parse_usage_text(repr(usage)) == parse_usage_text(str(usage))  # (Usage(input_tokens=876, ...))
    data = usage_data(str(usage), provider="claudelike")
    assert (data["input_tokens"], data["cache_write_tokens"], data["cost_usd"]) == (876, 5, 0.0123)


@pytest.mark.parametrize("text, expected", [
    ('{"input_tokens": 7, "output_tokens": 1}', {"input_tokens": 7, "output_tokens": 1}),
    ("  input_tokens=7\toutput_tokens=None  ", {"input_tokens": 7, "output_tokens": None}),
    ('cost_usd=Decimal("1E-7") input_tokens=1', {"cost_usd": Decimal("1E-7"), "input_tokens": 1}),
    ("input_tokens=1 when=datetime.datetime(2025, 1, 2, 0, 0) output_tokens=2",
     {"input_tokens": 1, "when": "datetime.datetime(2025, 1, 2, 0, 0)", "output_tokens": 2}),
    ("input_tokens=1 name='unclosed output_tokens=2", {"input_tokens": 1, "name": "'unclosed", "output_tokens": 2}),
    ("input_tokens=1 empty= output_tokens=2", {"input_tokens": 1, "empty": "", "output_tokens": 2}),
    ("cost_usd=inf input_tokens=-inf", {"cost_usd": float("inf"), "input_tokens": float("-inf")}),
])
def test_usage_text_odd_values(text: str, expected: dict) -> None:
    """JSON objects, tabs, Decimal in either quote, values that do not read back (kept as their text), an
    unclosed quote, an empty value and infinities each parse to what the text says (the checks refuse them)."""
    assert parse_usage_text(text) == expected


@pytest.mark.parametrize("text, words", [
    ("", "name=value fields"),
    ("hello world", "name=value fields"),
    ("Usage object at 0x7f input_tokens=5", "name=value fields"),
    ("input_tokens=-3", "non-negative integer"),
    ("input_tokens=1.5", "non-negative integer"),
    ("input_tokens=<object at 0x7f>", "non-negative integer"),
    ("input_tokens='876'", "non-negative integer"),
    ("input_tokens=nan", "non-negative integer"),
    ("input_tokens=1 cost_usd=-inf", "cost_usd"),
    ("input_tokens=1 cost_usd=Decimal('x')", "cost_usd"),
    ("model=x", "reports no tokens"),
    ("a=1 " * (MAX_USAGE_FIELDS + 1), "at most"),
    ("input_tokens=1 note=" + "x" * MAX_USAGE_TEXT, "at most"),
])
def test_usage_text_that_is_not_a_report_is_refused(text: str, words: str) -> None:
    """Text that is not name=value fields, or whose token fields are not counts, is a ValueError that says
    what is wrong; nothing is guessed."""
    with pytest.raises(ValueError, match=words):
        usage_data(text)


@pytest.mark.parametrize("data, expected", [
    ({"provider": "anthropic", "input_tokens": 10, "cache_read_tokens": 100, "cache_write_tokens": 5}, 115),
    ({"provider": "openai", "model": "gpt-4o", "input_tokens": 110, "cache_read_tokens": 100}, 110),
    ({"provider": "mystery", "input_tokens": 10, "cache_read_tokens": 100}, 110),
    ({"provider": "anthropic", "input_tokens": 110, "cache_read_tokens": 100, "input_includes_cache": True}, 110),
    ({"provider": "x", "output_tokens": 3}, None),
])
def test_request_tokens_follow_the_provider_convention(data: dict, expected: int | None) -> None:
    """Anthropic counts cache reads/writes apart from input_tokens, OpenAI inside them; unknown: apart (more)."""
    assert request_tokens(data) == expected


def _rec(ts: str, **data: object) -> dict:
    base = {k: None for k in ("provider", "model", "input_tokens", "output_tokens", "cache_read_tokens",
                              "cache_write_tokens", "reasoning_tokens", "cost_usd", "id")}
    return {"type": "usage_reported", "ts": ts, "data": {**base, **data}}


def test_ledger_groups_dedupes_and_prices() -> None:
    """Rows per model; a report id counted once however often it appears; reported costs win over the table;
    an unpriced report is counted as such; since leaves out older reports; other records are ignored."""
    prices = Prices.from_json({"models": {"gpt-*": {"input": 1.0, "output": 2.0}}})
    ledger = UsageLedger(by="model", prices=prices, since="2025-01-02")
    recs = [_rec("2025-01-01T00:00:00Z", model="gpt-4o", input_tokens=999),
            _rec("2025-01-02T10:00:00Z", provider="openai", model="gpt-4o", input_tokens=1_000_000,
                 output_tokens=10, id="a"),
            _rec("2025-01-02T11:00:00Z", provider="openai", model="gpt-4o", input_tokens=1_000_000, id="a"),
            _rec("2025-01-03T00:00:00Z", model="claude", input_tokens=5, cost_usd=0.5),
            _rec("2025-01-03T00:00:00Z", model="other", input_tokens=5),
            {"type": "message_added", "ts": "2025-01-03", "data": {}}]
    ledger.apply_all("s", recs)
    rows = {r["model"]: r for r in ledger.rows()}
    assert rows["gpt-4o"]["reports"] == 1 and rows["gpt-4o"]["cost_usd"] == pytest.approx(1.00002)
    assert rows["claude"]["cost_usd"] == 0.5 and rows["other"]["cost_usd"] is None
    assert ledger.total.as_dict()["uncosted"] == 1 and ledger.skipped_duplicates == 1


@pytest.mark.parametrize("doc, words", [
    ({"gpt": {}}, "expected"), ({"models": {"m": {"input": -1}}}, "non-negative"),
    ({"models": {"m": {"inptu": 1}}}, "needs some of"), ({"models": {"m": {"input": True}}}, "non-negative"),
])
def test_bad_price_tables_say_the_format(doc: object, words: str) -> None:
    """A price table that is not {"models": {name: {input, output, cache_read, cache_write}}} is refused."""
    with pytest.raises(ValueError, match=words):
        Prices.from_json(doc)


def test_an_unknown_provider_is_fitted_without_assuming_a_slope() -> None:
    """For a provider with no published prior, reports all of one size give the whole ratio as the slope: a
    provider counting 2x is never under-estimated for larger requests."""
    f = fit([(10_000, 20_000), (10_500, 21_000)], prior_for("acme", "m"))
    assert f.predict(40_000) >= 80_000


def test_priors_are_per_provider() -> None:
    """Claude starts from 1.5x with its sources cited; OpenAI from 1.0; an unknown provider from 1.0."""
    assert prior_for("anthropic", None).slope == 1.5 and "PR #65" in prior_for(None, "claude-3").source
    assert prior_for("openai", "gpt-4o").slope == 1.0 and prior_for("acme", "m").slope == 1.0


def test_calibration_adapts_when_the_model_changes() -> None:
    """Each model has its own fit; a request that names no model uses the newest report's; a new model starts
    from its prior with the overhead seen so far."""
    cal = Calibration()
    for e in (1000, 3000, 9000):
        cal.apply({"provider": "anthropic", "model": "a", "input_tokens": 2 * e + 500, "estimated_tokens": e})
    fa, _ = cal.fit_for("anthropic", "a")
    assert fa.calibrated and 2.0 <= fa.slope <= 2.0 * (1 + MARGIN) + 1e-9
    cal.apply({"provider": "anthropic", "model": "b", "input_tokens": 100, "estimated_tokens": None})
    assert cal.fit_for(None, None)[1] == ("anthropic", "b")
    fb, _ = cal.fit_for("anthropic", "b")
    assert not fb.calibrated and fb.slope == 1.5 and fb.overhead == fa.overhead


@settings(max_examples=300, deadline=None)
@given(a=st.floats(0.3, 3.0), b=st.integers(0, 30_000), eps=st.floats(0.0, 0.05),
       sizes=st.lists(st.integers(200, 150_000), min_size=1, max_size=40),
       noise=st.lists(st.floats(-1.0, 1.0), min_size=40, max_size=40),
       probe=st.floats(0.0, 3.0))
def test_the_fit_never_underestimates_beyond_its_bound(a: float, b: int, eps: float, sizes: list[int],
                                                       noise: list[float], probe: float) -> None:
    """For a provider counting a*E + b tokens with a ratio that wobbles by up to eps per request: every report
    is predicted at or above what was reported, and any request at least as large as the smallest one is
    predicted at least min(1 - eps, (1 - 3 eps)(1 + MARGIN)) times its true count, whenever the reports span
    a factor of 2 or the prior is at least the true ratio."""
    prior = Prior(1.5, "test")
    points = [(e, max(1, round(a * (1 + eps * n) * e + b))) for e, n in zip(sizes, noise)]
    f = fit(points, prior)
    for e, r in points:
        assert f.predict(e) >= r - 1e-6
    spread = max(sizes) >= 2 * min(sizes)
    if spread or a <= prior.slope:  # (else the prior, an upper end by its sources, was wrong)
        bound = min(1 - eps, (1 - 3 * eps) * (1 + MARGIN))
        e = min(sizes) + probe * max(sizes)
        assert f.predict(e) >= bound * (a * e + b) - 1  # (1: rounding of the reported counts)


@given(a=st.floats(0.3, 3.0), b=st.integers(0, 30_000), budget=st.integers(50_000, 1_000_000),
       sizes=st.lists(st.integers(200, 150_000), min_size=2, max_size=20))
def test_the_fitted_budget_keeps_the_provider_inside_its_budget(a: float, b: int, budget: int,
                                                                sizes: list[int]) -> None:
    """With exact counts, a view fitted to the calibrated budget is counted by the provider within its budget
    (when the budget is at least the smallest report, as a provider that accepted them shows)."""
    points = [(e, round(a * e + b)) for e in sizes]
    f = fit(points, Prior(1.5, "test"))
    fitted = f.budget(budget)
    if fitted >= min(sizes) and a * min(sizes) + b <= budget and (max(sizes) >= 2 * min(sizes) or a <= 1.5):
        assert a * fitted + b <= budget + 1
