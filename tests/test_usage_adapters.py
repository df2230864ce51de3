"""Each framework adapter records the usage its framework reports: openai-agents' RunResult (per model response),
Agent Framework's response usage_details (in after_run, by itself), AutoGen's CreateResult and agent Response."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from context_persistent import read_usage

sys.path.insert(0, str(Path(__file__).parent))


async def test_openai_agents_records_each_model_response_once(tmp_path: Path) -> None:
    """A run's model responses are recorded one report each (openai-agents counts cached tokens inside the
    input); recording the same run again adds nothing (their response ids)."""
    from agents import Agent, Runner
    from agents.items import ModelResponse
    from agents.usage import Usage
    from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

    from context_persistent.integrations.openai_agents import PersistentSession

    usage = Usage(requests=1, input_tokens=120, output_tokens=8, total_tokens=128,
                  input_tokens_details=InputTokensDetails(cached_tokens=100, cache_write_tokens=0),
                  output_tokens_details=OutputTokensDetails(reasoning_tokens=3))
    from agents.testing import ScriptedModel, assistant_message

    model = ScriptedModel(steps=[[assistant_message("hi")]])
    async with PersistentSession("oa", tmp_path) as session:
        result = await Runner.run(Agent(name="a", model=model), "hello", session=session)
        result.raw_responses[:] = [ModelResponse(output=[], usage=usage, response_id="resp_1")]
        assert await session.record_usage(result) == 1
        assert await session.record_usage(result) == 0
        stats = await session.run(lambda store: _stats(store))
    assert stats["last_usage"]["cache_read_tokens"] == 100 and stats["last_usage"]["input_includes_cache"]
    assert stats["last_usage"]["reasoning_tokens"] == 3 and stats["last_usage"]["source"] == "openai-agents"
    total = (await read_usage(tmp_path))["total"]
    assert (total["reports"], total["input_tokens"]) == (1, 120)


async def _stats(store: Any) -> dict[str, Any]:
    return store.stats()


async def test_agent_framework_records_the_response_usage_in_after_run(tmp_path: Path) -> None:
    """A real Agent run with a client that reports usage_details: the provider records it by itself, with
    the response id, and a second run adds its own."""
    from agent_framework import Agent, AgentSession, BaseChatClient, ChatResponse, Message

    from context_persistent.integrations.agent_framework import PersistentHistoryProvider

    class Client(BaseChatClient):  # type: ignore[misc]
        calls = 0

        def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Mapping[str, Any],
                                **kwargs: Any) -> Any:
            async def respond() -> ChatResponse:
                Client.calls += 1
                return ChatResponse(messages=Message(role="assistant", contents=["ok"]),
                                    response_id=f"chat_{Client.calls}", model="scripted-1",
                                    usage_details={"input_token_count": 40 * Client.calls, "output_token_count": 2})
            return respond()

    provider = PersistentHistoryProvider(tmp_path)
    agent = Agent(client=Client(), name="w", context_providers=[provider])
    session = AgentSession(session_id="af")
    await agent.run("one", session=session)
    await agent.run("two", session=session)
    await provider.aclose()
    rows = (await read_usage(tmp_path, by="model"))["rows"]
    assert [(r["model"], r["reports"], r["input_tokens"]) for r in rows] == [("scripted-1", 2, 120)]


async def test_autogen_records_create_results_and_agent_responses(tmp_path: Path) -> None:
    """A model client's CreateResult, and the models_usage of an agent Response's messages, become reports."""
    from autogen_agentchat.base import Response
    from autogen_agentchat.messages import TextMessage
    from autogen_core.models import CreateResult, RequestUsage

    from context_persistent.integrations.autogen import PersistentChatCompletionContext

    ctx = PersistentChatCompletionContext(tmp_path, "ag")
    result = CreateResult(finish_reason="stop", content="x", usage=RequestUsage(prompt_tokens=30, completion_tokens=4),
                          cached=False)
    assert await ctx.record_usage(result, model="gpt-4o") == 1
    reply = Response(chat_message=TextMessage(source="a", content="y",
                                              models_usage=RequestUsage(prompt_tokens=50, completion_tokens=5)))
    assert await ctx.record_usage(reply, model="gpt-4o") == 1
    await ctx.close()
    total = (await read_usage(tmp_path, "ag"))["total"]
    assert (total["reports"], total["input_tokens"], total["output_tokens"]) == (2, 80, 9)
