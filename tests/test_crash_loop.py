"""Crash loops: a real writer process is SIGKILLed at random moments, again and again.

After every kill the session is opened (which recovers a torn tail) and must hold every acknowledged
message, in order, and nothing else but the few messages that were durable but not yet acknowledged when
the kill landed. ``CP_SOAK_KILLS`` raises the number of kills (``make soak``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.storage.log import scan
from context_persistent.storage.paths import CHECKPOINT_NAME, LOG_NAME
from context_persistent.model.projection import Projection
from context_persistent.operations.repair import verify
from conftest import PYTHON

CHILD = Path(__file__).with_name("crash_child.py")
KILLS = int(os.environ.get("CP_SOAK_KILLS", "200"))
SESSION_EVERY = 25  # kills per session, so logs stay small and each reopen stays fast


class Zygote:
    """One pre-imported Python process that forks a writer child per command (see crash_child.py)."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.err_path = tmp / "zygote.err"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([PYTHON, str(CHILD), "zygote", str(tmp / "warm-up")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env)

    def start(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        kind, pid = self.line()
        assert kind == "PID", (kind, pid)
        return int(pid)

    def line(self) -> tuple[str, str]:
        assert self.proc.stdout is not None
        raw = self.proc.stdout.readline().decode()
        if not raw:
            raise AssertionError(f"helper process died: {self.err_path.read_text()[-2000:]}")
        kind, _, rest = raw.strip().partition(" ")
        if kind == "ERR":
            raise AssertionError(f"writer child failed: {rest}")
        return kind, rest

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def zygote(subprocess_env: dict[str, str], tmp_path: Path) -> Any:
    z = Zygote(subprocess_env, tmp_path)
    yield z
    z.close()


def _fold_file(path: Path) -> dict[str, Any]:
    """The projection state of a log file folded record by record (no checkpoint), tokens left out."""
    state = Projection()
    for rec, _ in scan(path):
        state.apply(rec)
    out = orjson.loads(orjson.dumps(state.to_state()))
    out.pop("tokens")
    return out


async def _reopen(storage: Path, session: str) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session)
    try:
        numbers = [int(m["content"][1:].split(":")[0]) for m in await store.get_messages()]
        state = orjson.loads(orjson.dumps(store._state.to_state()))
        state.pop("tokens")
        return numbers, state, {"loaded_seq": store._checkpoints.loaded_seq}
    finally:
        await store.close()


def _crash_loop(zygote: Zygote, storage: Path, kills: int, rng: random.Random, *, fsync: str = "always",
                concurrency: int = 1, checkpoint_every: int = 10_000, big_every: int = 10) -> dict[str, int]:
    seen = {"kills": 0, "unacked_in_log": 0, "mid_checkpoint": 0, "from_checkpoint": 0}
    in_log = 0
    for k in range(kills):
        session = f"crash-{k // SESSION_EVERY}"
        if k % SESSION_EVERY == 0:
            in_log = 0
        pid = zygote.start(storage=str(storage), session=session, start=in_log, fsync=fsync,
                           checkpoint_every=checkpoint_every, concurrency=concurrency, big_every=big_every,
                           count=400)
        acked: list[int] = []
        want = rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 21, 34])
        while len(acked) < want:
            kind, rest = zygote.line()
            if kind == "ACK":
                acked.append(int(rest))
            elif kind == "IDLE":
                break
        if rng.random() < 0.7:
            time.sleep(rng.random() * 0.003)  # a random moment: mid-open, mid-write, mid-fsync, mid-checkpoint
        os.kill(pid, signal.SIGKILL)
        while True:
            kind, rest = zygote.line()
            if kind == "ACK":
                acked.append(int(rest))  # acknowledged before the kill landed
            elif kind == "EXIT":
                assert rest.split()[0] == str(pid)
                break
        seen["kills"] += 1
        folder = storage / session
        seen["mid_checkpoint"] += (folder / (CHECKPOINT_NAME + ".tmp")).exists()

        numbers, state, checkpoint = asyncio.run(_reopen(storage, session))
        # Every acknowledged message, in order, and nothing that was never written.
        assert numbers == list(range(len(numbers))), f"kill {k}: log is not m0..mN in order: {numbers[-10:]}"
        assert all(i < len(numbers) for i in acked), f"kill {k}: acknowledged {max(acked)} but log has {len(numbers)}"
        unacked = len(numbers) - in_log - len(acked)  # durable when the kill landed, not yet acknowledged
        assert 0 <= unacked <= concurrency, f"kill {k}: {unacked} unacknowledged messages in the log"
        seen["unacked_in_log"] += unacked
        # The state reached through the checkpoint is the state of the log folded from scratch.
        assert state == _fold_file(folder / LOG_NAME), f"kill {k}: checkpoint + tail differs from a full replay"
        seen["from_checkpoint"] += checkpoint["loaded_seq"] > 0
        if k % 5 == 4:
            report = verify(folder, session)
            assert report.ok, f"kill {k}: verify after recovery: {report.to_dict()}"
        in_log = len(numbers)
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_loop_fsync_always_keeps_every_acknowledged_message(zygote: Zygote, tmp_path: Path) -> None:
    """With fsync=always, every SIGKILL leaves a log holding each acknowledged message in order plus at most one more."""
    seen = _crash_loop(zygote, tmp_path / "store", KILLS, random.Random(4))
    assert seen["kills"] == KILLS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_loop_batch_mode_keeps_every_acknowledged_message(zygote: Zygote, tmp_path: Path) -> None:
    """With fsync=batch and 8 concurrent appends, SIGKILLs never lose an acknowledged message (group commit)."""
    seen = _crash_loop(zygote, tmp_path / "store", max(50, KILLS // 4), random.Random(5), fsync="batch",
                       concurrency=8)
    assert seen["kills"] >= 50


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_during_checkpoint_writes_never_changes_the_state(zygote: Zygote, tmp_path: Path) -> None:
    """Kills that land while checkpoints are being written leave a state equal to a full replay of the log."""
    seen = _crash_loop(zygote, tmp_path / "store", max(50, KILLS // 4), random.Random(6), checkpoint_every=1,
                       big_every=4)
    assert seen["mid_checkpoint"] > 0, f"no kill landed during a checkpoint write: {seen}"
    assert seen["from_checkpoint"] > 0, f"no reopen used a checkpoint: {seen}"
