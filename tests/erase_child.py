"""Helper process for the erase crash test (run as a script, never imported by pytest).

``python tests/erase_child.py STORAGE SESSION SEQ``: open the session (taking the writer lock), print READY,
erase the message of record SEQ, print ERASED <seconds>, then append messages printing ACK <i> after each
returns, then IDLE. The test SIGKILLs it at a chosen moment.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from context_persistent import PersistentContextManager
def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


async def main(storage: str, session: str, seq: int) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session)
    _say("READY")
    t = time.perf_counter()
    await store.erase(seq=seq, reason="crash test")
    _say(f"ERASED {time.perf_counter() - t:.6f}")
    for i in range(20):
        await store.add_message({"role": "user", "content": f"after {i}"})
        _say(f"ACK {i}")
    _say("IDLE")
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
