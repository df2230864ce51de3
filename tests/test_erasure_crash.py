"""A real writer process is SIGKILLed during ``erase``: afterwards the session is in the old state or the
new one (never half-erased: if the log still holds the message, views show it; if not, no file in the
session folder holds its bytes), and nothing acknowledged is lost."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from conftest import PYTHON
from context_persistent import PersistentContextManager
from context_persistent.operations.repair import verify

CHILD = Path(__file__).with_name("erase_child.py")
SECRET = {"role": "user", "content": "card 4111 1111 1111 1111, exp 12/29 " + "z" * 200}
NEEDLE = orjson.dumps(SECRET)
N = 4000  # messages before and after the secret: a log of several MB, so an erase takes a while


async def _template(storage: Path) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                checkpoint_every=1000)
    messages = []
    for i in range(N):
        m = {"role": "user" if i % 2 else "assistant", "content": f"message {i} " + "w" * 1500}
        messages.append(m)
        await store.add_message(m)
        if i == N // 2:
            await store.add_message(SECRET)
            messages.append(SECRET)
    await store.export(storage / "s" / "compaction-0000000100.jsonl", view="reasoning")
    await store.close()
    with open(storage / "s" / "events.jsonl.torn-1-1-abc", "wb") as f:  # a side file holding a copy
        f.write(b"junk" + NEEDLE)
    os.chmod(storage / "s" / "events.jsonl.torn-1-1-abc", 0o600)
    return messages


def _run_child(storage: Path, env: dict[str, str], kill_after: float | None) -> tuple[list[str], float | None]:
    """Start the child, SIGKILL it ``kill_after`` s after READY (None: let it finish); its output lines."""
    proc = subprocess.Popen([PYTHON, str(CHILD), str(storage), "s", str(N // 2 + 3)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    lines = [proc.stdout.readline().decode().strip()]
    assert lines[0] == "READY", (lines, proc.stderr.read() if proc.stderr else "")
    elapsed = None
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(proc.pid, signal.SIGKILL)
    else:
        while True:
            line = proc.stdout.readline().decode().strip()
            lines.append(line)
            if line.startswith("ERASED"):
                elapsed = float(line.split()[1])
            if line == "IDLE" or not line:
                break
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rest = proc.stdout.read().decode().split()
    lines += [" ".join(rest[i:i + 2]) for i in range(0, len(rest), 2)] if kill_after is not None else []
    proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    return lines, elapsed


async def _check(storage: Path, messages: list[dict[str, Any]], lines: list[str]) -> bool:
    """Old or new state, nothing acknowledged lost; returns whether the message was erased."""
    acked = [int(x.split()[1]) for x in lines if x.startswith("ACK")]
    folder = storage / "s"
    store = await PersistentContextManager.open(storage_path=storage, session_id="s")
    try:
        got = await store.get_messages()
    finally:
        await store.close()
    erased = SECRET not in got
    base = [m for m in messages if m != SECRET] if erased else messages
    assert got[:len(base)] == base
    after = [m["content"] for m in got[len(base):]]
    assert after[:len(acked)] == [f"after {i}" for i in acked]  # every acknowledged append is there
    assert len(after) <= len(acked) + 1  # at most the one in flight
    if erased:  # the new state: the bytes are nowhere in the session folder
        holders = [p.name for p in folder.iterdir() if p.is_file() and NEEDLE in p.read_bytes()]
        assert holders == []
    else:
        assert not acked and NEEDLE in (folder / "events.jsonl").read_bytes()
    report = verify(folder, "s")
    assert report.ok, report.problems
    return erased


@pytest.mark.slow
def test_sigkill_during_erase_leaves_the_old_or_the_new_state(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    template = tmp_path / "template"
    messages = asyncio.run(_template(template))
    work = tmp_path / "work"
    shutil.copytree(template, work)
    lines, elapsed = _run_child(work, subprocess_env, None)
    assert elapsed is not None and asyncio.run(_check(work, messages, lines))
    outcomes = []
    for i in range(10):
        shutil.rmtree(work)
        shutil.copytree(template, work)
        # from early in the erase to well after it: the log's commit is near its end (the search index's part
        # after it is small), and a run can take longer than the first on a loaded machine
        lines, _ = _run_child(work, subprocess_env, elapsed * (i + 0.5) / 5)
        outcomes.append(asyncio.run(_check(work, messages, lines)))
    print("erase took", elapsed, "outcomes", outcomes)
    assert False in outcomes and True in outcomes, outcomes  # kills landed before and after the commit point
