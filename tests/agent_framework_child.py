"""A real Agent Framework agent run, offline: ``python agent_framework_child.py STORE SESSION FIRST LAST ACKS``.

An ``agent_framework.Agent`` with a scripted chat client (no network: the client answers each user turn with a
function call, the agent runs the tool, the client then answers with text) and our PersistentHistoryProvider.
Turns FIRST..LAST are run one by one; after each ``agent.run`` returns, the turn number is appended (and fsynced)
to ACKS: the parent kills this process with SIGKILL at some point and checks that every acknowledged turn is in
the store. Each answer says how many user turns the model was shown, which proves a resumed process gives the
model the earlier turns.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from agent_framework import (
    Agent,
    AgentSession,
    BaseChatClient,
    ChatResponse,
    Content,
    FunctionInvocationLayer,
    Message,
    tool,
)

from context_persistent.integrations.agent_framework import PersistentHistoryProvider


@tool(approval_mode="never_require")
def lookup(turn: int) -> str:
    """Look up the fact for a turn."""
    return f"fact-{turn}"


class ScriptedClient(FunctionInvocationLayer, BaseChatClient):  # type: ignore[misc]
    """Turn "turn K": first a call of lookup(K), then, once its result is there, "answer K (saw N user turns)"."""

    def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Mapping[str, Any],
                            **kwargs: Any) -> Any:
        async def respond() -> ChatResponse:
            users = [m for m in messages if m.role == "user"]
            turn = int(users[-1].text.split()[-1])
            last = messages[-1]
            if last.role == "tool":
                result = last.contents[0].result
                text = f"answer {turn}: {result} (saw {len(users)} user turns)"
                return ChatResponse(messages=Message(role="assistant", contents=[text]))
            call = Content.from_function_call(call_id=f"call-{turn}", name="lookup", arguments={"turn": turn})
            return ChatResponse(messages=Message(role="assistant", contents=[call]))

        return respond()


async def main(store: str, session_id: str, first: int, last: int, acks: str) -> None:
    provider = PersistentHistoryProvider(store)
    agent = Agent(client=ScriptedClient(), name="worker", instructions="Answer with the fact.", tools=[lookup],
                  context_providers=[provider])
    session = AgentSession(session_id=session_id)
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for turn in range(first, last + 1):
        await agent.run(f"turn {turn}", session=session)
        os.write(fd, f"{turn}\n".encode())
        os.fsync(fd)
    os.close(fd)
    await provider.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
