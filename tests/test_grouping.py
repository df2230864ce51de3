"""The one helper that owns tool-call grouping and the orphan repairs (pure tests, no event loop)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from context_persistent.model.grouping import (
    analyse, group_messages, is_real_user_turn, repair, tool_calls_of, validate_sequence,
)
from strategies import conversations


def call(*ids: str, text: Any = None) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "read_file", "arguments": "{}"}} for i in ids]}


def result(i: str, text: str = "out") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": i, "content": text}


def use(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": "let me look"}] + [
        {"type": "tool_use", "id": i, "name": "grep", "input": {}} for i in ids]}


def results(*ids: str, text: str | None = None) -> dict[str, Any]:
    blocks: list[Any] = [{"type": "tool_result", "tool_use_id": i, "content": "r"} for i in ids]
    if text:
        blocks.append({"type": "text", "text": text})
    return {"role": "user", "content": blocks}


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}
S = {"role": "system", "content": "be nice"}


def kinds(messages: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(g.kind, len(g)) for g in group_messages(messages)]


def test_openai_parallel_calls_and_results_are_one_group() -> None:
    """An assistant message with two tool_calls plus both tool messages forms a single group."""
    msgs = [S, U, call("a", "b"), result("b"), result("a"), A]
    assert kinds(msgs) == [("system", 1), ("user", 1), ("tool", 3), ("assistant", 1)]


def test_anthropic_parallel_tool_use_and_results_are_one_group() -> None:
    """tool_use blocks and the next user message's tool_result blocks form a single group."""
    msgs = [U, use("t1", "t2"), results("t1", "t2"), A]
    assert kinds(msgs) == [("user", 1), ("tool", 2), ("assistant", 1)]


def test_legacy_function_call_is_grouped_with_its_function_result() -> None:
    """A legacy function_call and the following role=function message are one group."""
    msgs = [U, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "42"}]
    assert kinds(msgs) == [("user", 1), ("tool", 2)]


def test_group_token_sum_uses_the_given_counts() -> None:
    """Group.token_sum adds the cached counts of its own messages only."""
    groups = group_messages([U, call("a"), result("a"), A])
    assert [g.token_sum([1, 10, 100, 1000]) for g in groups] == [1, 110, 1000]


def test_orphan_openai_result_is_dropped_and_reported() -> None:
    """A tool message with no earlier call is left out; the report names its id."""
    out, report = repair([U, result("ghost"), A])
    assert out == [U, A]
    assert report.orphan_results_dropped == ("ghost",)


def test_orphan_anthropic_block_is_dropped_but_user_text_is_kept() -> None:
    """Only the orphan tool_result block goes; the user's own text in that message stays."""
    out, report = repair([A, results("ghost", text="next question")])
    assert out == [A, {"role": "user", "content": [{"type": "text", "text": "next question"}]}]
    assert report.orphan_results_dropped == ("ghost",)


def test_duplicate_result_is_dropped() -> None:
    """A second result for an already-answered call is treated as an orphan."""
    out, report = repair([U, call("a"), result("a", "first"), result("a", "second")])
    assert out == [U, call("a"), result("a", "first")]
    assert report.orphan_results_dropped == ("a",)


def test_unanswered_openai_call_gets_a_marked_placeholder() -> None:
    """A call whose result never came is answered by a placeholder that says so; the call is kept."""
    out, report = repair([U, call("a", "b", text="checking"), result("a"), U])
    assert out[:4] == [U, call("a", "b", text="checking"), result("a")] + [out[3]]
    assert out[3]["role"] == "tool" and out[3]["tool_call_id"] == "b"
    assert "no result recorded for tool 'read_file' (b)" in out[3]["content"]
    assert out[4] == U
    assert report.placeholders_added == ("b",)
    assert validate_sequence(out) == []


def test_unanswered_anthropic_call_placeholder_joins_the_results_message_first() -> None:
    """Missing tool_result blocks are added to the existing results message, before its text."""
    out, report = repair([U, use("t1", "t2"), results("t1", text="also this")])
    blocks = out[2]["content"]
    assert [b.get("tool_use_id") for b in blocks] == ["t1", "t2", None]
    assert blocks[1]["is_error"] is True and "no result recorded" in blocks[1]["content"]
    assert report.placeholders_added == ("t2",)


