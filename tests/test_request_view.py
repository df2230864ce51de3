"""The request view through the store: budget, compaction events, caching, pins, and the stored history
left untouched."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from context_persistent import PersistentContextManager
class RecordingHooks:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple[str, dict]] = []
        self.fail = fail

    async def emit(self, event: str, data: dict[str, Any]) -> None:
        self.events.append((event, data))
        if self.fail:
            raise RuntimeError("observer exploded")

    def names(self) -> list[str]:
        return [e for e, _ in self.events]


def _ids(view: list[dict]) -> tuple[set, set]:
    calls = {c["id"] for m in view for c in m.get("tool_calls") or ()}
    results = {m["tool_call_id"] for m in view if m.get("role") == "tool"}
    return calls, results


async def _seed_contract_example(s: PersistentContextManager) -> None:
    await s.add_message({"role": "system", "content": "You are helpful."})
    await s.add_message({"role": "user", "content": "Read file.txt"})
    await s.add_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_123", "type": "function", "function": {"name": "read", "arguments": '{"path": "file.txt"}'}}]})
    await s.add_message({"role": "tool", "tool_call_id": "call_123", "content": "File contents... " * 40})
    for i in range(50):
        await s.add_message({"role": "user", "content": f"Message {i} " + "padding " * 20})


async def test_contract_example_keeps_tool_pairs(storage: Path) -> None:
    """Seed 000's example: 50 extra messages over a small budget; no orphan result, within budget."""
    hooks = RecordingHooks()
    async with await PersistentContextManager.open(storage_path=storage, session_id="c", hooks=hooks,
                                                   max_tokens=600) as s:
        await _seed_contract_example(s)
        history = await s.get_messages()
        view = await s.get_messages_for_request()
        calls, results = _ids(view)
        assert results <= calls and calls <= results
        assert view[0] == {"role": "system", "content": "You are helpful."}
        assert view[-1] == history[-1]
        assert len(view) < len(history)
        assert await s.get_messages() == history  # compaction is a view
        names = hooks.names()
        assert names[:3] == ["context:pre_compact", "context:post_compact", "context:compaction"]
        post = hooks.events[1][1]
        assert post["budget"] == 600 and post["budget_source"] == "config" and post["token_count"] <= 600
        assert post["message_count"] == len(view)
        compaction = hooks.events[2][1]
        assert compaction["before_messages"] == len(history) and compaction["after_messages"] == len(view)
        assert await s.compact() == compaction["before_tokens"] - compaction["after_tokens"] > 0


async def test_below_threshold_view_is_the_history(storage: Path) -> None:
    """Under the threshold the request view equals the stored history and no event fires."""
    hooks = RecordingHooks()
    async with await PersistentContextManager.open(storage_path=storage, session_id="b", hooks=hooks) as s:
        await _seed_contract_example(s)
        assert await s.get_messages_for_request() == await s.get_messages()
        assert hooks.names() == []
        assert await s.compact() == 0


async def test_orphans_repaired_in_every_view(storage: Path) -> None:
    """A call whose result never came (crash mid-tool) gets a placeholder result even with a huge budget."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="o") as s:
        await s.add_message({"role": "user", "content": "go"})
        await s.add_message({"role": "tool", "tool_call_id": "ghost", "content": "orphan result"})
        await s.add_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
        view = await s.get_messages_for_request(token_budget=1_000_000)
        calls, results = _ids(view)
        assert calls == results == {"c1"}
        assert len(await s.get_messages()) == 3


async def test_view_is_cached_until_log_or_budget_changes(storage: Path, rebuilds: Any) -> None:
    """Repeated requests reuse the view; a large new message or another budget rebuilds it; nothing
    re-tokenises."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="k", max_tokens=600) as s:
        await _seed_contract_example(s)
        counted = 0
        real_count = s._counter.count_message

        def counting(m: dict) -> int:
            nonlocal counted
            counted += 1
            return real_count(m)

        s._counter.count_message = counting  # type: ignore[method-assign]
        first = await s.get_messages_for_request()
        n_first = counted
        for _ in range(5):
            assert await s.get_messages_for_request() == first
        assert rebuilds.count == 1 and counted == n_first
        await s.add_message({"role": "user", "content": "one more"})
        await s.get_messages_for_request()
        assert rebuilds.count == 1  # a small append below the threshold extends the view (test_incremental_view.py)
        await s.add_message({"role": "user", "content": "much more " * 200})
        await s.get_messages_for_request()
        assert rebuilds.count == 2
        # Only the new message and what compaction itself creates (placeholders, markers) are counted: the
        # 54 stored messages are not re-tokenised.
        history_len = len(await s.get_messages())
        assert counted - n_first < 10 < history_len
        await s.get_messages_for_request(token_budget=5000)
        assert rebuilds.count == 3


