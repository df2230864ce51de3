"""Helper process for the readers-during-rewrites test (run as a script, never imported by pytest).

``python tests/rewrite_reader_child.py STORAGE SESSION STOP``: until the file STOP exists, read the session
the ways the read-only commands do, in a loop, and print one line per read: ``STATE <sha256 of the messages>``
(a read-only open's history, as ``show`` reads it; ``export`` then writes it to a snapshot, checked against
it), ``LINES <n>`` (every record decoded: the log's records as ``tail`` reads them, and across the segments
with a LogReader), ``VERIFY ok`` or ``VERIFY <problems>``; ``ERROR <type>: <message>`` for any exception.
Prints ``READY`` first and ``DONE <reads>`` at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import traceback
from pathlib import Path

import orjson

from context_persistent import PersistentContextManager

from context_persistent.model import codec
from context_persistent.storage.backends import open_log
from context_persistent.operations.repair import verify
from context_persistent.storage.segments import LogReader


def _say(text: str) -> None:
    os.write(1, (text.replace("\n", " | ") + "\n").encode())


async def main(storage: str, session: str, stop: str) -> None:
    folder = Path(storage) / session
    snapshot = Path(stop).with_name("snapshot.jsonl")
    n = 0
    _say("READY")
    while not os.path.exists(stop):
        n += 1
        try:
            store = await PersistentContextManager.open(storage_path=storage, session_id=session, readonly=True)
            try:
                messages = await store.get_messages()
                await store.export(snapshot)
            finally:
                await store.close()
            _say("STATE " + hashlib.sha256(orjson.dumps(messages)).hexdigest())
            exported = [orjson.loads(line) for line in snapshot.read_bytes().splitlines()[1:]]
            if exported != messages:
                _say(f"ERROR the export holds {len(exported)} messages, not the {len(messages)} the open read")
            log = await open_log(storage, session, {}, readonly=True)
            try:
                tailed = [rec["seq"] async for batch in log.read_batches() for rec in batch]
            finally:
                await log.close()
            with LogReader(folder, session) as reader:
                read = [line for _, line in reader.lines(reader.start)]
            if read and not read[-1].endswith(b"\n"):
                read.pop()  # (an append the writer has not finished: a reader of raw lines may see part of it)
            seqs = [codec.decode(line)["seq"] for line in read]
            if any(list(x) != sorted(set(x)) or not x for x in (tailed, seqs)):  # (two reads: an expiry may come between)
                _say(f"ERROR seqs out of order: {tailed} {seqs}")
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
