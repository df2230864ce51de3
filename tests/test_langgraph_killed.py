"""A real LangGraph ``StateGraph`` with a tool node, on ``PersistentCheckpointSaver``, SIGKILLed mid-run and
resumed in a new process from the thread's last checkpoint: nothing acknowledged is lost, the interrupted turn
is finished from where it stopped, and no turn is stored twice (tests/langgraph_child.py is the graph)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON, ROOT

pytest.importorskip("langgraph")

pytestmark = pytest.mark.slow

CHILD = ROOT / "tests" / "langgraph_child.py"


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _acked(acks: Path) -> list[int]:
    return [int(x) for x in acks.read_text().splitlines() if x.strip() and " " not in x] if acks.exists() else []


def _run_and_kill(store: Path, acks: Path, marks: Path, first: int, mode: str, env: dict[str, str],
                  *, in_tool_of: int | None = None, after_acks: int = 0) -> None:
    """Run from turn ``first``; SIGKILL once the tool of turn ``in_tool_of`` started, else after ``after_acks``
    more acknowledged turns (wherever the run then is)."""
    before = len(_acked(acks))
    proc = subprocess.Popen([PYTHON, str(CHILD), str(store), "thread-1", str(first), str(first + 500), str(acks),
                             str(marks), mode], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while True:
            if in_tool_of is not None and str(in_tool_of) in _lines(marks):
                break
            if in_tool_of is None and len(_acked(acks)) >= before + after_acks:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the child made too little progress in 120 s"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _state(store: Path) -> tuple[list[tuple[str, str]], list[dict[str, Any]], list[Any]]:
    """The thread's messages (type, text) from its last checkpoint, the store's mirrored history, and the
    checkpoints newest first, read in this process."""
    import asyncio

    from context_persistent.integrations.langgraph import PersistentCheckpointSaver

    async def read() -> tuple[list[tuple[str, str]], list[dict[str, Any]], list[Any]]:
        async with PersistentCheckpointSaver(store) as saver:
            config = {"configurable": {"thread_id": "thread-1"}}
            last = await saver.aget_tuple(config)
            assert last is not None
            rows = []
            for m in last.checkpoint["channel_values"]["messages"]:
                text = str(m.content) or " ".join(f"call {c['id']} {c['name']} {c['args']}" for c in m.tool_calls)
                rows.append((m.type, text))
            history = await saver.run("thread-1", lambda s: s.get_messages())
            checkpoints = [t async for t in saver.alist(config)]
            return rows, history, checkpoints

    return asyncio.run(read())


def test_graph_killed_in_the_tool_node_and_at_random_resumes_losing_nothing(
        tmp_path: Path, subprocess_env: dict[str, Any]) -> None:
    """Two kills (inside the tool node of turn 3; later wherever the run is), each followed by a new process
    that resumes the unfinished turn from the last checkpoint; every turn is whole, in order, and once."""
    store, acks, marks = tmp_path / "store", tmp_path / "acks", tmp_path / "marks"
    _run_and_kill(store, acks, marks, 1, "sync", subprocess_env, in_tool_of=3)
    assert _acked(acks) == [1, 2]
    _run_and_kill(store, acks, marks, 4, "async", subprocess_env, after_acks=3)
    assert "3 resumed" in acks.read_text()  # (the second process finished turn 3 from its checkpoint)
    first = _acked(acks)[-1] + 1
    done = subprocess.run([PYTHON, str(CHILD), str(store), "thread-1", str(first), str(first + 1), str(acks),
                           str(marks), "sync"], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    _assert_whole_turns(store, acks, at_least=first + 1)
    assert _lines(marks).count("3") == 2  # (the tool of turn 3 ran again after the kill: at least once, as
    # LangGraph promises for a node whose writes were not saved)


# A turn stores 9 records: the input checkpoint, then each task's writes and the checkpoint after it (__start__,
# agent, tools, agent); with durability="async" a checkpoint is stored while the next task runs.
@pytest.mark.parametrize("records", range(1, 10))
def test_graph_stopped_after_any_record_of_a_turn_resumes_it(
        tmp_path: Path, subprocess_env: dict[str, Any], records: int) -> None:
    """A process (async durability) ends right after storing the n-th record of its second turn; the next
    process finishes that turn from the last checkpoint (``state.tasks``: a checkpoint whose tasks' writes are
    all stored has an empty ``state.next`` and is still unfinished) and runs turn 3."""
    store, acks, marks = tmp_path / "store", tmp_path / "acks", tmp_path / "marks"
    args = [PYTHON, str(CHILD), str(store), "thread-1"]
    stopped = subprocess.run([*args, "1", "2", str(acks), str(marks), "async"], capture_output=True, text=True,
                             env={**subprocess_env, "LANGGRAPH_CHILD_EXIT_AFTER": str(9 + records)}, timeout=120)
    assert stopped.returncode == 9, stopped.stderr[-3000:]
    assert _acked(acks) == [1]
    done = subprocess.run([*args, "2", "3", str(acks), str(marks), "sync"], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _acked(acks)[-1] == 3  # (turn 2 resumed, unless its last checkpoint was stored: a task's writes and
    # the checkpoint after it are stored concurrently, in either order)
    _assert_whole_turns(store, acks, at_least=3)


def _assert_whole_turns(store: Path, acks: Path, at_least: int) -> None:
    """The thread's last checkpoint holds every acknowledged turn (and at least ``at_least``), each whole, in
    order and once; the store's history mirrors it; the checkpoints form one chain."""
    rows, history, checkpoints = _state(store)
    turns = len(rows) // 4
    assert len(rows) == 4 * turns and turns >= max(_acked(acks)) and turns >= at_least, (rows, acks.read_text())
    for k in range(1, turns + 1):  # every turn whole, in order, once; the model saw every earlier turn
        assert rows[4 * (k - 1):4 * k] == [
            ("human", f"turn {k}"), ("ai", f"call call-{k} lookup {{'turn': {k}}}"), ("tool", f"fact-{k}"),
            ("ai", f"answer {k}: fact-{k} (saw {k} user turns)")], rows
    # The store's own history (what `context-persistent show thread-1` prints) mirrors the graph's messages.
    assert [(m["role"], m.get("content") or m["tool_calls"][0]["id"]) for m in history] == [
        ({"human": "user", "ai": "assistant"}.get(t, t), text if not text.startswith("call ") else text.split()[1])
        for t, text in rows]
    # The checkpoints form one chain back to the first: every parent is there.
    ids = {t.config["configurable"]["checkpoint_id"] for t in checkpoints}
    parents = [t.parent_config["configurable"]["checkpoint_id"] for t in checkpoints if t.parent_config]
    assert len(parents) == len(checkpoints) - 1 and set(parents) <= ids
