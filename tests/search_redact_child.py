"""Processes for tests/test_search_processes_pg.py, on a PostgreSQL schema (DSN and SCHEMA) or, with DSN ``-``,
on the file storage TMP.

``write DSN SCHEMA TMP SID N`` (TMP: the storage, or on PostgreSQL a folder for the store's local files): appends N messages with unique
words (``note {sid}w{i}x``), replacing the history with its last three messages every seventh; after every
fifth it adds a secret (``{sid}r{i}z``) and redacts it, after every ninth one (``{sid}e{i}z``) and erases it.
Each line it prints follows the acknowledgement: ``A word``, ``P secret T`` (added: searchable from T), ``R
secret T`` (redacted), ``E secret T`` (erased), T the monotonic clock when the call returned; a secret stays
0.1 s before it is removed.

``search DSN SCHEMA TMP STOPFILE``: searches for the secrets (``secret``, every message, caught up first as any
reader) until STOPFILE exists, printing ``S T word...`` for each search: T the monotonic clock when it began,
then the secret words of its hits.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

from context_persistent import PersistentContextManager, search


async def write(dsn: str, schema: str, tmp: str, sid: str, n: int) -> None:
    where = {} if dsn == "-" else {"backend": "postgres", "dsn": dsn, "pg_schema": schema}
    async with await PersistentContextManager.open(storage_path=tmp, session_id=sid, **where) as store:
        for i in range(n):
            word = f"{sid}w{i}x"
            await store.add_message({"role": "user" if i % 2 else "assistant", "content": f"note {word} " + "y " * 50})
            print("A", word, flush=True)
            if i % 7 == 6:
                await store.replace_messages((await store.get_messages())[-3:])
            for every, kind in ((5, "r"), (9, "e")):
                if i % every == every - 1:
                    secret = f"{sid}{kind}{i}z"
                    await store.add_message({"role": "user", "content": f"secret {secret} " + "y " * 20})
                    print("P", secret, time.monotonic(), flush=True)
                    await asyncio.sleep(0.1)  # (long enough for searches to find it before it goes)
                    last = len(await store.get_messages()) - 1
                    if kind == "r":
                        await store.redact(last)
                    else:
                        await store.erase(last, reason="test")
                    print(kind.upper(), secret, time.monotonic(), flush=True)


async def searcher(dsn: str, schema: str, tmp: str, stop: str) -> None:
    where: dict[str, str] = {} if dsn == "-" else {"dsn": dsn, "pg_schema": schema}
    while not os.path.exists(stop):
        began = time.monotonic()
        hits = await search(None if where else tmp, "secret", all_messages=True, limit=1000, **where)
        print("S", began, *sorted({w for h in hits for w in re.findall(r"\w+[re]\d+z", h.snippet)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        asyncio.run(write(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])))
    else:
        asyncio.run(searcher(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]))
