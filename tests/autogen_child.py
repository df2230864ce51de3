"""A real AutoGen agent run, offline: ``python autogen_child.py STORE SESSION FIRST LAST ACKS``.

autogen-agentchat's ``AssistantAgent`` with autogen-ext's ``ReplayChatCompletionClient`` (scripted responses,
no network) and our PersistentChatCompletionContext. Each turn "turn K": the model calls lookup(K), the agent
runs the tool, the model answers (``reflect_on_tool_use``). After each ``agent.run`` returns, a line
``K N`` is appended (and fsynced) to ACKS, N being how many user turns the model was shown in its last call:
the parent kills this process with SIGKILL and checks every acknowledged turn is in the store, and that a
resumed process showed the model the earlier turns (N == K).
"""

from __future__ import annotations

import asyncio
import os
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_core import FunctionCall
from autogen_core.models import CreateResult, ModelFamily, ModelInfo, RequestUsage, UserMessage
from autogen_ext.models.replay import ReplayChatCompletionClient

from context_persistent.integrations.autogen import PersistentChatCompletionContext


async def lookup(turn: int) -> str:
    """Look up the fact for a turn."""
    return f"fact-{turn}"


def script(first: int, last: int) -> list[CreateResult | str]:
    out: list[CreateResult | str] = []
    for turn in range(first, last + 1):
        call = FunctionCall(id=f"call-{turn}", name="lookup", arguments=f'{{"turn": {turn}}}')
        out.append(CreateResult(finish_reason="function_calls", content=[call], cached=False,
                                usage=RequestUsage(prompt_tokens=0, completion_tokens=0)))
        out.append(f"answer {turn}: fact-{turn}")
    return out


async def main(store: str, session_id: str, first: int, last: int, acks: str) -> None:
    info = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                     structured_output=False)
    client = ReplayChatCompletionClient(script(first, last), model_info=info)
    context = PersistentChatCompletionContext(store, session_id)
    agent = AssistantAgent("worker", model_client=client, tools=[lookup], model_context=context,
                           reflect_on_tool_use=True, system_message="Answer with the fact.")
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for turn in range(first, last + 1):
        await agent.run(task=f"turn {turn}")
        seen = [m for m in client.create_calls[-1]["messages"] if isinstance(m, UserMessage)]
        os.write(fd, f"{turn} {len(seen)}\n".encode())
        os.fsync(fd)
    os.close(fd)
    await context.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
