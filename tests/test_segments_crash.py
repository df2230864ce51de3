"""A real writer process is SIGKILLed at every step of a roll, a compression, an erasure in sealed segments and
a migration (tests/segment_child.py stops itself at the named step): the next open finishes or undoes the step,
nothing acknowledged is lost, and no half-done state is visible."""

from __future__ import annotations

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
from context_persistent.operations.repair import verify
from context_persistent.storage.segment_store import CRASH_ENV
from context_persistent.storage.segments import MANIFEST_NAME

from conftest import PYTHON, ROOT

SID = "crash"
CHILD = str(ROOT / "tests" / "segment_child.py")
SECRET = "the vault code is 7734-1999-0420"

pytestmark = pytest.mark.slow


def _run(storage: Path, mode: str, env: dict[str, str], step: str | None) -> tuple[list[str], int]:
    env = dict(env)
    if step is not None:
        env[CRASH_ENV] = step
    proc = subprocess.run([PYTHON, CHILD, str(storage), SID, mode], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc.stdout.split("\n"), proc.returncode


def _acked(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("ACK "))


async def _state(storage: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Open as a writer (which recovers), return the history and what recovery did; then check the folder."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    try:
        messages = await store.get_messages()
        recovered = list(store._log.recovered)
    finally:
        await store.close()
    folder = storage / SID
    assert not [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".erasing"))]
    if (folder / MANIFEST_NAME).exists():
        doc = orjson.loads((folder / MANIFEST_NAME).read_bytes())
        assert doc["pending"] == []
        for s in doc["segments"]:
            name = s["name"] + (".zst" if s["compressed"] else "")
            assert (folder / name).exists() and oct((folder / name).stat().st_mode & 0o777) == oct(0o400)
            assert not (s["compressed"] and (folder / s["name"]).exists())
    report = verify(folder, SID)
    assert report.ok, [p.describe() for p in report.problems]
    return messages, recovered


@pytest.mark.parametrize("mode,step", [("roll", "roll-manifest"), ("roll", "roll-renamed"), ("roll", "roll-created"),
                                       ("compress", "compress-written"), ("compress", "compress-manifest"),
                                       ("compress", "compress-renamed")])
async def test_kill_during_roll_or_compression_loses_nothing_acknowledged(
        storage: Path, subprocess_env: dict[str, str], mode: str, step: str) -> None:
    lines, code = _run(storage, mode, subprocess_env, step)
    assert code == -signal.SIGKILL, lines  # it reached the step and died there
    acked = _acked(lines)
    assert acked >= 10
    # a reader before any writer recovers: it sees the log as the manifest describes it, and changes nothing
    names = sorted(p.name for p in (storage / SID).iterdir())
    reader = await PersistentContextManager.open(storage_path=storage, session_id=SID, readonly=True)
    seen = [m["content"].split()[0] for m in await reader.get_messages()]
    await reader.close()
    # A roll runs within the append that sets it off, once that append is durable: the kill leaves exactly
    # that one more. A compression runs in a worker thread while appends go on: the kill may come during
    # an append, which is then there or not.
    kept = len(seen) if mode == "compress" and len(seen) in (acked, acked + 1) else acked + 1
    assert seen == [f"m{i}" for i in range(kept)], (acked, seen[-3:])
    assert sorted(p.name for p in (storage / SID).iterdir()) == names
    messages, recovered = await _state(storage)
    contents = [m["content"].split()[0] for m in messages]
    # every acknowledged append is there
    assert contents == [f"m{i}" for i in range(kept)], (acked, contents[-3:])
    if step in ("roll-manifest", "roll-renamed", "compress-manifest", "compress-renamed"):
        assert recovered  # it finished what was committed, and said so
    if step == "compress-written":
        assert any("never took effect" in a for a in recovered)
    # and the session carries on: more rolls, then a clean reopen
    lines, code = _run(storage, mode, subprocess_env, None)
    assert code == 0 and "IDLE" in lines
    messages, _ = await _state(storage)
    assert len(messages) == kept + 400


async def _prepare_erase(storage: Path) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                compress_sealed=True)
    await store.add_message({"role": "user", "content": SECRET})
    for i in range(40):
        await store.add_message({"role": "user", "content": f"f{i} " + "q" * 150})
    await store.set_messages([{"role": "user", "content": SECRET}, {"role": "user", "content": "last"}])
    await store.close()


def _holding(folder: Path, needle: bytes) -> set[str]:
    import zstandard

    out = set()
    for p in folder.iterdir():
        data = p.read_bytes()
        if p.name.endswith(".zst"):
            data = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)
        if needle in data:
            out.add(p.name)
    return out


