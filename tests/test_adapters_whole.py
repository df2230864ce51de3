"""A framework adapter's write is whole or refused: a call that raises has stored nothing (issue #28, item 14).

What matters is that a later part of the call fails the store's validation after an earlier part passed the
adapter's own checks: for Agent Framework a message nested deeper than the store accepts (codec.MAX_DEPTH), for
AutoGen a result whose content is not JSON (NaN, built without pydantic's validation). (A lone surrogate served
here before: it is storable now, issue #28 item 13.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from context_persistent.model.codec import MAX_DEPTH


def _deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = {"in": value}
    return value


async def test_agent_framework_save_messages_stores_all_or_none(tmp_path: Path) -> None:
    """`save_messages([good, bad])` raises and stores neither; the history is as it was, after a reopen too."""
    from agent_framework import Message

    from context_persistent.integrations.agent_framework import PersistentHistoryProvider

    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", [Message(role="user", contents=["before"])])
        with pytest.raises(ValueError, match=r"messages\[1\] is nested more than"):
            await provider.save_messages("s", [Message(role="user", contents=["good"]),
                                               Message(role="user", contents=["bad"],
                                                       additional_properties={"deep": _deep(MAX_DEPTH)})])
        assert [m.text for m in await provider.get_messages("s")] == ["before"]
    async with PersistentHistoryProvider(tmp_path) as provider:
        assert [m.text for m in await provider.get_messages("s")] == ["before"]


async def test_autogen_function_results_are_stored_all_or_none(tmp_path: Path) -> None:
    """`add_message` of a function-result message whose second result cannot be stored raises and keeps neither
    result (no call left with half its results), after a reopen too."""
    from autogen_core import FunctionCall
    from autogen_core.models import (AssistantMessage, FunctionExecutionResult, FunctionExecutionResultMessage,
                                     UserMessage)

    from context_persistent.integrations.autogen import PersistentChatCompletionContext

    calls = [FunctionCall(id=f"c{k}", name="t", arguments="{}") for k in (1, 2)]
    async with PersistentChatCompletionContext(tmp_path, "s") as ctx:
        await ctx.add_message(UserMessage(content="go", source="user"))
        await ctx.add_message(AssistantMessage(content=calls, source="agent"))
        with pytest.raises(ValueError, match="NaN and Infinity are not valid JSON"):
            await ctx.add_message(FunctionExecutionResultMessage(content=[
                FunctionExecutionResult(content="one", name="t", call_id="c1", is_error=False),
                FunctionExecutionResult.model_construct(content=float("nan"), name="t", call_id="c2",
                                                        is_error=False)]))
        assert [m["type"] for m in (await ctx.save_state())["messages"]] == ["UserMessage", "AssistantMessage"]
    async with PersistentChatCompletionContext(tmp_path, "s") as ctx:  # (the stored history, not a request view)
        assert [m["type"] for m in (await ctx.save_state())["messages"]] == ["UserMessage", "AssistantMessage"]
