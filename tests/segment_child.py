"""Helper process for the segment crash tests (run as a script, never imported by pytest).

``python tests/segment_child.py STORAGE SESSION MODE``; with ``CONTEXT_PERSISTENT_CRASH_AT=<step>`` in its
environment the process SIGKILLs itself at that step (segment_store.STEPS). Modes:

- ``roll`` / ``compress``: open with ``segment_bytes=4096`` (``compress``: and ``compress_sealed``), print READY,
  then append messages ``m0``, ``m1``, ... printing ``ACK <i>`` after each append returns;
- ``erase``: open, print READY, erase the message of record seq 2, print ERASED, then append as above;
- ``migrate``: migrate the session's single-file log (4096-byte segments, compressed), print MIGRATED.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from context_persistent import PersistentContextManager
from context_persistent.storage.segment_store import migrate


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


async def main(storage: str, session: str, mode: str) -> None:
    if mode == "migrate":
        migrate(Path(storage) / session, session, 4096, True)
        _say("MIGRATED")
        return
    store = await PersistentContextManager.open(storage_path=storage, session_id=session, segment_bytes=4096,
                                                compress_sealed=mode == "compress")
    _say("READY")
    if mode == "erase":
        await store.erase(seq=2, reason="crash test")
        _say("ERASED")
    for i in range(400):
        await store.add_message({"role": "user", "content": f"m{i} " + "p" * 150})
        _say(f"ACK {i}")
    _say("IDLE")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
