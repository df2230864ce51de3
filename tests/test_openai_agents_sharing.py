"""openai-agents sessions as its docs use them: an object per request, never closed, and several processes on one
session with ``lock="call"`` (issue #28, item 15; integrations/shared_stores.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from context_persistent import PersistentContextManager, SessionLockedError
from context_persistent.integrations import shared_stores
from context_persistent.integrations.openai_agents import PersistentSession


def _wait_closed(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while shared_stores.open_count() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert shared_stores.open_count() == 0, "a shared store stayed open after its last object went away"


async def test_a_new_object_per_request_never_closed_works(storage: Path) -> None:
    """Objects made per request and dropped without close() each see the whole session; none gets
    SessionLockedError, and the store closes once the last one is collected."""
    for i in range(5):
        session = PersistentSession("req", storage)  # (as openai-agents' docs do, per request)
        assert len(await session.get_items()) == 2 * i
        await session.add_items([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}])
        if i % 2:
            del session  # (collected at once: its share is given back)
    del session
    _wait_closed()
    store = await PersistentContextManager.open(storage_path=storage, session_id="req")  # the lock is free again
    assert [m["content"] for m in await store.get_messages()][-2:] == ["q4", "a4"]
    await store.close()


async def test_objects_alive_together_share_one_store(storage: Path) -> None:
    """Two objects on one session at once share its store: each sees the other's items at once, and closing
    one leaves the other usable."""
    first, second = PersistentSession("both", storage), PersistentSession("both", str(storage))
    await first.add_items([{"role": "user", "content": "one"}])
    await second.add_items([{"role": "user", "content": "two"}])
    assert await first.get_items() == await second.get_items() == [{"role": "user", "content": "one"},
                                                                    {"role": "user", "content": "two"}]
    assert shared_stores.open_count() == 1
    await first.aclose()
    assert len(await second.get_items()) == 2
    await second.aclose()
    _wait_closed()


def test_other_settings_on_an_open_session_are_refused(storage: Path) -> None:
    """A second object on an open session with other store settings is a ValueError naming them (one store
    cannot have two); bad lock arguments are refused."""
    first = PersistentSession("cfg", storage, fsync="batch")
    with pytest.raises(ValueError, match="already open in this process with other settings"):
        PersistentSession("cfg", storage, fsync="always")
    with pytest.raises(ValueError, match="already open in this process with other settings"):
        PersistentSession("cfg", storage, fsync="batch", lock="call")
    first.close()
    PersistentSession("cfg", storage, fsync="always").close()  # (once closed, any settings)
    with pytest.raises(ValueError, match="lock must be one of 'open', 'call'"):
        PersistentSession("cfg", storage, lock="process")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lock_wait must be a number of seconds"):
        PersistentSession("cfg", storage, lock_wait=-1)


async def test_lock_per_call_waits_a_bounded_time(storage: Path) -> None:
    """With ``lock="call"`` a write waits while another writer holds the session, then stores; past
    ``lock_wait`` it raises SessionLockedError saying how long it waited, storing nothing."""
    holder = await PersistentContextManager.open(storage_path=storage, session_id="held")
    await holder.add_message({"role": "user", "content": "first"})
    session = PersistentSession("held", storage, lock="call", lock_wait=0.2)
    assert await session.get_items() == [{"role": "user", "content": "first"}]  # (reads take no lock)
    with pytest.raises(SessionLockedError, match="still held after waiting 0.2 s"):
        await session.add_items([{"role": "user", "content": "refused"}])
    await holder.close()
    await session.add_items([{"role": "user", "content": "second"}])
    assert [i["content"] for i in await session.get_items()] == ["first", "second"]
    session.close()


_WRITER = """
import asyncio, sys
from context_persistent.integrations.openai_agents import PersistentSession

async def main(storage, name, n):
    session = PersistentSession("shared", storage, lock="call", lock_wait=60)
    for k in range(n):
        await session.add_items([{"role": "user", "content": f"{name} {k}"},
                                 {"role": "assistant", "content": f"{name} {k} done"}])
        items = await session.get_items()
        assert items[-1]["content"].startswith(("w0", "w1", "w2")), items[-1]
    print("DONE", name, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


@pytest.mark.slow
def test_three_processes_share_one_session(storage: Path, subprocess_env: dict[str, str]) -> None:
    """Three processes append to one session at once with ``lock="call"``: every item is stored exactly once,
    each call's two items stay together, and each writer's items are in the order it wrote them."""
    n = 12
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(storage), f"w{i}", str(n)], env=subprocess_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        assert out.startswith("DONE")
    lines = (storage / "shared" / "events.jsonl").read_bytes().splitlines()
    added = [r["data"]["message"]["content"] for r in map(orjson.loads, lines) if r["type"] == "message_added"]
    assert sorted(added) == sorted(f"w{i} {k}{s}" for i in range(3) for k in range(n) for s in ("", " done"))
    for i in range(3):
        own = [c for c in added if c.startswith(f"w{i} ")]
        assert own == [f"w{i} {k}{s}" for k in range(n) for s in ("", " done")]
    for a, b in zip(added[::2], added[1::2]):
        assert b == a + " done"  # (a call's items are one write under the lock: never interleaved)


_NEVER_CLOSED = """
import asyncio, sys
from context_persistent.integrations.openai_agents import PersistentSession

async def main(storage):
    session = PersistentSession("exit", storage, fsync="batch")
    await session.add_items([{"role": "user", "content": str(k)} for k in range(300)])
    print("ADDED", flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_store_left_open_is_closed_at_exit(storage: Path, subprocess_env: dict[str, str]) -> None:
    """A process that never closes its session still closes the store at exit: the lock file is released
    (emptied) and the closing checkpoint is written."""
    proc = subprocess.run([sys.executable, "-c", _NEVER_CLOSED, str(storage)], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (storage / "exit" / "lock").read_bytes() == b""  # (a close empties it; a dead holder leaves its pid)
    assert (storage / "exit" / "checkpoint.json").exists()

