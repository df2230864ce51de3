"""LangGraph checkpointers: our ``PersistentCheckpointSaver`` against ``langgraph-checkpoint-sqlite``'s
``SqliteSaver`` on the same graph.

The graph is an agent's: ``StateGraph(MessagesState)`` with an agent node (a scripted model: a tool call,
then an answer) and a ``ToolNode``; each turn adds four messages of about 300 bytes and five checkpoints. Both savers are durable: ours with ``fsync="always"``, SqliteSaver with its own WAL
and SQLite's default ``synchronous=FULL``. The graph runs with ``durability="sync"`` (each checkpoint saved
before the next step: the put is on the graph's path), the two graphs alternating turn by turn on fresh
folders each round, for ``lg_steps // 4`` turns (``lg_steps`` messages: 1,000 and 1,250 checkpoints in the full
run):

- put: the time of each ``put`` the graph makes (p50, and p50 of the last tenth, when the history is long);
- get: ``get_tuple`` of the thread's newest checkpoint (what every ``invoke`` starts with), and of the middle
  one by id (time travel), on the finished thread;
- storage: the bytes on disk after the run (ours: the thread's session folder, with the history mirrored as
  chat messages; SqliteSaver: its database file after closing, which folds its WAL in).

Rows are "the peer takes N times as long / as many bytes as ours" (> 1: ours is smaller or faster).
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from ._harness import Ctx, Row, Skip, compare, median, percentile

GROUP = "langgraph"


def _graph(saver: Any, text: str) -> Any:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def lookup(turn: int) -> str:
        """Look up the fact for a turn."""
        return f"fact-{turn} {text}"

    def agent(state: MessagesState) -> dict[str, Any]:
        messages = state["messages"]
        turn = int(str([m for m in messages if isinstance(m, HumanMessage)][-1].content).split()[1])
        if isinstance(messages[-1], ToolMessage):
            return {"messages": [AIMessage(f"answer {turn}: {text}")]}
        return {"messages": [AIMessage(text[:150], tool_calls=[{"name": "lookup", "args": {"turn": turn},
                                                                "id": f"call-{turn}"}])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([lookup]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=saver)


def _timed_puts(saver: Any, samples: list[float]) -> None:
    real = saver.put

    def put(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return real(*args, **kwargs)
        finally:
            samples.append((time.perf_counter_ns() - t) / 1000)

    saver.put = put


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _round(ctx: Ctx, steps: int, gets: int) -> tuple[dict[str, float], dict[str, float]]:
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.sqlite import SqliteSaver

    from context_persistent.integrations.langgraph import PersistentCheckpointSaver

    text = ("lorem ipsum dolor sit amet " * 12)[:280]
    ours_dir, peer_db = ctx.tempdir("lg-ours"), ctx.tempdir("lg-peer") / "checkpoints.db"
    conn = sqlite3.connect(str(peer_db), check_same_thread=False)
    savers = [PersistentCheckpointSaver(ours_dir, fsync="always"), SqliteSaver(conn)]
    puts: list[list[float]] = [[], []]
    for saver, samples in zip(savers, puts):
        _timed_puts(saver, samples)
    apps = [_graph(s, text) for s in savers]
    config: dict[str, Any] = {"configurable": {"thread_id": "bench"}}
    out: tuple[dict[str, float], dict[str, float]] = ({}, {})
    try:
        for turn in range(1, steps // 4 + 1):
            for app in apps:
                app.invoke({"messages": [HumanMessage(f"turn {turn} {text[:250]}")]}, config, durability="sync")
        middles = []
        for saver in savers:  # (each graph made its own checkpoint ids)
            ids = [t.config["configurable"]["checkpoint_id"] for t in saver.list(config)]
            middles.append({"configurable": {"thread_id": "bench", "checkpoint_ns": "",
                                             "checkpoint_id": ids[len(ids) // 2]}})
        got: list[dict[str, list[float]]] = [{"latest": [], "middle": []}, {"latest": [], "middle": []}]
        for _ in range(gets):
            for side, saver in enumerate(savers):
                for key, cfg in (("latest", config), ("middle", middles[side])):
                    t = time.perf_counter_ns()
                    tup = saver.get_tuple(cfg)
                    got[side][key].append((time.perf_counter_ns() - t) / 1000)
                    assert tup is not None and tup.checkpoint["channel_values"]["messages"]
        n_checkpoints = [len(list(s.list(config))) for s in savers]
        assert n_checkpoints[0] == n_checkpoints[1] >= steps, n_checkpoints
        for side in (0, 1):
            tail = puts[side][-max(1, len(puts[side]) // 10):]
            out[side].update(put_p50=percentile(puts[side], 50), put_tail_p50=percentile(tail, 50),
                             get_latest=median(got[side]["latest"]), get_middle=median(got[side]["middle"]))
    finally:
        savers[0].close()
        conn.close()
    out[0]["bytes"] = _bytes(ours_dir)
    out[1]["bytes"] = _bytes(peer_db) + sum(_bytes(Path(f"{peer_db}{s}")) for s in ("-wal", "-shm")
                                            if os.path.exists(f"{peer_db}{s}"))
    out[0]["steps"] = out[1]["steps"] = float(n_checkpoints[0])
    return out


def run(ctx: Ctx) -> list[Row]:
    try:
        import langgraph.checkpoint.sqlite  # noqa: F401

        import context_persistent.integrations.langgraph  # noqa: F401
    except ImportError as e:
        raise Skip(f"needs the [langgraph] extra and langgraph-checkpoint-sqlite ({e})") from None
    ctx.defaults(quick={"lg_steps": 200, "lg_gets": 20}, full={"lg_steps": 1000, "lg_gets": 50})
    steps, gets = ctx.size("lg_steps"), ctx.size("lg_gets")
    mine, theirs = [], []
    for r in range(ctx.rounds):
        ctx.log(f"langgraph round {r + 1}/{ctx.rounds}")
        o, p = _round(ctx, steps, gets)
        mine.append(o)
        theirs.append(p)
    n, msgs = int(mine[0]["steps"]), 4 * (steps // 4)
    ref = "langgraph-checkpoint-sqlite SqliteSaver (WAL, synchronous=FULL)"
    rows = []
    for key, name, unit in (
            ("put_p50", f"put, p50 over {n:,} checkpoints: SqliteSaver / ours", "µs"),
            ("put_tail_p50", f"put, p50 of the last tenth (history of ~{msgs:,} messages): SqliteSaver / ours",
             "µs"),
            ("get_latest", f"get_tuple, newest of {n:,}: SqliteSaver / ours", "µs"),
            ("get_middle", f"get_tuple by id, the middle one of {n:,}: SqliteSaver / ours", "µs"),
            ("bytes", f"storage after {n:,} checkpoints ({msgs:,} messages): SqliteSaver / ours", "B")):
        rows.append(compare(GROUP, name, [m[key] for m in mine], [t[key] for t in theirs], unit=unit,
                            ref_name=ref, invert=True))
    return rows
