"""A real writer process is SIGKILLed while it erases a message carried by an ``expired`` record (its original
record in an expired segment in the trash): at each step of the rewrite (the trash copy rewritten, the
rewritten segments written, the manifest committed, the files renamed) and at times spread over the erase.
Afterwards nothing acknowledged is lost, the views show the message only if the log still holds it (then
running the erase again completes it), and once it is gone no file under the storage root holds its bytes;
verify is clean."""

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
from context_persistent.operations import trash
from context_persistent.operations.repair import verify
from context_persistent.model.retention import RetentionPolicy
from context_persistent.storage.segment_store import CRASH_ENV
from context_persistent.storage.segments import decompress_all

CHILD = Path(__file__).with_name("erase_child.py")
SID = "s"
PINNED = {"role": "user", "content": "my card is 4111 1111 1111 1111 " + "z" * 200}
NEEDLE = orjson.dumps(PINNED)
PINNED_SEQ = 3  # (seq 1: session_started, 2: the system prompt)


async def _template(storage: Path, compress: bool) -> list[dict[str, Any]]:
    """A segmented session whose pinned message expired with its segment: carried by the expired record."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=8192,
                                                compress_sealed=compress, fsync="never")
    await store.add_message({"role": "system", "content": "be brief"})
    await store.add_message(PINNED)
    await store.pin(1)
    for i in range(300):
        await store.add_message({"role": "user", "content": f"message {i} " + "w" * 400})
    await store.close()
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=3))
    assert report["segments_expired"]
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    messages = await store.get_messages()
    await store.close()
    assert messages[1] == PINNED
    return messages


def _holders(storage: Path) -> list[str]:
    out = []
    for p in sorted(storage.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if NEEDLE in (decompress_all(data) if p.name.endswith(".zst") else data):
                out.append(str(p.relative_to(storage)))
    return out


def _run_child(storage: Path, env: dict[str, str], step: str | None, kill_after: float | None) -> list[str]:
    """The child erases the pinned message, then appends (ACK i); SIGKILLed at ``step`` (it kills itself),
    ``kill_after`` seconds after READY, or once it is idle. Its output lines."""
    env = {**env, CRASH_ENV: step} if step else env
    proc = subprocess.Popen([PYTHON, str(CHILD), str(storage), SID, str(PINNED_SEQ)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline().decode().strip()]
    assert lines == ["READY"], (lines, proc.stderr.read().decode()[-2000:])
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(proc.pid, signal.SIGKILL)
    elif step is None:
        while (line := proc.stdout.readline().decode().strip()) and line != "IDLE":
            lines.append(line)
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    lines += proc.stdout.read().decode().splitlines()
    proc.stdout.close()
    proc.stderr.close()
    if step is not None:
        assert proc.returncode == -signal.SIGKILL and not any(x.startswith("ERASED") for x in lines), lines
    return lines


async def _check(storage: Path, messages: list[dict[str, Any]], lines: list[str]) -> bool:
    """The checks of the module docstring; returns whether the kill came after the commit point."""
    acked = [int(x.split()[1]) for x in lines if x.startswith("ACK")]
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)  # (recovery runs here)
    try:
        got = await store.get_messages()
        committed = PINNED not in got
        base = [m for m in messages if m != PINNED] if committed else messages
        assert got[:len(base)] == base
        after = [m["content"] for m in got[len(base):]]
        assert after[:len(acked)] == [f"after {i}" for i in acked] and len(after) <= len(acked) + 1
        if committed:  # the new state: gone from the log, the trash and every side file
            assert _holders(storage) == []
        else:  # the old state: the log still holds it (the trash copy may be erased already); run it again
            assert not acked and any(h.startswith(SID + "/") for h in _holders(storage))
            receipt = await store.erase(seq=PINNED_SEQ)
            assert await store.verify_erasure(receipt) == [] and _holders(storage) == []
            assert await store.get_messages() == [m for m in got if m != PINNED]
    finally:
        await store.close()
    report = verify(storage / SID, SID)
    assert report.ok, report.problems
    return committed


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("step", ["erase-copies-written", "replace-written", "replace-manifest", "replace-renamed"])
def test_sigkill_at_each_step_of_erasing_an_expired_copy(tmp_path: Path, subprocess_env: dict[str, str],
                                                         step: str, compress: bool) -> None:
    storage = tmp_path / "store"
    messages = asyncio.run(_template(storage, compress))
    assert any(".retention/trash" in h for h in _holders(storage)) and any(
        h.startswith(SID + "/") for h in _holders(storage))
    lines = _run_child(storage, subprocess_env, step, None)
    committed = asyncio.run(_check(storage, messages, lines))
    assert committed == (step in ("replace-manifest", "replace-renamed"))


def test_sigkill_at_any_time_while_erasing_an_expired_copy(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    template = tmp_path / "template"
    messages = asyncio.run(_template(template, True))
    work = tmp_path / "work"
    shutil.copytree(template, work)
    lines = _run_child(work, subprocess_env, None, None)
    took = float(next(x for x in lines if x.startswith("ERASED")).split()[1])
    assert asyncio.run(_check(work, messages, lines))
    outcomes = []
    for i in range(8):
        shutil.rmtree(work)
        shutil.copytree(template, work)
        lines = _run_child(work, subprocess_env, None, took * (i + 0.5) / 6)  # from early in the erase to after it
        outcomes.append(asyncio.run(_check(work, messages, lines)))
    print("erase took", took, "s; committed:", outcomes)  # (both outcomes are checked by the step test above)
