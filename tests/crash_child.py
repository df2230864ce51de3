"""Helper processes for the crash and locking tests (run as a script, never imported by pytest).

``python tests/crash_child.py zygote WARM_DIR``: imports the package once and warms it up (a session in
WARM_DIR written and closed: every module a writer uses is imported), then for each JSON command line on
stdin forks a writer child (so a kill loop pays neither Python's start-up nor those imports per kill) and
reports on stdout:

    PID <pid>        the writer child started (the test SIGKILLs this pid)
    OPEN <head_seq>  it opened the session
    ACK <i>          add_message of message number i returned (it is acknowledged)
    EXIT <pid> <status>  the child is gone (the zygote reaped it: its lock is free)

A command: {"storage", "session", "start" (number of the first message), "fsync", "checkpoint_every",
"concurrency" (1: one add_message at a time; >1: that many in flight, batch mode), "big_every" (every n-th
message carries a large payload, so a kill can tear a write), "count" (messages to write, then idle)}.

``python tests/crash_child.py hold STORAGE SESSION``: open the session, print READY, sleep until killed.
``python tests/crash_child.py append STORAGE SESSION``: open and append messages forever (for readers).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from context_persistent import PersistentContextManager
def message(i: int, big: bool = False) -> dict[str, str]:
    return {"role": "user", "content": f"m{i}:" + ("x" * 100_000 if big else "y" * (i % 97))}


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())  # unbuffered: nothing is lost or duplicated by a kill or a fork


async def _writer(cmd: dict) -> None:
    store = await PersistentContextManager.open(storage_path=cmd["storage"], session_id=cmd["session"],
                                                fsync=cmd["fsync"], checkpoint_every=cmd["checkpoint_every"])
    _say(f"OPEN {store.head_seq}")
    start, count, big_every = cmd["start"], cmd["count"], cmd["big_every"]
    concurrency = cmd["concurrency"]

    async def add(i: int) -> None:
        await store.add_message(message(i, big_every > 0 and i % big_every == big_every - 1))
        _say(f"ACK {i}")

    if concurrency <= 1:
        for i in range(start, start + count):
            await add(i)
            await asyncio.sleep(0)  # let background work (checkpoint writes) run, as an agent's awaits do
    else:
        inflight: set[asyncio.Task[None]] = set()
        for i in range(start, start + count):
            if len(inflight) >= concurrency:
                _, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            inflight.add(asyncio.ensure_future(add(i)))  # tasks start in creation order: log order = i
        await asyncio.gather(*inflight)
    _say("IDLE")
    await asyncio.sleep(3600)


async def _warm_up(folder: str) -> None:
    store = await PersistentContextManager.open(storage_path=folder, session_id="warm-up", fsync="always",
                                                checkpoint_every=1)
    for i in range(3):
        await store.add_message(message(i, big=i == 2))
    await store.close()


def zygote(warm_dir: str) -> None:
    asyncio.run(_warm_up(warm_dir))
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _say(f"PID {os.getpid()}")
                asyncio.run(_writer(cmd))
            except BaseException as e:  # report, so the test fails with the cause instead of hanging
                _say(f"ERR {type(e).__name__}: {e}".replace("\n", " "))
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        _say(f"EXIT {pid} {status}")


async def _hold(storage: str, session: str) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session)
    await store.add_message(message(0))
    print("READY", flush=True)
    await asyncio.sleep(3600)


async def _append(storage: str, session: str) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session)
    print("READY", flush=True)
    i = 0
    while True:
        await store.add_message(message(i, big=i % 5 == 4))
        i += 1
        if i % 50 == 0:
            time.sleep(0.001)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "zygote":
        zygote(sys.argv[2])
    elif mode == "hold":
        asyncio.run(_hold(sys.argv[2], sys.argv[3]))
    elif mode == "append":
        asyncio.run(_append(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
