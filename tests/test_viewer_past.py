"""Time travel in the viewer without a replay (viewer/past.py): a past state cut from the head's equals the one
``store.at`` replays (history, keys, pins, counts, request view), lazy or not; anything but appends and audit
records after the seq, or a redaction anywhere, makes the viewer replay instead."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.viewer.past import appends_only, listed_system_indices, open_cut
from context_persistent.viewer.source import Source


def _msg(i: int) -> dict[str, Any]:
    if i % 9 == 4:
        return {"role": "assistant", "content": f"call {i}",
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    if i % 9 == 5:
        return {"role": "tool", "tool_call_id": f"c{i - 1}", "content": f"result {i} " + "data " * 40}
    return {"role": "user" if i % 2 else "assistant", "content": f"message {i} " + "words " * (i % 13)}


async def _session(storage: Path, sid: str, n: int, *, pin_at: int | None = None, redact: bool = False) -> dict[str, int]:
    """A session of ``n`` messages: a system prompt, a pin (after message ``pin_at``), usage reports and a
    compaction audit record now and then; written in two opens, so the second part follows a checkpoint."""
    facts: dict[str, int] = {}
    for part in (range(0, n // 2), range(n // 2, n)):
        async with await PersistentContextManager.open(storage_path=storage, session_id=sid, fsync="never",
                                                     checkpoint_every=50) as s:
            if part.start == 0:
                await s.add_message({"role": "system", "content": "You are terse."})
            for i in part:
                await s.add_message(_msg(i))
                if pin_at is not None and i == pin_at:
                    await s.pin(seq=s.head_seq)
                    facts["pin"] = s.head_seq
                if i % 25 == 24:
                    await s.get_messages_for_request(token_budget=400)
                    await s.record_usage({"input_tokens": 500 + i, "output_tokens": 3}, provider="openai", id=f"r{i}")
            if redact and part.start:
                await s.redact(seq=s.head_seq)
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, readonly=True) as s:
        facts["head"] = s.head_seq
    return facts


def _state(store: Any) -> dict[str, Any]:
    st = store._state.to_state()
    st.pop("tokens")  # (a replay counts them when asked; a cut keeps the head's counts)
    return st


async def _compare(source: Source, sid: str, seqs: list[int], *, purpose: str = "pages") -> list[bool]:
    """For each seq, whether the viewer cut the state (True) or replayed it; asserts both give the same."""
    cut_used = []
    async with source.store(sid, purpose) as head:
        system = listed_system_indices(head)
        async with source.store(sid) as pages:
            marks = None if appends_only(pages._state) else await source.marks.of(source, sid)
            for seq in seqs:
                replayed = await head.at(seq)
                cut = await open_cut(pages, seq, marks, system if purpose == "request" else None)
                cut_used.append(cut is not None)
                try:
                    if cut is None:
                        continue
                    assert cut.head_seq == seq
                    assert _state(cut) == _state(replayed), seq
                    for budget in (300, 5000):
                        assert (await cut.get_messages_for_request(token_budget=budget)
                                == await replayed.get_messages_for_request(token_budget=budget)), (seq, budget)
                finally:
                    await replayed.close()
                    if cut is not None:
                        await cut.close()
    return cut_used


def test_a_cut_past_state_is_the_replayed_one(tmp_path: Path) -> None:
    """After the pin, every past state (between appends, usage reports, compaction records) is cut, and equals
    the replay's, plain and lazy (for the request view); before the pin it is replayed."""
    facts = asyncio.run(_session(tmp_path, "s", 160, pin_at=20))
    source = Source(tmp_path)
    seqs = [2, facts["pin"] - 1, facts["pin"], facts["pin"] + 7, facts["head"] // 2, facts["head"] - 3,
            facts["head"] - 1]
    used = asyncio.run(_compare(source, "s", seqs))
    assert used == [False, False, True, True, True, True, True]
    assert asyncio.run(_compare(source, "s", seqs, purpose="request"))[2:] == [True] * 5
    asyncio.run(source.close())


def test_a_session_of_appends_only_needs_no_index(tmp_path: Path) -> None:
    """A session whose records are all appends is cut at any seq without reading its log."""

    async def build() -> None:
        async with await PersistentContextManager.open(storage_path=tmp_path, session_id="a", fsync="never") as s:
            for i in range(40):
                await s.add_message(_msg(i))

    asyncio.run(build())
    source = Source(tmp_path)
    assert asyncio.run(_compare(source, "a", [1, 2, 20, 40])) == [False, True, True, True]
    assert "a" not in source.marks._marks  # (no index was built)
    asyncio.run(source.close())


def test_a_redaction_anywhere_makes_time_travel_replay(tmp_path: Path) -> None:
    """With a redaction in the session (whose copies a replay hides too) no past state is cut."""
    facts = asyncio.run(_session(tmp_path, "r", 60, redact=True))
    source = Source(tmp_path)
    assert asyncio.run(_compare(source, "r", [10, facts["head"] // 2, facts["head"] - 1])) == [False] * 3
    asyncio.run(source.close())


@pytest.mark.parametrize("purpose", ["pages", "request"])
def test_the_viewer_answers_time_travel_from_the_cut(tmp_path: Path, purpose: str) -> None:
    """Through Source.store_at, a past seq gives a store at that seq, the same one for the same seq again."""
    facts = asyncio.run(_session(tmp_path, "v", 80, pin_at=3))

    async def run() -> None:
        source = Source(tmp_path)
        at = facts["head"] - 10
        async with source.store_at("v", at, purpose) as past:
            assert past.head_seq == at and not past._state.counts.get("redacted")
            first = past
        async with source.store_at("v", at, purpose) as again:
            assert again is first
        with pytest.raises(ValueError, match="beyond the last event"):
            async with source.store_at("v", facts["head"] + 5, purpose):
                pass
        await source.close()

    asyncio.run(run())