@pytest.mark.parametrize("step", ["replace-written", "replace-manifest", "replace-renamed"])
async def test_kill_during_an_erasure_in_sealed_segments_leaves_old_or_new(
        storage: Path, subprocess_env: dict[str, str], step: str) -> None:
    await _prepare_erase(storage)
    folder = storage / SID
    before = _holding(folder, SECRET.encode())
    assert "segment-000001.jsonl.zst" in before and "events.jsonl" in before
    lines, code = _run(storage, "erase", subprocess_env, step)
    assert code == -signal.SIGKILL and "READY" in lines and "ERASED" not in lines
    messages, recovered = await _state(storage)
    after = _holding(folder, SECRET.encode())
    if step == "replace-written":  # killed before the commit: the old state, whole
        assert after == before and [m["content"] for m in messages] == [SECRET, "last"]
    else:  # after it: the new state, whole (recovery renamed every rewritten file into place)
        assert after == set() and recovered
        assert [m["content"] for m in messages] == ["last"]


@pytest.mark.parametrize("step", ["migrate-written", "migrate-manifest"])
async def test_kill_during_migrate_keeps_the_old_log_until_the_new_one_is_complete(
        storage: Path, subprocess_env: dict[str, str], step: str) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0)
    for i in range(60):
        await store.add_message({"role": "user", "content": f"g{i} " + "r" * 150})
    original = await store.get_messages()
    await store.close()
    old = (storage / SID / "events.jsonl").read_bytes()
    lines, code = _run(storage, "migrate", subprocess_env, step)
    assert code == -signal.SIGKILL and "MIGRATED" not in lines
    messages, recovered = await _state(storage)
    assert messages == original and recovered
    segmented = (storage / SID / MANIFEST_NAME).exists()
    assert segmented == (step == "migrate-manifest")
    if not segmented:
        assert (storage / SID / "events.jsonl").read_bytes() == old


async def test_kill_at_random_moments_while_rolling_and_compressing(storage: Path,
                                                                    subprocess_env: dict[str, str]) -> None:
    rng = random.Random(1616)
    total = 0
    for _ in range(6):
        proc = subprocess.Popen([PYTHON, CHILD, str(storage), SID, "compress"], env=subprocess_env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        out = proc.stdout.read()
        proc.wait()
        acked = _acked(out.split("\n"))
        messages, _ = await _state(storage)
        contents = [m["content"].split()[0] for m in messages]
        # this run's messages follow the earlier runs' ones: every acknowledged one, at most one more
        mine = contents[total:]
        assert mine[:acked] == [f"m{i}" for i in range(acked)] and len(mine) - acked in (0, 1), (acked, mine[-3:])
        total = len(contents)


@pytest.mark.parametrize("compress", [False, True])
async def test_readers_during_rolls_and_compressions_always_see_a_whole_prefix(
        storage: Path, subprocess_env: dict[str, str], compress: bool) -> None:
    """Read-only opens and LogReaders while a writer process rolls (and compresses) every few records: each
    read succeeds and sees a prefix of the history, never a gap or an error."""
    from context_persistent.storage.segments import LogReader

    code = ("import asyncio, sys\n"
            "from context_persistent import PersistentContextManager\n"
            "async def main():\n"
            "    s = await PersistentContextManager.open(storage_path=sys.argv[1], session_id='crash', fsync='never',\n"
            f"                                            segment_bytes=4096, compress_sealed={compress})\n"
            "    for i in range(1500):\n"
            "        await s.add_message({'role': 'user', 'content': f'm{i} ' + 'z' * 150})\n"
            "    await s.close()\n"
            "asyncio.run(main())\n")
    writer = subprocess.Popen([PYTHON, "-c", code, str(storage)], env=subprocess_env)
    reads, last = 0, 0
    try:
        while writer.poll() is None or reads == 0:
            if not (storage / SID / "events.jsonl").exists():
                time.sleep(0.01)
                continue
            store = await PersistentContextManager.open(storage_path=storage, session_id=SID, readonly=True)
            contents = [m["content"].split()[0] for m in await store.get_messages()]
            await store.close()
            assert contents == [f"m{i}" for i in range(len(contents))] and len(contents) >= last
            last = len(contents)
            with LogReader(storage / SID) as reader:
                seqs = [int(line[13:line.index(b",", 13)]) for _, line in reader.lines(0)]
            assert seqs == list(range(1, len(seqs) + 1))
            reads += 1
    finally:
        writer.wait(60)
    assert writer.returncode == 0 and reads >= 5 and last > 0
