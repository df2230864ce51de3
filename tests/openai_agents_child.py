"""An openai-agents run on our PersistentSession, for the kill-and-resume test (run as a script, not collected).

``python tests/openai_agents_child.py STORAGE SESSION FIRST LAST [HANG]``: runs turns FIRST..LAST with
``Runner.run``, offline: the model is openai-agents' ``ScriptedModel``, which for turn ``k`` first calls the
tool ``lookup(n=k)`` (call id ``call-k``) and then answers ``done k``. On stdout, unbuffered:

    START <n>               the session held n items when the run started
    FIRST_INPUT <json>      the input the model got on the first call of turn FIRST (history included)
    IN_TOOL <k>             the tool of turn k is running (with HANG == k it then sleeps until killed)
    ACK <k> <json>          Runner.run of turn k returned; <json> is the session's items at that moment
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from agents import Agent, Runner, function_tool
from agents.testing import ScriptedModel, assistant_message, function_call

from context_persistent.integrations.openai_agents import PersistentSession


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


async def main(storage: str, session_id: str, first: int, last: int, hang: int | None) -> None:
    @function_tool
    def lookup(n: int) -> str:
        """Look a number up."""
        _say(f"IN_TOOL {n}")
        if n == hang:
            time.sleep(600)
        return f"value of {n} is {n * n}"

    steps = []
    for k in range(first, last + 1):
        steps.append([function_call("lookup", {"n": k}, call_id=f"call-{k}", item_id=f"fc-{k}")])
        steps.append([assistant_message(f"done {k}", item_id=f"msg-{k}")])
    model = ScriptedModel(steps=steps)
    agent = Agent(name="counter", instructions="Use lookup for every number.", model=model, tools=[lookup])
    session = PersistentSession(session_id, storage)
    try:
        _say(f"START {len(await session.get_items())}")
        for k in range(first, last + 1):
            result = await Runner.run(agent, f"turn {k}: look up {k}", session=session)
            assert result.final_output == f"done {k}", result.final_output
            if k == first:
                _say("FIRST_INPUT " + json.dumps(model.calls[0].input))
            _say(f"ACK {k} " + json.dumps(await session.get_items()))
    finally:
        await session.aclose()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], args[1], int(args[2]), int(args[3]), int(args[4]) if len(args) > 4 else None))
