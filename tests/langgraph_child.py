"""A real LangGraph run, offline: ``python langgraph_child.py STORE THREAD FIRST LAST ACKS MARKS MODE``.

A ``StateGraph(MessagesState)`` with an agent node (a scripted model: it answers the user's "turn K" with a
call of ``lookup(K)``, and the tool's result with "answer K: RESULT (saw N user turns)") and a ``ToolNode``,
compiled with our ``PersistentCheckpointSaver``. The process first finishes a turn a killed process left
unfinished (the thread's last checkpoint has tasks, run or not: ``invoke(None)`` resumes from it), then runs
turns FIRST..LAST. After each turn returns its number is appended (and fsynced) to ACKS. The tool appends
"K" (fsynced) to MARKS when it starts and then sleeps a little, so the parent can kill the process inside the
tool node. MODE ``sync`` runs ``invoke`` with ``durability="sync"`` (each checkpoint is saved before the next
step starts, so a kill in the tool node finds the agent node's checkpoint), ``async`` runs ``ainvoke`` with
LangGraph's default ``durability="async"`` (saved while the next step runs). A turn already in the thread
(stored whole by a killed process that had not acknowledged it yet) is not run again. With
``LANGGRAPH_CHILD_EXIT_AFTER=N`` in the environment the process ends (``os._exit(9)``, no cleanup, as a kill)
right after the saver stored its N-th record (a checkpoint or a task's writes).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import time
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from context_persistent.integrations.langgraph import PersistentCheckpointSaver

MARKS = ""


def _append(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@tool
def lookup(turn: int) -> str:
    """Look up the fact for a turn."""
    _append(MARKS, f"{turn}\n")
    time.sleep(0.05)
    return f"fact-{turn}"


def agent(state: MessagesState) -> dict[str, Any]:
    messages = state["messages"]
    users = [m for m in messages if isinstance(m, HumanMessage)]
    turn = int(str(users[-1].content).split()[-1])
    last = messages[-1]
    if isinstance(last, ToolMessage):
        return {"messages": [AIMessage(f"answer {turn}: {last.content} (saw {len(users)} user turns)")]}
    return {"messages": [AIMessage("", tool_calls=[{"name": "lookup", "args": {"turn": turn},
                                                    "id": f"call-{turn}"}])]}


def build(saver: PersistentCheckpointSaver) -> Any:
    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=saver)


def _last_turn(state: Any) -> int:
    users = [m for m in state.values.get("messages", []) if isinstance(m, HumanMessage)]
    return int(str(users[-1].content).split()[-1]) if users else 0


def _exit_after(saver: PersistentCheckpointSaver, records: int) -> None:
    """End the process right after the saver's ``records``-th stored record (its put or put_writes returned)."""
    stored = 0

    def counted(method: Any) -> Any:
        def after(result: Any) -> Any:
            nonlocal stored
            stored += 1
            if stored == records:
                os._exit(9)
            return result

        if inspect.iscoroutinefunction(method):
            async def wrapper_async(*args: Any, **kwargs: Any) -> Any:
                return after(await method(*args, **kwargs))
            return wrapper_async
        return lambda *args, **kwargs: after(method(*args, **kwargs))

    for name in ("put", "put_writes", "aput", "aput_writes"):
        setattr(saver, name, counted(getattr(saver, name)))


async def main(store: str, thread: str, first: int, last: int, acks: str, mode: str) -> None:
    saver = PersistentCheckpointSaver(store)
    if os.environ.get("LANGGRAPH_CHILD_EXIT_AFTER"):
        _exit_after(saver, int(os.environ["LANGGRAPH_CHILD_EXIT_AFTER"]))
    app = build(saver)
    config = {"configurable": {"thread_id": thread}}

    async def run(value: Any) -> None:
        if mode == "sync":
            app.invoke(value, config, durability="sync")
        else:
            await app.ainvoke(value, config)

    try:
        state = app.get_state(config) if mode == "sync" else await app.aget_state(config)
        if state.tasks:  # a killed process left this turn unfinished: resume it from the last checkpoint
            # (``tasks``, not ``next``: ``next`` leaves out the tasks whose writes were saved before the kill,
            # so a turn killed between a task's writes and the next checkpoint would look finished)
            await run(None)
            _append(acks, f"{_last_turn(await app.aget_state(config))} resumed\n")
        first = max(first, _last_turn(await app.aget_state(config)) + 1)
        for turn in range(first, last + 1):
            await run({"messages": [HumanMessage(f"turn {turn}")]})
            _append(acks, f"{turn}\n")
    finally:
        await saver.aclose()


if __name__ == "__main__":
    store_, thread_, first_, last_, acks_, MARKS, mode_ = sys.argv[1:8]
    asyncio.run(main(store_, thread_, int(first_), int(last_), acks_, mode_))
