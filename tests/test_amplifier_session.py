"""End to end through a real amplifier_core.AmplifierSession: mount from the entry point, crash-free restart,
and the resume rule against the CLI's filtered transcript."""

from __future__ import annotations

from pathlib import Path

import pytest
from amplifier_core import AmplifierSession

from context_persistent.model.codec import decode

FAKES = Path(__file__).parent / "amplifier_fakes"


@pytest.fixture(autouse=True)
def _fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FAKES))


def _plan(storage: Path) -> dict:
    return {
        "session": {
            "orchestrator": {"module": "fake-loop", "config": {"system_prompt": "SYSTEM PROMPT"}},
            "context": {"module": "context-persistent", "config": {"storage_path": str(storage)}},
        },
        "providers": [{"module": "fake-provider", "config": {"context_window": 50_000, "max_output_tokens": 2_000}}],
    }


async def test_real_session_mounts_writes_and_resumes(tmp_path: Path) -> None:
    """A real session mounts our module by entry point; a resumed one ignores the filtered transcript."""
    storage = tmp_path / "store"
    session = AmplifierSession(_plan(storage), session_id="amp-e2e")
    await session.initialize()
    ctx = session.coordinator.get("context")
    assert type(ctx).__name__ == "HostContext"  # (integrations/amplifier_host.py: the store as the host gets it)
    assert await session.execute("first question") == "answer 2 after reading the file"
    assert await session.execute("second question") == "answer 4 after reading the file"
    first_history = await ctx.get_messages()
    # What the Amplifier CLI saves after each turn: no system/developer messages.
    transcript = [m for m in first_history if m["role"] not in ("system", "developer")]
    await session.cleanup()
    assert ctx.closed

    resumed = AmplifierSession(_plan(storage), session_id="amp-e2e", is_resumed=True)
    await resumed.initialize()
    ctx2 = resumed.coordinator.get("context")
    assert ctx2.loaded_from_file
    await ctx2.set_messages(transcript)
    await ctx2.set_messages([{"role": "system", "content": "fresh system"}, *transcript])
    assert await ctx2.get_messages() == first_history
    assert first_history[0] == {"role": "system", "content": "SYSTEM PROMPT"}
    await resumed.execute("third question")
    final = await ctx2.get_messages()
    assert final[: len(first_history)] == first_history and len(final) == len(first_history) + 4
    await resumed.cleanup()

    lines = (storage / "amp-e2e" / "events.jsonl").read_bytes().splitlines()
    kinds = [decode(line)["type"] for line in lines]
    assert kinds.count("transcript_ignored") == 2
    assert "messages_replaced" not in kinds


async def test_fresh_session_accepts_transcript(tmp_path: Path) -> None:
    """With no log yet, set_messages from the host is accepted and written as one messages_replaced event."""
    storage = tmp_path / "store"
    session = AmplifierSession(_plan(storage), session_id="amp-fresh", is_resumed=True)
    await session.initialize()
    ctx = session.coordinator.get("context")
    assert not ctx.loaded_from_file
    transcript = [{"role": "user", "content": "old q"}, {"role": "assistant", "content": "old a"}]
    await ctx.set_messages(transcript)
    assert await ctx.get_messages() == transcript
    await session.cleanup()
    kinds = [decode(x)["type"] for x in (storage / "amp-fresh" / "events.jsonl").read_bytes().splitlines()]
    assert kinds == ["session_started", "messages_replaced"]


async def test_provider_budget_reaches_the_store(tmp_path: Path) -> None:
    """The orchestrator's provider sets the budget: context_window - max_output_tokens - safety_margin."""
    session = AmplifierSession(_plan(tmp_path / "store"), session_id="amp-budget")
    await session.initialize()
    ctx = session.coordinator.get("context")
    provider = session.coordinator.get("providers")["fake"]
    assert ctx.resolve_budget(None, provider) == (50_000 - 2_000 - 1_000, "provider")
    await session.cleanup()


@pytest.mark.parametrize("host", ["factory", "fallback"])
async def test_one_system_prompt_in_every_request_over_resumes(tmp_path: Path, host: str) -> None:
    """What amplifier-foundation does at every session start, resumes included: register the bundle's prompt
    factory (or, for a context without one, add the prompt as a system message). Every request the orchestrator
    sends carries exactly one system prompt, the current one."""
    storage = tmp_path / "store"
    prompts = ["bundle v1", "bundle v1", "bundle v1", "bundle v2", "bundle v2"]
    for run, prompt in enumerate(prompts):
        session = AmplifierSession(_plan(storage), session_id="amp-prompt", is_resumed=run > 0)
        await session.initialize()
        ctx = session.coordinator.get("context")
        if host == "factory":
            async def factory(prompt: str = prompt) -> str:
                return prompt
            await ctx.set_system_prompt_factory(factory)
        else:
            await ctx.add_message({"role": "system", "content": prompt})
        await session.execute(f"question {run}")
        loop = session.coordinator.get("orchestrator")
        for request in loop.requests:
            assert [m["content"] for m in request if m["role"] == "system"] == [prompt]
            assert request[0]["role"] == "system"
        await session.cleanup()
    kinds = [decode(x)["type"] for x in (storage / "amp-prompt" / "events.jsonl").read_bytes().splitlines()]
    assert kinds.count("system_prompt_set") == (2 if host == "factory" else 4)
