"""A real process applying segment retention is SIGKILLed at each step (segment_expiry.STEPS): afterwards the
session opens with every acknowledged message either there or expired as a whole (never a half-expired view),
and the next retention command finishes the expiry (after its record is written) or cancels it (before), so
that the session ends up exactly as an uninterrupted expiry leaves it, with the expired files in one place."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON
from context_persistent import PersistentContextManager
from context_persistent.operations import trash
from context_persistent.model.retention import RetentionPolicy
from context_persistent.operations.segment_expiry import STEPS
from context_persistent.storage.segments import load_manifest

CHILD = Path(__file__).with_name("segment_expiry_child.py")
SID = "seg"


async def _build(storage: Path) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    msgs = [{"role": "system", "content": "be brief"}]
    msgs += [{"role": "user", "content": f"message {i} " + "s" * 300} for i in range(50)]
    for m in msgs:
        await store.add_message(m)
    await store.pin(2)
    await store.close()
    return msgs


async def _messages(storage: Path) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    try:
        return await store.get_messages()
    finally:
        await store.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The session before, and after an uninterrupted expiry (its messages, files and trash entry)."""
    base = tmp_path_factory.mktemp("segexp")
    before = base / "before"
    msgs = asyncio.run(_build(before))
    done = base / "done"
    shutil.copytree(before, done, symlinks=True)
    asyncio.run(trash.apply_file(done, RetentionPolicy(max_segments=1)))
    return {"before": before, "msgs": msgs, "expired": asyncio.run(_messages(done)),
            "gone": sorted(os.listdir(done / ".retention" / "trash" / f"{SID}~1"))}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_each_step_leaves_a_whole_state_and_the_next_apply_finishes(
        step: str, template: dict[str, Any], tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    storage = tmp_path / "store"
    shutil.copytree(template["before"], storage, symlinks=True)
    originals = {n: _sha(storage / SID / n) for n in template["gone"]}
    proc = subprocess.run([PYTHON, str(CHILD), str(storage)], capture_output=True, timeout=120,
                          env={**subprocess_env, "CONTEXT_PERSISTENT_CRASH_AT": step})
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    # right after the kill: the session opens with the whole history, or with the expired view, nothing between
    seen = asyncio.run(_messages(storage))
    recorded = step != "expire-ledger"
    assert seen == (template["expired"] if recorded else template["msgs"])
    # the next apply finishes (or cancels, then redoes) the expiry
    report = asyncio.run(trash.apply_file(storage, RetentionPolicy(max_segments=1)))
    actions = [r["action"] for r in report["reconciled"]]
    if not recorded:
        assert actions == ["segment expiry cancelled (interrupted before its record)"]
        assert [r["entry"] for r in report["segments_expired"]] == [f"{SID}~3"]
    else:
        assert report["segments_expired"] == []
    assert asyncio.run(_messages(storage)) == template["expired"]
    entries = [r for r in asyncio.run(trash.list_trash(storage)) if r["state"] == "trashed"]
    assert len(entries) == 1
    entry = storage / ".retention" / "trash" / entries[0]["entry"]
    assert sorted(os.listdir(entry)) == template["gone"]
    assert {n: _sha(entry / n) for n in template["gone"]} == originals
    assert not any((storage / SID / n).exists() for n in template["gone"])
    manifest = load_manifest(storage / SID, SID)
    assert manifest is not None and manifest.boundary is not None and manifest.pending == ()
