"""Between compactions the request view is extended, not rebuilt: below the threshold it equals a full
rebuild exactly; above it, every invariant still holds (compaction/incremental.py)."""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
from context_persistent.model.compaction import CompactionConfig, _request, build_request_view
from context_persistent.model.compaction.invariants import check_view

from strategies import conversations

STRATEGIES = st.sampled_from(["smart", "simple", "head_tail"])


async def _check(messages: list[dict], split: int, budget: int, strategy: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with await PersistentContextManager.open(
                storage_path=d, session_id="i", fsync="never", tokenizer="chars/4", compaction_strategy=strategy,
                recognise_replay=False, checkpoint_every=1_000_000) as s:
            for m in messages[:split]:
                await s.add_message(m)
            await s.get_messages_for_request(token_budget=budget)
            for m in messages[split:]:
                await s.add_message(m)
                view = await s.get_messages_for_request(token_budget=budget)
                history = await s.get_messages()
                tokens = list(s._token_counts())
                config = CompactionConfig(strategy=strategy)
                count = s._counter.count_message
                fresh = await build_request_view(history, tokens, [False] * len(history), budget, config, count)
                # While the store's view is uncompacted, extending it must give exactly a full rebuild. Once a
                # compaction happened, the view stays compacted (hysteresis) until the next full rebuild, even if
                # a fresh build would no longer compact (e.g. a placeholder replaced by a shorter real result).
                if not s._view_cache[4].compacted:
                    assert not fresh.compacted and view == fresh.messages
                request, _ = _request(history, tokens, [False] * len(history), budget, config, count)
                assert check_view(request, view, allow_truncated=request.protected_tokens > budget) == []
                assert sum(count(m) for m in view) <= budget or fresh.stats["warning"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conv=conversations(max_segments=18), cut=st.floats(0, 1), budget=st.integers(300, 30_000), strategy=STRATEGIES)
def test_extended_views_are_valid_and_exact_below_threshold(conv: tuple, cut: float, budget: int,
                                                           strategy: str) -> None:
    """After each appended message the view is valid, and equals a full rebuild while it is uncompacted."""
    messages, _ = conv
    asyncio.run(_check(messages, int(len(messages) * cut), budget, strategy))


async def test_a_new_message_does_not_rebuild(storage: Any, rebuilds: Any) -> None:
    """Appending user/assistant/tool messages below the threshold extends the view; the prefix is reused."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="n") as s:
        await s.add_message({"role": "system", "content": "S"})
        for i in range(200):
            await s.add_message({"role": "user", "content": f"q{i}"})
            await s.add_message({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
            await s.add_message({"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"})
            await s.add_message({"role": "assistant", "content": f"a{i}"})
            view = await s.get_messages_for_request()
            assert view == await s.get_messages()
        assert rebuilds.count == 1
        await s.pin(3)  # anything but an append forces a rebuild
        await s.get_messages_for_request()
        assert rebuilds.count == 2


async def test_extension_stops_at_the_threshold(storage: Any) -> None:
    """When appends bring the view to the threshold, a real compaction runs again (and fires its events)."""
    events: list[str] = []

    class Hooks:
        async def emit(self, name: str, data: dict) -> None:
            events.append(name)

    async with await PersistentContextManager.open(storage_path=storage, session_id="t", hooks=Hooks(),
                                                   max_tokens=2000) as s:
        await s.add_message({"role": "system", "content": "S"})
        for i in range(120):
            await s.add_message({"role": "user", "content": f"question {i} " + "word " * 30})
            view = await s.get_messages_for_request()
            assert sum(s._counter.count_message(m) for m in view) <= 2000
        assert events.count("context:compaction") >= 2
        assert view[0] == {"role": "system", "content": "S"}


async def test_a_view_handed_out_never_changes_when_the_next_one_extends_it(storage: Any) -> None:
    """The store extends its own view's list in place (counted and from bounds); every view it handed out keeps
    what it had, and a caller that changes its list (or a dict in it, with copy_request_view) changes no later
    view."""
    async def no_bound(*args: Any) -> None:
        return None

    for bounded, config in ((True, {}), (False, {"tokenizer": "chars/4"}), (True, {"copy_request_view": True})):
        async with await PersistentContextManager.open(storage_path=storage, session_id=f"h{bounded}{len(config)}",
                                                       **config) as s:
            if not bounded:
                s._views.bounds.view = no_bound  # (counted: compaction's own build, then extended by counts)
            await s.add_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
            await s.get_messages_for_request()
            own = s._view_cache[4].messages
            handed: list[tuple[list[dict], list[dict]]] = []
            for i in range(30):
                await s.add_message({"role": "user", "content": f"q{i}"})
                if i % 3 == 0:
                    await s.add_message({"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
                view = await s.get_messages_for_request()
                assert s._view_cache[4].messages is own and view is not own and s._view_cache[5] is bounded
                assert view[0]["content"] == "S"  # (no caller's change reached it)
                view.append({"role": "user", "content": "the caller's"})
                if config.get("copy_request_view"):
                    view[0]["content"] = "changed by the caller"
                handed.append((view, [dict(m) for m in view]))
                await s.add_message({"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"} if i % 3 == 0
                                    else {"role": "assistant", "content": f"a{i}"})
            for view, then in handed:
                assert view == then and view[-1] == {"role": "user", "content": "the caller's"}
            assert await s.get_messages_for_request() == await s.get_messages()
