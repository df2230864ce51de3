"""Usage through a real amplifier_core.AmplifierSession: the mount records each provider:response of its own
session on the real hook registry, the request budget follows the calibration, and a resume rebuilds it."""

from __future__ import annotations

import logging
from decimal import Decimal
from pathlib import Path

import pytest
from amplifier_core import AmplifierSession

from context_persistent.model.codec import decode

FAKES = Path(__file__).parent / "amplifier_fakes"


@pytest.fixture(autouse=True)
def _fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FAKES))


def _plan(storage: Path, **context: object) -> dict:
    return {
        "session": {
            "orchestrator": {"module": "fake-loop", "config": {"system_prompt": "SYSTEM PROMPT"}},
            "context": {"module": "context-persistent", "config": {"storage_path": str(storage), **context}},
        },
        "providers": [{"module": "fake-provider", "config": {
            "context_window": 50_000, "max_output_tokens": 2_000, "report_usage": True, "usage_ratio": 1.4,
            "usage_overhead": 3_000, "model": "fake-claude-1"}}],
    }


def _records(storage: Path, session: str) -> list[dict]:
    return [decode(x) for x in (storage / session / "events.jsonl").read_bytes().splitlines()]


async def test_provider_responses_are_recorded_and_calibrate_the_budget(tmp_path: Path) -> None:
    """Each provider:response becomes one usage_reported record (provider, model, the request it answers); the
    next request's budget is calibrated from them; a resumed session rebuilds the same calibration."""
    storage = tmp_path / "store"
    session = AmplifierSession(_plan(storage), session_id="amp-usage")
    await session.initialize()
    ctx = session.coordinator.get("context")
    provider = session.coordinator.get("providers")["fake"]
    await session.execute("first question")
    await session.execute("second question")
    assert provider.calls == 4
    stats = ctx.stats()
    assert stats["sources"]["last_usage"] == "reported by the provider"
    assert stats["calibration"]["calibrated"] and stats["calibration"]["reports"] >= 3
    assert stats["sources"]["budget"].startswith("calibrated x")
    budget, _ = ctx.resolve_budget(None, provider)
    assert stats["calibration"]["provider_budget"] == budget and stats["calibration"]["budget"] < budget
    await ctx.get_messages_for_request(provider=provider)  # (the fit of all four reports)
    slope, overhead = ctx.stats()["calibration"]["slope"], ctx.stats()["calibration"]["overhead"]
    await session.cleanup()

    usage = [r for r in _records(storage, "amp-usage") if r["type"] == "usage_reported"]
    assert len(usage) == 4
    assert {(u["data"]["provider"], u["data"]["model"], u["data"]["source"]) for u in usage} == {
        ("fake", "fake-claude-1", "amplifier")}
    # (each carries the store's count of the view it answers, or names the view: paired when next counted)
    assert all((u["data"]["estimated_tokens"] or 0) > 0 or u["data"]["view"]["messages"] > 0 for u in usage)
    assert all(u["data"]["request_seq"] < u["seq"] for u in usage)
    assert sum(u["data"]["cost_usd"] for u in usage) == pytest.approx(0.004)

    resumed = AmplifierSession(_plan(storage), session_id="amp-usage", is_resumed=True)
    await resumed.initialize()
    ctx2 = resumed.coordinator.get("context")
    await ctx2.get_messages_for_request(provider=resumed.coordinator.get("providers")["fake"])
    again = ctx2.stats()["calibration"]
    assert (again["slope"], again["overhead"], again["reports"]) == (slope, overhead, 4)
    await resumed.cleanup()


async def test_other_sessions_and_bad_reports_do_not_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A provider:response of another session (a sub-session sharing the hooks) is not recorded here; a report
    the store refuses is one warning line and the turn goes on."""
    storage = tmp_path / "store"
    plan = _plan(storage)
    plan["providers"][0]["config"]["report_usage"] = False
    session = AmplifierSession(plan, session_id="amp-own")
    await session.initialize()
    hooks = session.coordinator.hooks
    await hooks.emit("provider:response", {"provider": "fake", "session_id": "child-session",
                                           "usage": {"input_tokens": 10, "output_tokens": 1, "total_tokens": 11}})
    with caplog.at_level(logging.WARNING, logger="context_persistent"):
        await hooks.emit("provider:response", {"provider": "fake", "usage": {"input_tokens": -5, "output_tokens": 1,
                                                                             "total_tokens": 1}})
    assert "usage of a provider response not recorded" in caplog.text and "input_tokens" in caplog.text
    assert await session.execute("question") == "answer 2 after reading the file"
    await hooks.emit("provider:response", {"provider": "fake", "usage": {"input_tokens": 10, "output_tokens": 1,
                                                                         "total_tokens": 11}})
    await session.cleanup()
    usage = [r["data"] for r in _records(storage, "amp-own") if r["type"] == "usage_reported"]
    assert [(u["input_tokens"], u["source"]) for u in usage] == [(10, "amplifier")]


async def test_usage_given_as_text_is_recorded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """amplifier-core 2.0.2's hook registry hands the handler the Usage as its str(): it is recorded with the
    figures in it; a text that is not name=value fields is one warning line and nothing is recorded."""
    from amplifier_core.message_models import Usage

    storage = tmp_path / "store"
    plan = _plan(storage)
    plan["providers"][0]["config"]["report_usage"] = False
    session = AmplifierSession(plan, session_id="amp-text")
    await session.initialize()
    hooks = session.coordinator.hooks
    await session.execute("question")
    text = str(Usage(input_tokens=876, output_tokens=28, total_tokens=904, cache_read_tokens=12,
                     cost_usd=Decimal("0.0123")))
    assert text.startswith("input_tokens=876 output_tokens=28")  # (the form the real registry delivers)
    await hooks.emit("provider:response", {"provider": "fake", "session_id": "amp-text", "usage": text})
    with caplog.at_level(logging.WARNING, logger="context_persistent"):
        await hooks.emit("provider:response", {"provider": "fake", "usage": "<Usage object at 0x7f>"})
        await hooks.emit("provider:response", {"provider": "fake", "usage": "input_tokens=<object at 0x7f>"})
    warned = [r for r in caplog.records if "usage of a provider response not recorded" in r.getMessage()]
    assert len(warned) == 2 and "name=value" in warned[0].getMessage()
    assert "input_tokens must be a non-negative integer" in warned[1].getMessage()
    await session.cleanup()
    usage = [r["data"] for r in _records(storage, "amp-text") if r["type"] == "usage_reported"]
    assert [(u["input_tokens"], u["output_tokens"], u["cache_read_tokens"], u["cost_usd"], u["model"])
            for u in usage] == [(876, 28, 12, 0.0123, "fake-claude-1")]
    assert (usage[0]["estimated_tokens"] or 0) > 0 or usage[0]["view"]["messages"] > 0


async def test_calibrate_off_keeps_the_budget(tmp_path: Path) -> None:
    """With calibrate: false the reports are recorded but the request budget is the provider's, uncalibrated."""
    storage = tmp_path / "store"
    session = AmplifierSession(_plan(storage, calibrate=False), session_id="amp-off")
    await session.initialize()
    ctx = session.coordinator.get("context")
    await session.execute("question")
    budget, _ = ctx.resolve_budget(None, session.coordinator.get("providers")["fake"])
    assert ctx._usage.fitted_budget(budget, session.coordinator.get("providers")["fake"]) == budget
    assert ctx.stats()["sources"]["budget"].endswith("calibration off")
    await session.cleanup()
    assert sum(r["type"] == "usage_reported" for r in _records(storage, "amp-off")) == 2
