"""The request view: repairs below the threshold, each strategy over it, config validation, custom fallback."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from context_persistent.model.compaction import (
    CompactionConfig, CompactionRequest, CompactionResult, CompactionStrategy, RequestView, build_request_view,
)
from context_persistent.model.compaction.head_tail import HeadTailStrategy
from context_persistent.model.compaction.simple import SimpleStrategy
from context_persistent.model.compaction.smart import SmartStrategy
from context_persistent.model.grouping import validate_sequence
from strategies import count

Message = dict[str, Any]
SYS = {"role": "system", "content": "You are a careful agent."}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def asst(text: str) -> Message:
    return {"role": "assistant", "content": text}


def call(i: str, name: str = "read_file") -> Message:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": '{"path": "a.py"}'}}]}


def tool(i: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": i, "content": text}


def view(messages: list[Message], budget: int, pinned: list[bool] | None = None, **cfg: Any) -> RequestView:
    tokens = [count(m) for m in messages]
    return asyncio.run(build_request_view(
        messages, tokens, pinned or [False] * len(messages), budget, CompactionConfig(**cfg), count))


def is_marker(m: Message) -> bool:
    return isinstance(m.get("content"), str) and m["content"].startswith("[context-persistent:")


# --- config -----------------------------------------------------------------------------------------------

def test_config_defaults() -> None:
    """Defaults match the issue: auto, 0.92 threshold, 0.5 target, smart, 20 recent messages."""
    c = CompactionConfig()
    assert (c.auto_compact, c.compact_threshold, c.target_usage, c.strategy, c.keep_recent) == (
        True, 0.92, 0.5, "smart", 20)


@pytest.mark.parametrize(("kwargs", "rule"), [
    ({"compact_threshold": 0}, "compact_threshold must be a number in"),
    ({"compact_threshold": 1.5}, "compact_threshold must be a number in"),
    ({"target_usage": "0.5"}, "target_usage must be a number in"),
    ({"target_usage": 0.95}, "must not exceed compact_threshold"),
    ({"strategy": "fancy"}, "strategy must be one of simple, smart, head_tail, custom"),
    ({"keep_recent": 0}, "keep_recent must be an int >= 1"),
    ({"keep_recent": True}, "keep_recent must be an int >= 1"),
    ({"mask_min_tokens": -1}, "mask_min_tokens must be an int >= 1"),
    ({"auto_compact": "yes"}, "auto_compact must be a bool"),
    ({"strategy": "custom"}, "strategy='custom' needs custom"),
    ({"custom": len}, "custom is set but strategy is 'smart'"),
    ({"strategy": "custom", "custom": "nocolon"}, "'module:function' string"),
    ({"strategy": "custom", "custom": "json:no_such_thing"}, "could not be imported"),
    ({"summarizer": "not callable"}, "summarizer must be a callable"),
])
def test_config_rejects_bad_values_with_the_rule(kwargs: dict[str, Any], rule: str) -> None:
    """Each bad value raises a ValueError stating what is allowed."""
    with pytest.raises(ValueError, match=rule):
        CompactionConfig(**kwargs)


def test_from_config_reads_amplifier_keys_and_ignores_others() -> None:
    """compaction_strategy is read as strategy; unrelated module keys are ignored."""
    c = CompactionConfig.from_config({"compaction_strategy": "simple", "keep_recent": 5, "storage_path": "/x",
                                      "compact_threshold": 0.8, "target_usage": 0.4, "max_tokens": 1000})
    assert (c.strategy, c.keep_recent, c.compact_threshold, c.target_usage) == ("simple", 5, 0.8, 0.4)
    with pytest.raises(ValueError, match="strategy must be one of"):
        CompactionConfig.from_config({"compaction_strategy": "nope"})


def test_custom_module_function_string_is_resolved() -> None:
    """A 'module:function' string is imported when the config is built."""
    c = CompactionConfig(strategy="custom", custom="json:dumps")
    import json

    assert c.custom_impl is json.dumps


def test_strategies_satisfy_the_protocol_and_validate_their_config() -> None:
    """Built-ins implement CompactionStrategy and reject bad settings in __init__."""
    assert all(isinstance(s, CompactionStrategy) for s in (SimpleStrategy(), SmartStrategy(), HeadTailStrategy()))
    with pytest.raises(ValueError, match="keep_head must be an int >= 0"):
        HeadTailStrategy(keep_head=-1)


# --- below the threshold ---------------------------------------------------------------------------------

def test_below_threshold_view_is_the_history_as_new_dicts() -> None:
    """Under the threshold the view equals the stored history, in new dicts, uncompacted."""
    msgs = [SYS, user("hi"), call("a"), tool("a", "x"), asst("done")]
    v = view(msgs, budget=10_000)
    assert v.messages == msgs and not v.compacted
    assert not any(a is b for a, b in zip(v.messages, msgs))
    assert v.token_count == sum(count(m) for m in msgs) == v.stats["token_count"]
    assert v.stats["warning"] is None and v.stats["strategy_used"] is None


def test_below_threshold_orphans_are_still_repaired() -> None:
    """Orphan results go and unanswered calls get placeholders even when nothing is compacted."""
    v = view([user("hi"), tool("ghost", "x"), call("a"), user("again")], budget=10_000)
    assert not v.compacted and validate_sequence(v.messages) == []
    assert v.stats["repairs"]["orphan_results_dropped"] == ["ghost"]
    assert v.stats["repairs"]["placeholders_added"] == ["a"]
    assert v.token_count == sum(count(m) for m in v.messages)


def test_auto_compact_off_warns_when_over_budget() -> None:
    """With auto_compact false the view is not compacted, and being over budget is reported."""
    msgs = [user("x" * 4000)]
    v = view(msgs, budget=100, auto_compact=False)
    assert v.messages == msgs and not v.compacted and "auto_compact is off" in v.stats["warning"]


def test_unchanged_messages_are_never_recounted() -> None:
    """count() is called only for new messages (markers, placeholders), never for cached ones."""
    msgs = [SYS] + [user(f"message {i} " + "y" * 200) for i in range(200)]
    tokens = [count(m) for m in msgs]
    seen: list[Message] = []

    def spy(m: Message) -> int:
        assert not any(m is x for x in msgs), "a cached message was re-tokenised"
        seen.append(m)
        return count(m)

    for strategy in ("simple", "smart", "head_tail"):
        v = asyncio.run(build_request_view(msgs, tokens, [False] * len(msgs), 2000,
                                           CompactionConfig(strategy=strategy), spy))
        assert v.compacted and v.token_count <= 1000
    assert len(seen) < 20


# --- the contract's own example ----------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["simple", "smart", "head_tail"])
def test_contract_example_fifty_messages_after_a_tool_pair(strategy: str) -> None:
    """Seed 000 'Testing': 50 more messages after a tool pair, small budget: no orphaned tool result."""
    msgs = [user("Read file.txt"), call("call_123"), tool("call_123", "File contents...")]
    msgs += [user(f"Message {i}") for i in range(50)]
    v = view(msgs, budget=100, compact_threshold=0.5, target_usage=0.5, strategy=strategy)
    ids_used = {c["id"] for m in v.messages for c in m.get("tool_calls") or ()}
    ids_answered = {m["tool_call_id"] for m in v.messages if m["role"] == "tool"}
    assert v.compacted and ids_answered <= ids_used and ids_used <= ids_answered
    assert v.messages[-1] == user("Message 49")
    assert v.token_count <= 100 and len(v.messages) < len(msgs)


# --- the strategies ------------------------------------------------------------------------------------------

def test_simple_keeps_system_and_the_last_keep_recent_messages_in_whole_groups() -> None:
    """simple: system + the last N messages; a group that would straddle N is left out whole."""
    pad = " " + "x" * 100
    msgs = [SYS, user("task" + pad), asst("a1" + pad), call("c1"), tool("c1", "r1" + pad), asst("a2" + pad),
            user("last" + pad)]
    v = view(msgs, budget=250, strategy="simple", keep_recent=3, compact_threshold=0.5, target_usage=0.5)
    assert [m for m in v.messages if not is_marker(m)] == [SYS, msgs[5], msgs[6]]
    marker = next(m for m in v.messages if is_marker(m))
    assert v.messages.index(marker) == 1 and marker["content"].startswith("[context-persistent: 4 messages (")
    assert marker["role"] == "user"
    assert v.stats["groups_dropped"] == 3


def test_head_tail_keeps_the_task_statement_and_the_latest_messages() -> None:
    """head_tail: the first message (task) plus the newest groups that fit, with a marker between."""
    msgs = [SYS, user("THE TASK")] + [asst(f"step {i} " + "z" * 80) for i in range(30)] + [user("now?")]
    v = view(msgs, budget=500, strategy="head_tail", keep_head=1)
    kept = [m for m in v.messages if not is_marker(m)]
    assert kept[:2] == [SYS, user("THE TASK")] and kept[-1] == user("now?")
    assert kept[-2] == msgs[-2] and is_marker(v.messages[2])
    assert v.token_count <= 250


def test_smart_masks_old_large_tool_outputs_first() -> None:
    """Stage 1: an old large tool output becomes a placeholder naming tool, id and size; nothing is dropped."""
    big = "line of code\n" * 1500
    msgs = [SYS, user("fix the bug"), call("call_1"), tool("call_1", big)] + [
        asst(f"noted {i}") for i in range(25)] + [user("continue")]
    v = view(msgs, budget=2000, strategy="smart")
    masked = next(m for m in v.messages if m.get("tool_call_id") == "call_1")
    size = count(msgs[3])
    assert masked["content"] == (
        f"[tool output masked by context-persistent: {size:,} tokens from tool 'read_file' (call_1); "
        "full text in the event log]")
    assert v.stats["outputs_masked"] == 1 and v.stats["groups_dropped"] == 0
    assert len(v.messages) == len(msgs) and v.token_count <= 1000
    assert msgs[3]["content"] == big  # the stored message is untouched


def test_smart_masks_the_previous_turn_before_dropping_anything() -> None:
    """Outputs before the latest user turn are 'old' even in a short session: masked, not dropped."""
    msgs = [SYS, user("task"), call("c1"), tool("c1", "blob " * 3000), asst("done"), user("next")]
    v = view(msgs, budget=1000, strategy="smart")
    assert [m.get("content") for m in v.messages][:2] == [SYS["content"], "task"]
    assert "tool output masked by context-persistent" in v.messages[3]["content"]
    assert len(v.messages) == len(msgs) and v.stats["groups_dropped"] == 0 and v.token_count <= 500


def test_smart_never_masks_the_current_turn() -> None:
    """A large output after the latest user message is kept whole."""
    big = "data " * 3000
    msgs = [SYS] + [asst("old " * 100) for _ in range(10)] + [user("go"), call("c"), tool("c", big)]
    v = view(msgs, budget=8000, strategy="smart", keep_recent=1)
    assert v.messages[-1] == tool("c", big) and v.stats["outputs_masked"] == 0


def test_smart_drops_low_value_groups_and_keeps_task_errors_decisions() -> None:
    """Stage 2: the first task statement, errors and decisions outlive filler of the same age."""
    filler = " blah" * 60
    msgs = [SYS, user("TASK: port the parser" + filler), asst("chit chat" + filler),
            call("e1"), tool("e1", "Traceback: ValueError" + filler), asst("small talk" + filler),
            asst("We decided to use a state machine" + filler), asst("more chat" + filler)]
    msgs += [asst(f"recent {i}") for i in range(20)] + [user("next step?")]
    v = view(msgs, budget=700, strategy="smart", keep_recent=20, target_usage=0.8)
    contents = [m.get("content") for m in v.messages]
    assert msgs[1]["content"] in contents and msgs[6]["content"] in contents
    assert msgs[4] in v.messages  # the error group survives
    assert msgs[2]["content"] not in contents and msgs[5]["content"] not in contents
    assert msgs[7]["content"] in contents and v.stats["groups_dropped"] == 2  # newer filler outlives older
    assert v.token_count <= 560


def test_smart_truncates_only_when_the_kept_part_exceeds_the_budget() -> None:
    """Stage 3: a huge output in the current turn is cut (head and tail kept) to fit the budget, with a warning."""
    big = "START " + "word " * 8000 + " END"
    msgs = [SYS, user("read it"), call("c"), tool("c", big)]
    v = view(msgs, budget=1500, strategy="smart")
    out = v.messages[-1]
    assert out["tool_call_id"] == "c" and out["content"].startswith("START") and out["content"].endswith("END")
    assert "truncated by context-persistent" in out["content"]
    assert v.stats["truncated"] == 1 and v.token_count <= 1500
    assert v.messages[:3] == msgs[:3]


def test_smallest_valid_view_and_warning_when_the_kept_part_cannot_fit() -> None:
    """simple cannot truncate: it returns only what must be kept and says so."""
    msgs = [user("old"), asst("old reply"), SYS | {"content": "rules " * 500}, user("now")]
    v = view(msgs, budget=200, strategy="simple")
    assert v.messages == msgs[2:] and v.token_count > 200
    assert "smallest valid view" in v.stats["warning"]


def test_pinned_message_in_the_middle_is_kept() -> None:
    """A pinned message survives compaction that drops everything around it."""
    msgs = [user("task")] + [asst(f"filler {i} " + "q" * 100) for i in range(30)] + [user("now")]
    pinned = [False] * len(msgs)
    pinned[10] = True
    for strategy in ("simple", "smart", "head_tail"):
        v = view(msgs, budget=300, pinned=pinned, strategy=strategy, keep_recent=2)
        assert msgs[10] in v.messages and v.token_count <= 300


def test_pinning_a_tool_result_keeps_its_whole_group() -> None:
    """Pinning one message of a tool group keeps the call and every result with it."""
    msgs = [user("task"), call("c"), tool("c", "important"), *[asst("f " * 60) for _ in range(10)], user("q")]
    pinned = [False] * len(msgs)
    pinned[2] = True
    v = view(msgs, budget=200, pinned=pinned, strategy="simple", keep_recent=1)
    assert msgs[1] in v.messages and msgs[2] in v.messages


def test_summarizer_replaces_the_marker_with_a_summary() -> None:
    """An async summariser receives the dropped messages and its text goes where they were."""
    received: list[list[Message]] = []

    async def summarize(dropped: list[Message]) -> str:
        received.append(dropped)
        return f"{len(dropped)} messages about filler"

    msgs = [SYS, user("task")] + [asst(f"filler {i} " + "q" * 100) for i in range(30)] + [user("now")]
    v = view(msgs, budget=600, strategy="simple", keep_recent=3, summarizer=summarize)
    (dropped,) = received
    assert dropped == msgs[1:30]
    summary = v.messages[1]
    assert summary["role"] == "user" and summary["content"].endswith("29 messages about filler")
    assert "summary of 29 earlier messages" in summary["content"]
    assert v.stats["summarized"] is True and sum(map(is_marker, v.messages)) == 1


def test_failing_summarizer_falls_back_to_a_marker() -> None:
    """A summariser that raises never breaks the request: a marker is used and the warning says why."""
    async def broken(dropped: list[Message]) -> str:
        raise RuntimeError("LLM down")

    msgs = [SYS] + [asst(f"filler {i} " + "q" * 100) for i in range(30)] + [user("now")]
    v = view(msgs, budget=600, strategy="simple", keep_recent=3, summarizer=broken)
    assert is_marker(v.messages[1]) and "LLM down" in v.stats["warning"]


# --- custom ----------------------------------------------------------------------------------------------

def _only_kept(request: CompactionRequest) -> list[Message]:
    """A valid custom strategy: keep exactly the protected groups."""
    return [request.messages[i] for g, grp in enumerate(request.groups) if request.protected[g] for i in grp.indices]


def test_custom_callable_output_is_used_when_valid() -> None:
    """A valid custom view is returned as is (in new dicts)."""
    msgs = [SYS] + [asst("f " * 100) for _ in range(10)] + [user("now")]
    v = view(msgs, budget=300, strategy="custom", custom=_only_kept)
    assert v.messages == [SYS, user("now")] and v.stats["strategy_used"] == "custom"
    assert v.stats["warning"] is None


def test_async_custom_object_with_compact_method_is_supported() -> None:
    """An object with an async compact() may return a CompactionResult."""
    class Keeper:
        async def compact(self, request: CompactionRequest) -> CompactionResult:
            return CompactionResult(_only_kept(request), groups_dropped=10)

    msgs = [SYS] + [asst("f " * 100) for _ in range(10)] + [user("now")]
    v = view(msgs, budget=300, strategy="custom", custom=Keeper())
    assert v.messages == [SYS, user("now")] and v.stats["groups_dropped"] == 10


@pytest.mark.parametrize(("impl", "reason"), [
    (lambda r: [m for m in r.messages if m["role"] != "system"], "must be kept is missing"),
    (lambda r: list(r.messages)[-1:], "must be kept is missing"),
    (lambda r: [r.messages[0], r.messages[-1], {"role": "tool", "tool_call_id": "zz", "content": "x"}],
     "orphan tool result"),
    (lambda r: list(r.messages), "over the budget"),
    (lambda r: 1 / 0, "ZeroDivisionError"),
    ("json:dumps", "TypeError"),
])
def test_invalid_custom_output_falls_back_to_smart_with_a_warning(impl: Any, reason: str) -> None:
    """A custom view that breaks an invariant (or raises) is rejected; smart is used and the warning says why."""
    msgs = [SYS] + [asst("f " * 100) for _ in range(10)] + [user("now")]
    v = view(msgs, budget=300, strategy="custom", custom=impl)
    assert v.stats["strategy_used"] == "smart" and reason in v.stats["warning"]
    assert "used smart instead" in v.stats["warning"]
    assert v.messages[0] == SYS and v.messages[-1] == user("now") and v.token_count <= 300


def test_build_request_view_rejects_mismatched_inputs() -> None:
    """tokens and pinned must be as long as messages; the budget must be positive."""
    with pytest.raises(ValueError, match="same length"):
        asyncio.run(build_request_view([user("x")], [], [False], 10, CompactionConfig(), count))
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        asyncio.run(build_request_view([user("x")], [5], [False], 0, CompactionConfig(), count))


def test_large_history_is_compacted_in_linear_work() -> None:
    """Compaction's work is linear in the history, per strategy: the lines of the package's code it executes
    (counted by a trace function: deterministic, unlike a clock) for twice the history are about twice as many,
    never the square. Speed itself is measured in the benchmark suite (bench_request), not asserted here."""
    import sys
    from pathlib import Path

    import context_persistent

    package = str(Path(context_persistent.__file__).parent)

    def history(groups: int) -> list[Message]:
        msgs: list[Message] = [SYS]
        for i in range(groups):
            msgs += [user(f"u{i}"), call(f"c{i}"), tool(f"c{i}", "r" * 300), asst(f"a{i}")]
        return msgs

    def lines_for(msgs: list[Message], strategy: str) -> int:
        tokens = [count(m) for m in msgs]
        budget = sum(tokens) // 4
        seen = 0

        def trace(frame, event, arg):  # type: ignore[no-untyped-def]
            nonlocal seen
            if not frame.f_code.co_filename.startswith(package):
                return None
            if event == "line":
                seen += 1
            return trace

        sys.settrace(trace)
        try:
            v = asyncio.run(build_request_view(msgs, tokens, [False] * len(msgs), budget,
                                               CompactionConfig(strategy=strategy), count))
        finally:
            sys.settrace(None)
        assert v.compacted and v.token_count <= budget
        return seen

    small, big = history(400), history(800)
    snapshot = copy.deepcopy(big[:50])
    for strategy in ("simple", "smart", "head_tail"):
        half, full = lines_for(small, strategy), lines_for(big, strategy)
        assert full > len(big), (strategy, full)  # the trace saw the work (it walks every message)
        assert full <= 2.3 * half, (strategy, half, full)
    assert big[:50] == snapshot


def test_long_agent_loop_after_one_user_message_is_truncated_oldest_outputs_first() -> None:
    """A tool loop that alone exceeds the budget: smart cuts older outputs first and keeps the newest whole."""
    msgs = [SYS, user("refactor everything")]
    for i in range(12):
        msgs += [call(f"c{i}"), tool(f"c{i}", f"output {i} " + "tok " * 600)]
    v = view(msgs, budget=3000, strategy="smart")
    assert v.token_count <= 3000 and v.stats["truncated"] > 0 and "truncated" in v.stats["warning"]
    assert v.messages[-1] == msgs[-1]  # the newest result is intact
    assert [m.get("tool_call_id") for m in v.messages] == [m.get("tool_call_id") for m in msgs]
    assert validate_sequence(v.messages) == []
    s = view(msgs, budget=3000, strategy="simple")
    assert s.messages == msgs and "smallest valid view" in s.stats["warning"]
