"""A worker process for the PostgreSQL multi-process tests (stands in for an agent worker on another machine).

    python postgres_worker.py race DSN SCHEMA SID N GO_FILE RELEASE_FILE
        wait for GO_FILE, open the session and add N messages (print ACK i after each), print HOLDING,
        keep the session until RELEASE_FILE exists; or print LOCKED <message> and exit 3.
    python postgres_worker.py write DSN SCHEMA SID TAG
        open the session and add messages forever, printing ACK i after each returns (killed by the test).
"""

from __future__ import annotations

import asyncio
import os
import sys

from context_persistent import PersistentContextManager, SessionLockedError
async def _open(dsn: str, schema: str, sid: str) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=os.environ["CONTEXT_PERSISTENT_DIR"], session_id=sid, backend="postgres",
                                               dsn=dsn, pg_schema=schema, recognise_replay=False)


async def race(dsn: str, schema: str, sid: str, n: int, go: str, release: str) -> int:
    while not os.path.exists(go):
        await asyncio.sleep(0.001)
    try:
        store = await _open(dsn, schema, sid)
    except SessionLockedError as e:
        print(f"LOCKED {e}", flush=True)
        return 3
    async with store:
        for i in range(n):
            await store.add_message({"role": "user", "content": f"pid{os.getpid()}-{i}"})
            print(f"ACK {i}", flush=True)
        print("HOLDING", flush=True)
        while not os.path.exists(release):
            await asyncio.sleep(0.01)
    return 0


async def write(dsn: str, schema: str, sid: str, tag: str) -> int:
    store = await _open(dsn, schema, sid)
    print("OPEN", flush=True)
    i = 0
    while True:
        await store.add_message({"role": "user", "content": f"{tag}-{i}"})
        print(f"ACK {i}", flush=True)
        i += 1


def main(argv: list[str]) -> int:
    mode, dsn, schema, sid, *rest = argv
    if mode == "race":
        return asyncio.run(race(dsn, schema, sid, int(rest[0]), rest[1], rest[2]))
    return asyncio.run(write(dsn, schema, sid, rest[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