def test_trailing_call_after_crash_gets_a_placeholder() -> None:
    """A call at the very end (crash mid-tool) is answered, so the view stays valid."""
    out, _ = repair([U, use("t1")])
    assert out[-1]["role"] == "user" and out[-1]["content"][0]["tool_use_id"] == "t1"
    assert validate_sequence(out) == []


def test_late_result_is_moved_next_to_its_call() -> None:
    """A result separated from its call by other messages moves up; the messages in between follow it."""
    out, report = repair([U, call("a"), A, U, result("a")])
    assert out == [U, call("a"), result("a"), A, U]
    assert report.results_moved == ("a",)


def test_late_anthropic_result_moves_while_its_user_text_stays_in_place() -> None:
    """A late tool_result block joins its call; the text of its message stays where it was."""
    out, _ = repair([U, use("t1"), A, results("t1", text="go on")])
    assert out[2] == {"role": "user", "content": [results("t1")["content"][0]]}
    assert out[3] == A
    assert out[4] == {"role": "user", "content": [{"type": "text", "text": "go on"}]}


def test_result_before_its_call_is_an_orphan_and_the_call_gets_a_placeholder() -> None:
    """Results only answer earlier calls."""
    out, report = repair([U, result("a"), call("a")])
    assert report.orphan_results_dropped == ("a",) and report.placeholders_added == ("a",)
    assert validate_sequence(out) == []


def test_empty_tool_calls_list_is_removed() -> None:
    """OpenAI rejects tool_calls: []; the repair removes the key from a copy."""
    msg = {"role": "assistant", "content": "done", "tool_calls": []}
    out, report = repair([U, msg])
    assert out == [U, {"role": "assistant", "content": "done"}]
    assert report.empty_tool_calls_removed == 1 and "tool_calls" in msg


def test_repair_returns_new_dicts_and_never_mutates_the_input() -> None:
    """repair() hands out copies; the caller's list and dicts are unchanged."""
    msgs = [U, use("t1", "t2"), results("t1"), A, result("ghost")]
    before = copy.deepcopy(msgs)
    out, _ = repair(msgs)
    assert msgs == before
    assert not any(o is m for o in out for m in msgs)


def test_valid_sequence_passes_through_unchanged_objects() -> None:
    """analyse() of a valid sequence reuses the same dicts so cached token counts still apply."""
    msgs = [S, U, call("a"), result("a"), A]
    found = analyse(msgs)
    assert not found.report.changed
    assert all(a is b for a, b in zip(found.messages, msgs)) and found.sources == [0, 1, 2, 3, 4]


def test_group_messages_refuses_a_sequence_that_needs_repair() -> None:
    """Grouping an invalid list raises a ValueError that names the problem."""
    with pytest.raises(ValueError, match="orphan tool result for 'ghost'"):
        group_messages([U, result("ghost")])


@pytest.mark.parametrize(("message", "real"), [
    (U, True), (results("t"), False), (results("t", text="and?"), True), (A, False),
    ({"role": "user", "content": [{"type": "text", "text": "x"}]}, True),
])
def test_real_user_turn(message: dict[str, Any], real: bool) -> None:
    """A user message made only of tool_result blocks is not a user turn."""
    assert is_real_user_turn(message) is real


def test_amplifier_tool_call_blocks_are_recognised() -> None:
    """Amplifier's tool_call/tool_result blocks (tool_call_id) are grouped like Anthropic's."""
    msgs = [U, {"role": "assistant", "content": [{"type": "tool_call", "id": "c", "name": "n", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_call_id": "c", "output": "o"}]}]
    assert tool_calls_of(msgs[1]) == [("c", "n", "tool_call")]
    assert kinds(msgs) == [("user", 1), ("tool", 2)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_repair_always_yields_a_valid_idempotent_sequence(conv: tuple[list[dict[str, Any]], list[bool]]) -> None:
    """For any history: the repair is valid, idempotent, keeps every call, and leaves the input alone."""
    msgs, _ = conv
    before = copy.deepcopy(msgs)
    out, report = repair(msgs)
    assert msgs == before
    assert validate_sequence(out) == []
    again, report2 = repair(out)
    assert again == out and not report2.changed
    calls_in = [k for m in msgs for k, _, _ in tool_calls_of(m)]
    calls_out = [k for m in out for k, _, _ in tool_calls_of(m)]
    assert calls_in == calls_out  # calls are never dropped, and keep their order
    groups = group_messages(out)
    assert [i for g in groups for i in g.indices] == list(range(len(out)))
