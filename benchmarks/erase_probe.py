"""The cost of erasing one message from a long session, with and without the search index (docs/search.md,
"Erasure"; not part of ``make bench``).

    python -m benchmarks.erase_probe build DIR --messages N
    python -m benchmarks.erase_probe erase DIR [--seq S] [--no-index]

``build`` writes a storage with one session ``s`` of N messages (user, assistant and tool messages of 200 to
1,500 bytes) and its search index, current. ``erase`` copies that storage to a temporary folder (the build
is kept for the next run), opens the session, erases the message of record S (default: the middle one) and
prints the erase's CPU time (this process: user + system, the index's thread included) and wall time, and the
receipt's index entry. ``--no-index`` removes the copy's search index first: what the erase costs without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def build(root: Path, n: int) -> None:
    from context_persistent import PersistentContextManager

    root.mkdir(parents=True, exist_ok=True)
    store = await PersistentContextManager.open(storage_path=root, session_id="s", fsync="never")
    try:
        for i in range(n):
            role = ("user", "assistant", "tool")[i % 3]
            words = " ".join(f"word{(i * 7 + j) % 5000}" for j in range(20 + i % 150))
            m = {"role": role, "content": f"message {i} {words}"}
            if role == "tool":
                m.update(tool_call_id=f"c{i}", name="bash")
            await store.add_message(m)
    finally:
        await store.close()
    from context_persistent.operations.search.indexer import catch_up_storage
    from context_persistent.operations.search.sqlite_index import SqliteIndex

    index = SqliteIndex(root)
    try:
        await catch_up_storage(index)
    finally:
        index.close()


async def erase(root: Path, seq: int | None, no_index: bool) -> dict[str, object]:
    from context_persistent import PersistentContextManager

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "storage"
        shutil.copytree(root, copy)
        if no_index:
            shutil.rmtree(copy / ".search")
        store = await PersistentContextManager.open(storage_path=copy, session_id="s")
        try:
            target = seq if seq is not None else max(2, store.head_seq // 2)
            cpu, wall = _cpu(), time.perf_counter()
            receipt = await store.erase(seq=target, reason="probe")
            cpu, wall = _cpu() - cpu, time.perf_counter() - wall
        finally:
            await store.close()
    return {"seq": target, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "index": receipt["index"]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.erase_probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--messages", type=int, required=True)
    e = sub.add_parser("erase")
    e.add_argument("dir", type=Path)
    e.add_argument("--seq", type=int)
    e.add_argument("--no-index", action="store_true")
    a = p.parse_args()
    if a.cmd == "build":
        asyncio.run(build(a.dir, a.messages))
    else:
        print(json.dumps(asyncio.run(erase(a.dir, a.seq, a.no_index))))


if __name__ == "__main__":
    main()
