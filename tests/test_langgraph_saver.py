"""PersistentCheckpointSaver beyond the conformance suite: real graphs (sync and async), time travel, threads
as sessions the CLI shows, thread ids that are not folder names, locking, deletion, damaged records, and the
framework loaded only when used."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402

from context_persistent import SessionLockedError  # noqa: E402
from context_persistent.errors import LogCorruptedError  # noqa: E402
from context_persistent.integrations.langgraph import (PersistentCheckpointSaver, session_id_for,  # noqa: E402
                                                       thread_id_of)
from context_persistent.model import events as ev  # noqa: E402
from context_persistent.store.host_events import read_host_events, record_host_event  # noqa: E402
from context_persistent.store.manager import PersistentContextManager  # noqa: E402


def _echo(state: MessagesState) -> dict[str, Any]:
    return {"messages": [AIMessage(f"echo: {state['messages'][-1].content}")]}


def _graph(saver: PersistentCheckpointSaver) -> Any:
    g = StateGraph(MessagesState)
    g.add_node("echo", _echo)
    g.add_edge(START, "echo")
    return g.compile(checkpointer=saver)


def _texts(state: Any) -> list[str]:
    return [str(m.content) for m in state.values["messages"]]


def test_sync_graph_resumes_in_a_new_saver_and_the_cli_shows_the_thread(tmp_path: Path,
                                                                        subprocess_env: dict[str, str]) -> None:
    """invoke (the sync methods) stores each step; a new saver continues the thread; `show` prints it."""
    config = {"configurable": {"thread_id": "chat-1"}}
    with PersistentCheckpointSaver(tmp_path) as saver:
        _graph(saver).invoke({"messages": [HumanMessage("hi")]}, config)
    with PersistentCheckpointSaver(tmp_path) as saver:
        app = _graph(saver)
        app.invoke({"messages": [HumanMessage("again")]}, config)
        assert _texts(app.get_state(config)) == ["hi", "echo: hi", "again", "echo: again"]
    shown = subprocess.run([sys.executable, "-m", "context_persistent", "--storage", str(tmp_path), "show",
                            "chat-1", "--json"], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    messages = json.loads(shown.stdout)["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "hi"), ("assistant", "echo: hi"), ("user", "again"), ("assistant", "echo: again")]
    assert all(m["langgraph"]["id"] for m in messages)


async def test_time_travel_by_checkpoint_id_forks_and_the_history_follows(tmp_path: Path) -> None:
    """Invoking from an earlier checkpoint id forks the thread; the mirrored history becomes the fork's."""
    config: dict[str, Any] = {"configurable": {"thread_id": "tt"}}
    async with PersistentCheckpointSaver(tmp_path) as saver:
        app = _graph(saver)
        await app.ainvoke({"messages": [HumanMessage("one")]}, config)
        await app.ainvoke({"messages": [HumanMessage("two")]}, config)
        history = [s async for s in app.aget_state_history(config)]
        after_one = next(s for s in history if _texts(s) == ["one", "echo: one"])
        await app.ainvoke({"messages": [HumanMessage("three")]}, after_one.config)
        assert _texts(await app.aget_state(config)) == ["one", "echo: one", "three", "echo: three"]
        old = await app.aget_state({"configurable": {"thread_id": "tt",
                                                     **{k: v for k, v in after_one.config["configurable"].items()
                                                        if k == "checkpoint_id"}}})
        assert _texts(old) == ["one", "echo: one"]  # (the earlier checkpoint is still there)
        mirrored = await saver.run("tt", lambda s: s.get_messages())
        stats = await saver.run("tt", lambda s: asyncio.sleep(0, s.stats()))
    assert [m["content"] for m in mirrored] == ["one", "echo: one", "three", "echo: three"]
    assert stats["events"]["messages_replaced"] == 1


def test_thread_ids_that_are_not_folder_names_map_to_distinct_sessions() -> None:
    """A thread id with '/', spaces, a leading dot or the prefix is base32-encoded, and decodes back."""
    for tid in ["plain-1", "user/42", " spaced ", ".hidden", "lg=looks-encoded", "ü", "a" * 128]:
        sid = session_id_for(tid)
        assert thread_id_of(sid) == tid
    assert session_id_for("plain-1") == "plain-1" and session_id_for("user/42").startswith("lg=")
    assert session_id_for("user/42") != session_id_for("user_42")
    with pytest.raises(ValueError, match="too long"):
        session_id_for("x/" * 60)


async def test_a_thread_has_one_writer_and_files_are_owner_only(tmp_path: Path) -> None:
    """A second saver writing an open thread gets SessionLockedError; folders are 0700 and files 0600."""
    config = {"configurable": {"thread_id": "t/1"}}
    async with PersistentCheckpointSaver(tmp_path) as first, PersistentCheckpointSaver(tmp_path) as second:
        await _graph(first).ainvoke({"messages": [HumanMessage("x")]}, config)
        with pytest.raises(SessionLockedError):
            await _graph(second).ainvoke({"messages": [HumanMessage("y")]}, config)
    folder = tmp_path / session_id_for("t/1")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())


async def test_delete_thread_removes_its_folder_and_leaves_others(tmp_path: Path) -> None:
    """delete_thread: the thread's session folder is gone (nothing left on disk), other threads stay."""
    async with PersistentCheckpointSaver(tmp_path) as saver:
        app = _graph(saver)
        for tid in ("a", "b"):
            await app.ainvoke({"messages": [HumanMessage(tid)]}, {"configurable": {"thread_id": tid}})
        await saver.adelete_thread("a")
        assert await saver.aget_tuple({"configurable": {"thread_id": "a"}}) is None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
        assert [t.config["configurable"]["thread_id"] async for t in saver.alist(None, limit=1)] == ["b"]


async def test_a_damaged_graph_record_is_refused_naming_its_seq(tmp_path: Path) -> None:
    """A graph_checkpoint whose data is not a LangGraph record (checksum fine) fails the open; not skipped."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="bad")
    seq = await record_host_event(store, ev.GRAPH_CHECKPOINT, {"ns": "", "id": "1", "checkpoint": "oops"})
    await store.close()
    async with PersistentCheckpointSaver(tmp_path) as saver:
        with pytest.raises(LogCorruptedError, match=f"seq {seq}.*graph_checkpoint.*not a LangGraph record"):
            await saver.aget_tuple({"configurable": {"thread_id": "bad"}})


async def test_host_events_refuse_other_types_and_read_back_in_order(tmp_path: Path) -> None:
    """Only host event types can be recorded; they are read back oldest first, views untouched."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="h") as store:
        with pytest.raises(ValueError, match="not a host event type; allowed: graph_checkpoint, graph_writes"):
            await record_host_event(store, ev.MESSAGE_ADDED, {"message": {"role": "user", "content": "x"}})
        for i in range(3):
            await record_host_event(store, ev.GRAPH_WRITES, {"i": i})
        assert [r["data"]["i"] async for r in read_host_events(store)] == [0, 1, 2]
        assert await store.get_messages() == []


def test_langgraph_loads_only_when_used(subprocess_env: dict[str, str]) -> None:
    """Importing the package imports no LangGraph; without it the module names the extra to install."""
    code = ("import sys, context_persistent, context_persistent.integrations\n"
            "assert not any(m.split('.')[0] in ('langgraph', 'langchain_core') for m in sys.modules)\n"
            "sys.modules['langgraph'] = None\n"
            "try:\n    import context_persistent.integrations.langgraph\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'context-persistent[langgraph]'" in out.stdout
