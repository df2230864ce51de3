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
from pathlib import Path
from typing import Any

import orjson

from conftest import PYTHON
from context_persistent import PersistentContextManager, erasure, trash
from context_persistent.retention import RetentionPolicy

CHILD = Path(__file__).with_name("rewrite_reader_child.py")
SID = "busy"
ROUNDS = 8


def _in_trash(storage: Path) -> int | None:
    """The seq of a message_added record in an expired segment in the trash."""
    for path in erasure.trash_files(storage, SID):
        for rec, *_ in erasure._scan_trash_file(path):
            if rec["type"] == "message_added":
                return int(rec["seq"])
    return None


def _digest(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(orjson.dumps(messages)).hexdigest()


async def test_readers_see_whole_states_while_erase_and_expiry_rewrite(storage: Path, tmp_path: Path,
                                                                      subprocess_env: dict[str, str]) -> None:
    states: set[str] = {_digest([])}
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                fsync="never")
    await store.add_message({"role": "system", "content": "be brief"})
    states.add(_digest(await store.get_messages()))
    await store.close()
    stop = tmp_path / "stop"
    proc = subprocess.Popen([PYTHON, str(CHILD), str(storage), SID, str(stop)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=subprocess_env)
    trashed = 0
    try:
        for r in range(ROUNDS):
            store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                        fsync="never", compress_sealed=r % 2 == 1)
            for i in range(25):
                await store.add_message({"role": "user", "content": f"round {r} message {i} " + "x" * 300})
                states.add(_digest(await store.get_messages()))
            await store.pin(2)
            history = await store.get_messages()
            await store.erase(len(history) - 20)  # in a sealed segment
            states.add(_digest(await store.get_messages()))
            await store.erase(len(history) - 2)  # in the active segment
            states.add(_digest(await store.get_messages()))
            if r > 1:
                await store.erase(1)  # carried by the expired record (pinned in an earlier round)
                states.add(_digest(await store.get_messages()))
            seq = _in_trash(storage)
            if seq is not None:
                await store.erase(seq=seq)  # expired: in the trash (and carried, if it was pinned)
                states.add(_digest(await store.get_messages()))
                trashed += 1
            await store.close()
            await trash.apply_file(storage, RetentionPolicy(max_segments=1))
            reader = await PersistentContextManager.open(storage_path=storage, session_id=SID, readonly=True)
            states.add(_digest(await reader.get_messages()))
            await reader.close()
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=120)
    assert trashed >= ROUNDS - 2
    lines = out.decode().splitlines()
    assert lines and lines[-1].startswith("DONE"), (lines[-5:], err.decode()[-3000:])
    reads = int(lines[-1].split()[1])
    errors = [line for line in lines if line.startswith("ERROR") or (line.startswith("VERIFY") and line != "VERIFY ok")]
    assert errors == [], f"{len(errors)} of {reads} reads failed: " + "\n".join(e[:400] for e in errors)
    seen = [line.split()[1] for line in lines if line.startswith("STATE")]
    assert len(seen) == reads and reads >= 10
    assert [s for s in seen if s not in states] == []
