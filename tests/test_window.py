"""Windowed rebuilds (compaction/window.py): a long history's request view is built from its newest part plus
what must be kept, and still satisfies every invariant against the whole history."""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
from context_persistent.model.compaction import CompactionConfig, _request
from context_persistent.model.compaction.invariants import check_view

from strategies import conversations, tool_turns as _turns

STRATEGIES = st.sampled_from(["smart", "simple", "head_tail"])


def _open(d: Any, strategy: str = "smart", **config: Any) -> Any:
    return PersistentContextManager.open(
        storage_path=d, session_id="w", fsync="never", tokenizer="chars/4", compaction_strategy=strategy,
        recognise_replay=False, checkpoint_every=1_000_000, **config)


def _problems(s: Any, view: list[dict], budget: int, strategy: str) -> list[str]:
    """check_view of ``view`` against a request made from the WHOLE history (every message counted)."""
    state = s._state
    history = state.messages
    tokens = list(s._token_counts())
    pinned = [k in state.pinned for k in state.keys]
    request, _ = _request(history, tokens, pinned, budget, CompactionConfig(strategy=strategy),
                          s._counter.count_message)
    return check_view(request, view, allow_truncated=request.protected_tokens > budget)


async def _check(messages: list[dict], pins: list[bool], split: int, budget: int, strategy: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        async with await _open(d, strategy) as s:
            s.WINDOW_MIN_MESSAGES = 4
            for m in messages[:split]:
                await s.add_message(m)
            for i, p in enumerate(pins[:split]):
                if p:
                    await s.pin(i)
            view = await s.get_messages_for_request(token_budget=budget)
            windowed = "window" in (s._view_cache[4].stats if s._view_cache else {})
            assert _problems(s, view, budget, strategy) == []
            for m in messages[split:]:  # appends after a (maybe windowed) rebuild extend or rebuild the view
                await s.add_message(m)
                view = await s.get_messages_for_request(token_budget=budget)
                assert _problems(s, view, budget, strategy) == []
            return windowed


@settings(max_examples=120, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(conv=conversations(max_segments=18), cut=st.floats(0.7, 1), budget=st.integers(300, 2_500),
       strategy=STRATEGIES)
def test_windowed_views_satisfy_every_invariant(conv: tuple, cut: float, budget: int, strategy: str) -> None:
    """With the window threshold at 4 messages, every view keeps system/pinned/tail, is valid and fits the budget."""
    messages, pins = conv
    assume(len(messages) >= 8)
    asyncio.run(_check(messages, pins, max(1, int(len(messages) * cut)), budget, strategy))


async def test_first_request_counts_a_bounded_number_of_messages(storage: Any) -> None:
    """On a long session the first request tokenises only the window and what is kept, not the history."""
    async with await _open(storage) as s:
        s.WINDOW_MIN_MESSAGES = 512
        await s.set_messages([{"role": "system", "content": "You are helpful."}, *_turns(1500)])
    async with await _open(storage) as s:
        s.WINDOW_MIN_MESSAGES = 512
        counted: list[dict] = []
        real = s._counter.count_message

        def spy(message: dict) -> int:
            counted.append(message)
            return real(message)

        s._counter.count_message = spy  # type: ignore[method-assign]
        view = await s.get_messages_for_request(token_budget=8_000)
        stats = s.last_compaction
        assert stats is not None and stats["window"]["omitted"] > 5000
        assert stats["before_tokens_exact"] is False and stats["before_messages"] == 6001
        assert len(counted) < 200  # about 8,000 tokens of ~80-token messages, plus head, note, markers
        assert s.stats()["last_compaction"]["window"] == stats["window"]  # (stats() counts every message)
        assert view[0] == {"role": "system", "content": "You are helpful."}
        assert any("messages left out here" in str(m.get("content")) for m in view)
        assert view[-4:] == (await s.get_messages())[-4:]
        assert _problems(s, view, 8_000, "smart") == []
        counted.clear()
        await s.add_message({"role": "user", "content": "one more"})  # the extension counts only the tail
        assert (await s.get_messages_for_request(token_budget=8_000))[-1]["content"] == "one more"
        assert len(counted) <= 2


async def test_pins_far_in_the_past_are_kept_with_their_group(storage: Any) -> None:
    """A pinned tool result thousands of messages back is kept together with its call; so is the first task."""
    async with await _open(storage, "head_tail") as s:
        s.WINDOW_MIN_MESSAGES = 512
        await s.set_messages(_turns(1000))
        await s.pin(10 * 4 + 2)  # the result of call c10
        view = await s.get_messages_for_request(token_budget=6_000)
        history = await s.get_messages()
        assert s.last_compaction is not None and s.last_compaction["window"]["start"] > 3000
        assert history[42] in view and history[41] in view  # result and its call
        assert view.index(history[41]) + 1 == view.index(history[42])
        assert view[0] == history[0]  # head_tail's head: the first task statement
        assert _problems(s, view, 6_000, "head_tail") == []


async def test_short_histories_are_built_whole(storage: Any) -> None:
    """Below the window threshold nothing changes: the stats carry no window and the token total is exact."""
    async with await _open(storage) as s:
        await s.set_messages(_turns(300))
        await s.get_messages_for_request(token_budget=6_000)
        assert s.last_compaction is not None and "window" not in s.last_compaction
        assert s.last_compaction["before_tokens"] == await s.get_token_count()
