"""A real Pydantic AI agent run, offline: ``python pydantic_ai_child.py STORE SESSION FIRST LAST ACKS``.

An ``Agent`` with a ``FunctionModel`` (a scripted model: it answers the user's "turn K" with a call of the
``lookup`` tool, then with "answer K: RESULT (saw N user turns)", N being the user prompts in what it was shown)
and our ``PersistentMessageHistory``. Each turn loads the history, runs the agent on it, and appends the run's
new messages; then the turn's number is appended (and fsynced) to ACKS. The parent kills this process with
SIGKILL and checks that every acknowledged turn is in the history and that the model was shown all of them.
"""

from __future__ import annotations

import asyncio
import os
import sys

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, \
    UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from context_persistent.integrations.pydantic_ai import PersistentMessageHistory


def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompts = [p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, UserPromptPart)]
    turn = int(str(prompts[-1]).split()[-1])
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart):
        return ModelResponse(parts=[TextPart(f"answer {turn}: {last.content} (saw {len(prompts)} user turns)")])
    return ModelResponse(parts=[ToolCallPart("lookup", {"turn": turn}, tool_call_id=f"call-{turn}")])


agent = Agent(FunctionModel(model))


@agent.tool_plain
def lookup(turn: int) -> str:
    """Look up the fact for a turn."""
    return f"fact-{turn}"


async def main(store: str, session: str, first: int, last: int, acks: str) -> None:
    async with PersistentMessageHistory(store, session) as history:
        for turn in range(first, last + 1):
            result = await agent.run(f"turn {turn}", message_history=await history.load())
            await history.append(result.new_messages())
            fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, f"{turn}\n".encode())
            os.fsync(fd)
            os.close(fd)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