async def test_mutating_a_request_view_never_reaches_the_history(storage: Path) -> None:
    """The request view's dicts are separate from the stored history."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="m") as s:
        await s.add_message({"role": "user", "content": [{"type": "text", "text": "a"}]})
        view = await s.get_messages_for_request()
        view[0]["content"][0]["text"] = "mutated"
        assert await s.get_messages() == [{"role": "user", "content": [{"type": "text", "text": "a"}]}]


async def test_copy_request_view_gives_independent_copies(storage: Path) -> None:
    """With copy_request_view, each call returns fresh deep copies."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="cp",
                                                   copy_request_view=True) as s:
        await s.add_message({"role": "user", "content": [{"type": "text", "text": "a"}]})
        first = await s.get_messages_for_request()
        first[0]["content"][0]["text"] = "mutated"
        assert (await s.get_messages_for_request())[0]["content"][0]["text"] == "a"


async def test_pins_survive_restart_and_compaction(storage: Path) -> None:
    """A pinned old message is kept by compaction, also after a restart."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="p", max_tokens=600) as s:
        await _seed_contract_example(s)
        await s.pin(5)  # "Message 1 ..."
        pinned = (await s.get_messages())[5]
    async with await PersistentContextManager.open(storage_path=storage, session_id="p", max_tokens=600) as s:
        view = await s.get_messages_for_request()
        assert pinned in view


async def test_failing_hook_never_breaks_a_request(storage: Path) -> None:
    """An observer that raises is logged; the request still returns a valid view."""
    hooks = RecordingHooks(fail=True)
    async with await PersistentContextManager.open(storage_path=storage, session_id="f", hooks=hooks,
                                                   max_tokens=600) as s:
        await _seed_contract_example(s)
        view = await s.get_messages_for_request()
        assert view and "context:post_compact" in hooks.names()


async def test_provider_budget_and_source(storage: Path) -> None:
    """The provider's window minus output and safety margin is the budget; its source is reported."""
    hooks = RecordingHooks()
    provider = SimpleNamespace(get_info=lambda: SimpleNamespace(defaults={"context_window": 2600,
                                                                          "max_output_tokens": 1000}))
    async with await PersistentContextManager.open(storage_path=storage, session_id="pv", hooks=hooks,
                                                   safety_margin=1000) as s:
        await _seed_contract_example(s)
        await s.get_messages_for_request(provider=provider)
        post = dict(hooks.events)["context:post_compact"]
        assert post["budget"] == 600 and post["budget_source"] == "provider"
        hooks.events.clear()
        await s.get_messages_for_request(token_budget=100_000, provider=provider)
        assert hooks.events == []  # explicit budget wins, and 100k is far above the threshold


async def test_pinned_view_error_cases(storage: Path) -> None:
    """pin() with a bad index or seq says what is allowed."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="e") as s:
        await s.add_message({"role": "user", "content": "x"})
        with pytest.raises(ValueError, match="out of range; the history has 1 messages"):
            await s.pin(3)
        with pytest.raises(ValueError, match="not a message_added event"):
            await s.pin(seq=1)


async def test_export_on_compact_is_bounded(storage: Path) -> None:
    """export_on_compact snapshots the reasoning view when compaction drops content, at most once per N events."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="x", max_tokens=600,
                                                   export_on_compact=True, export_on_compact_every=5) as s:
        await _seed_contract_example(s)
        await s.get_messages_for_request()
        folder = storage / "x"
        first = sorted(folder.glob("compaction-*.jsonl"))
        assert len(first) == 1
        body = first[0].read_text()
        assert "call_123" in body and "File contents" in body  # the full reasoning view, tool output whole
        await s.add_message({"role": "user", "content": "a"})
        await s.get_messages_for_request()
        assert len(sorted(folder.glob("compaction-*.jsonl"))) == 1  # fewer than 5 new events
        for i in range(30):
            await s.add_message({"role": "user", "content": f"b{i} " + "filler " * 40})
            await s.get_messages_for_request()
        seqs = [int(p.stem.split("-")[1]) for p in sorted(folder.glob("compaction-*.jsonl"))]
        assert len(seqs) >= 2
        assert all(b - a >= 5 for a, b in zip(seqs, seqs[1:]))  # never more than one per 5 new events


async def test_compaction_is_audited_in_the_log(storage: Path, rebuilds: Any) -> None:
    """A compaction that changes the view appends one `compacted` audit record; the audit does not stop the
    next small append from extending the view."""
    from context_persistent.model.codec import decode

    async with await PersistentContextManager.open(storage_path=storage, session_id="a", max_tokens=600) as s:
        await _seed_contract_example(s)
        view = await s.get_messages_for_request()
        await s.get_messages_for_request()
        await s.add_message({"role": "user", "content": "short"})
        await s.get_messages_for_request()
        assert rebuilds.count == 1
    records = [decode(x) for x in (storage / "a" / "events.jsonl").read_bytes().splitlines()]
    audits = [r for r in records if r["type"] == "compacted"]
    assert len(audits) == 1
    assert audits[0]["data"]["after_messages"] == len(view) and audits[0]["data"]["budget_source"] == "config"
    async with await PersistentContextManager.open(storage_path=storage, session_id="a") as s:
        assert len(await s.get_messages()) == 55  # audit records are not messages
