"""Helper process for the readers-during-rewrites test (run as a script, never imported by pytest).

``python tests/rewrite_reader_child.py STORAGE SESSION STOP``: until the file STOP exists, read the session
the ways the read-only commands do, in a loop, and print one line per read: ``STATE <sha256 of the messages>``
(a read-only open's history, as ``show`` reads it), ``LINES <n>`` (every record decoded across the segments,
as ``export``/``tail`` read them), ``VERIFY ok`` or ``VERIFY <problems>``; ``ERROR <type>: <message>`` for
any exception. Prints ``DONE <reads>`` at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import traceback
from pathlib import Path

import orjson

from context_persistent import PersistentContextManager, codec
from context_persistent.repair import verify
from context_persistent.segments import LogReader


def _say(text: str) -> None:
    os.write(1, (text.replace("\n", " | ") + "\n").encode())


async def main(storage: str, session: str, stop: str) -> None:
    folder = Path(storage) / session
    n = 0
    while not os.path.exists(stop):
        n += 1
        try:
            store = await PersistentContextManager.open(storage_path=storage, session_id=session, readonly=True)
            try:
                messages = await store.get_messages()
            finally:
                await store.close()
            _say("STATE " + hashlib.sha256(orjson.dumps(messages)).hexdigest())
            with LogReader(folder, session) as reader:
                seqs = [codec.decode(line)["seq"] for _, line in reader.lines(reader.start)]
            if seqs != sorted(set(seqs)):
                _say(f"ERROR seqs out of order: {seqs}")
            _say(f"LINES {len(seqs)}")
            report = verify(folder, session)
            if report.ok:
                _say("VERIFY ok")
            else:
                _say("VERIFY " + orjson.dumps(report.to_dict(), default=str).decode())
        except Exception as e:  # noqa: BLE001 (every failure is reported to the test)
            _say(f"ERROR {type(e).__name__}: {e} {traceback.format_exc()}")
    _say(f"DONE {n}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
