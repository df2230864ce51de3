"""Readers in another process while erasures and segment expiries rewrite the log: every read sees a state
the session was in (before or after a rewrite, never in between) and no read fails or reports damage.

The reader (tests/rewrite_reader_child.py) loops over what ``show``, ``export``/``tail`` and ``verify`` do:
a read-only open and its history, every record decoded across the segments, and a full verify. This process
meanwhile appends, erases (records in sealed segments, compressed or not, in the active one, copies carried
by an ``expired`` record, copies in the trash) and expires segments, and records the history after every
step: the reader's histories must all be among them."""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from conftest import PYTHON
from context_persistent import PersistentContextManager
from context_persistent.operations import erasure
from context_persistent.operations import trash
from context_persistent.model.retention import RetentionPolicy

CHILD = Path(__file__).with_name("rewrite_reader_child.py")
SID = "busy"
ROUNDS = 8
MIN_READS = 60


def _in_trash(storage: Path) -> int | None:
    """The seq of a message_added record in an expired segment in the trash."""
    for path in erasure.trash_files(storage, SID):
        for rec, *_ in erasure._scan_trash_file(path):
            if rec["type"] == "message_added":
                return int(rec["seq"])
    return None


def _digest(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(orjson.dumps(messages)).hexdigest()


@pytest.mark.parametrize("segment_bytes", [4096, 0])
async def test_readers_see_whole_states_while_erase_and_expiry_rewrite(storage: Path, tmp_path: Path,
                                                                      subprocess_env: dict[str, str],
                                                                      segment_bytes: int) -> None:
    """``segment_bytes`` 0: a single-file log (erasures replace the file; nothing expires)."""
    states: set[str] = {_digest([])}
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=segment_bytes,
                                                fsync="never")
    await store.add_message({"role": "system", "content": "be brief"})
    states.add(_digest(await store.get_messages()))
    await store.close()
    stop, said = tmp_path / "stop", tmp_path / "reader.out"
    with open(said, "wb") as out:
        proc = subprocess.Popen([PYTHON, str(CHILD), str(storage), SID, str(stop)], stdout=out,
                                stderr=subprocess.PIPE, env=subprocess_env)

    def reads() -> int:
        return said.read_bytes().count(b"\nSTATE ")

    while b"READY" not in said.read_bytes():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    trashed = 0
    r = 0
    try:
        while r < ROUNDS or (reads() < MIN_READS and r < 5 * ROUNDS):  # (until the reader has read enough)
            store = await PersistentContextManager.open(storage_path=storage, session_id=SID,
                                                        segment_bytes=segment_bytes, fsync="never",
                                                        compress_sealed=r % 2 == 1)
            for i in range(25):
                await store.add_message({"role": "user", "content": f"round {r} message {i} " + "x" * 300})
                states.add(_digest(await store.get_messages()))
            await store.pin(2)
            history = await store.get_messages()
            await store.erase(len(history) - 20)  # in a sealed segment (segmented)
            states.add(_digest(await store.get_messages()))
            await store.erase(len(history) - 2)  # in the active segment
            states.add(_digest(await store.get_messages()))
            if r > 1 and segment_bytes:
                await store.erase(1)  # carried by the expired record (pinned in an earlier round)
                states.add(_digest(await store.get_messages()))
            seq = _in_trash(storage)
            if seq is not None:
                await store.erase(seq=seq)  # expired: in the trash (and carried, if it was pinned)
                states.add(_digest(await store.get_messages()))
                trashed += 1
            await store.close()
            await trash.apply_file(storage, RetentionPolicy(max_segments=1))  # (a single-file log: nothing)
            reader = await PersistentContextManager.open(storage_path=storage, session_id=SID, readonly=True)
            states.add(_digest(await reader.get_messages()))
            await reader.close()
            r += 1
    finally:
        stop.touch()
        _, err = proc.communicate(timeout=120)
    assert trashed >= (ROUNDS - 2 if segment_bytes else 0)
    lines = said.read_bytes().decode().splitlines()
    assert lines and lines[-1].startswith("DONE"), (lines[-5:], err.decode()[-3000:])
    done = int(lines[-1].split()[1])
    errors = [line for line in lines if line.startswith("ERROR") or (line.startswith("VERIFY") and line != "VERIFY ok")]
    assert errors == [], f"{len(errors)} of {done} reads failed: " + "\n".join(e[:400] for e in errors)
    seen = [line.split()[1] for line in lines if line.startswith("STATE")]
    assert len(seen) == done >= MIN_READS
    assert [s for s in seen if s not in states] == []
