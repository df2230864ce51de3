"""A real agent of each framework, offline, SIGKILLed mid-run and resumed in a new process: nothing acknowledged
is lost, and the resumed agent's model is shown the earlier turns.

Agent Framework: ``Agent`` + a scripted chat client + PersistentHistoryProvider (tests/agent_framework_child.py).
AutoGen: ``AssistantAgent`` + ``ReplayChatCompletionClient`` + PersistentChatCompletionContext
(tests/autogen_child.py). A turn is acknowledged when ``agent.run`` returned (the child then writes its number to
an fsynced file); the turn in flight at the kill may be stored in part or whole, or not at all.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON, ROOT

pytestmark = pytest.mark.slow

CHILDREN = {"agent_framework": ROOT / "tests" / "agent_framework_child.py",
            "autogen": ROOT / "tests" / "autogen_child.py"}


def _acked(acks: Path) -> list[list[int]]:
    if not acks.exists():
        return []
    return [[int(x) for x in line.split()] for line in acks.read_text().splitlines() if line.strip()]


def _run_and_kill(framework: str, store: Path, acks: Path, first: int, kill_after: int,
                  env: dict[str, str]) -> None:
    """Run turns from ``first`` on; SIGKILL once ``kill_after`` more turns are acknowledged."""
    before = len(_acked(acks))
    proc = subprocess.Popen([PYTHON, str(CHILDREN[framework]), str(store), "s-1", str(first), str(first + 500),
                             str(acks)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while len(_acked(acks)) < before + kill_after:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the child acknowledged too few turns in 120 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _finish(framework: str, store: Path, acks: Path, first: int, last: int, env: dict[str, str]) -> None:
    done = subprocess.run([PYTHON, str(CHILDREN[framework]), str(store), "s-1", str(first), str(last), str(acks)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


async def _turns_agent_framework(store: Path) -> list[tuple[str, ...]]:
    from context_persistent.integrations.agent_framework import PersistentHistoryProvider

    async with PersistentHistoryProvider(store) as provider:
        messages = await provider.get_messages("s-1")
    out: list[tuple[str, ...]] = []
    for m in messages:
        parts: list[str] = [str(m.role)]
        for c in m.contents:
            if c.type == "text":
                parts.append(c.text or "")
            elif c.type == "function_call":
                parts.append(f"call {c.call_id} {c.name} {c.parse_arguments()}")
            elif c.type == "function_result":
                parts.append(f"result {c.call_id} {c.result}")
            else:
                parts.append(c.type)
        out.append(tuple(parts))
    return out


async def _turns_autogen(store: Path) -> list[tuple[str, ...]]:
    from context_persistent.integrations.autogen import PersistentChatCompletionContext, Unbounded

    async with PersistentChatCompletionContext(store, "s-1", strategy=Unbounded()) as context:
        messages = await context.get_messages()
    out: list[tuple[str, ...]] = []
    for m in messages:
        if m.type == "AssistantMessage" and isinstance(m.content, list):
            out.append(("assistant", *(f"call {c.id} {c.name} {c.arguments}" for c in m.content)))
        elif m.type == "FunctionExecutionResultMessage":
            out.append(("tool", *(f"result {r.call_id} {r.content}" for r in m.content)))
        else:
            out.append((m.type.replace("Message", "").lower(), str(m.content)))
    return out


def _expected(framework: str, turn: int) -> list[tuple[str, ...]]:
    if framework == "agent_framework":
        return [("user", f"turn {turn}"), ("assistant", f"call call-{turn} lookup {{'turn': {turn}}}"),
                ("tool", f"result call-{turn} fact-{turn}"), ("assistant", f"answer {turn}: fact-{turn}")]
    return [("user", f"turn {turn}"), ("assistant", f'call call-{turn} lookup {{"turn": {turn}}}'),
            ("tool", f"result call-{turn} fact-{turn}"), ("assistant", f"answer {turn}: fact-{turn}")]


def _strip_seen(framework: str, rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    # The Agent Framework client's answers also say how many user turns it saw: checked separately.
    if framework != "agent_framework":
        return rows
    return [(r[0], r[1].split(" (saw ")[0], *r[2:]) if r[0] == "assistant" and " (saw " in r[1] else r for r in rows]


def _find(rows: list[tuple[str, ...]], block: list[tuple[str, ...]], start: int) -> int:
    for i in range(start, len(rows) - len(block) + 1):
        if rows[i:i + len(block)] == block:
            return i
    return -1


@pytest.mark.parametrize("framework", ["agent_framework", "autogen"])
def test_agent_killed_mid_run_resumes_with_nothing_lost(framework: str, tmp_path: Path,
                                                        subprocess_env: dict[str, Any]) -> None:
    store, acks = tmp_path / "store", tmp_path / "acks"
    first = 1
    for kill_after in (3, 2):  # two kills at different points, each followed by a resumed run
        _run_and_kill(framework, store, acks, first, kill_after, subprocess_env)
        first = _acked(acks)[-1][0] + 1
    _finish(framework, store, acks, first, first + 1, subprocess_env)

    acked = _acked(acks)
    turns = [a[0] for a in acked]
    assert len(turns) >= 3 + 2 + 2 and turns == list(range(1, len(turns) + 1))
    collect = _turns_agent_framework if framework == "agent_framework" else _turns_autogen
    rows = _strip_seen(framework, asyncio.run(collect(store)))
    position = 0
    for turn in turns:  # every acknowledged turn, whole and in order
        found = _find(rows, _expected(framework, turn), position)
        assert found >= 0, f"acknowledged turn {turn} is missing or incomplete; history: {rows}"
        position = found + 4
    # Rows not in an acknowledged turn can only be the turns in flight at the two kills.
    assert len(rows) - 4 * len(turns) <= 2 * 4
    # The model's last call of each turn showed it exactly the user turns stored before that turn's answer: a
    # resumed process loaded the earlier ones, and nothing was shown twice.
    raw = asyncio.run(collect(store))
    users_before = {}
    for i, row in enumerate(raw):
        if row[0] == "assistant" and row[1].startswith("answer "):
            users_before[int(row[1].split()[1].rstrip(":"))] = sum(1 for r in raw[:i] if r[0] == "user")
    if framework == "autogen":
        seen = {turn: n for turn, n in acked}
    else:
        seen = {int(r[1].split()[1].rstrip(":")): int(r[1].split(" (saw ")[1].split()[0])
                for r in raw if r[0] == "assistant" and " (saw " in r[1]}
    for turn in turns:
        assert seen[turn] == users_before[turn] >= turn, f"turn {turn}: the model saw {seen[turn]} user turns"
