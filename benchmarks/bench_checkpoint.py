"""Periodic checkpoints of a large session: how long they hold the event loop.

A store writes a checkpoint every ``checkpoint_every`` events. The loop-held part is capturing the state
(copies of the lists) and the front section; serialising runs in steps between which the loop serves other
tasks, and framing and writing run in a worker thread. Measured in a fresh interpreter per round: a ticker task
wakes every millisecond while ``checkpoint_every`` messages are added (``fsync="never"``, so the figure is
the checkpoint, not the disk); the longest gap between its wake-ups is the longest stall any other task of
the agent saw. Reference: one ``orjson.dumps`` of the same state, which is what the loop was held for before
(the floor of serialising it in one piece).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

from ._harness import Ctx, Row, compare, info, run_child
from .workloads import sized_messages, write_session

GROUP = "checkpoint"

CHILD = """
import asyncio, json, os, sys, time
import orjson
from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import snapshot
storage, sid, materialise = sys.argv[1], sys.argv[2], sys.argv[3] == "full"

async def main():
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid, fsync="never")
    try:
        if materialise:
            await store.get_messages()  # the whole history in memory, as after an Amplifier turn
        gaps, lat = [], []
        async def ticker():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        msg = {"role": "user", "content": "x" * 280}
        cps = store._checkpoints
        before = cps.seq
        started = None
        for _ in range(cps.every + 10):
            t = time.perf_counter()
            await store.add_message(msg)
            lat.append(time.perf_counter() - t)
            if started is None and cps._task is not None:
                started = t
            await asyncio.sleep(0)
        while cps._task is not None:
            await asyncio.sleep(0.001)
        write = time.perf_counter() - started
        tick.cancel()
        assert cps.seq > before, "no checkpoint was written"
        state = store._state
        t = time.perf_counter()
        snapshot(state)
        one_dump = time.perf_counter() - t
        size = os.path.getsize(os.path.join(storage, sid, "checkpoint.json"))
        return {"max_gap": max(gaps), "max_add": max(lat), "one_dump": one_dump, "n": len(state.messages),
                "write": write, "bytes": size, "mean_add": sum(lat) / len(lat)}
    finally:
        await store.close()

print(json.dumps(asyncio.run(main())))
"""


def _build(ctx: Ctx, n: int) -> Path:
    storage = ctx.tempdir(f"checkpoint-{n}") / "store"
    write_session(storage, "s", sized_messages(n, 300))
    # The first open replays the log and its close writes the checkpoint every round then opens from.
    run_child("""
import asyncio, json, sys
from context_persistent import PersistentContextManager
async def main():
    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id="s", fsync="never")
    await store.close()
asyncio.run(main())
print(json.dumps({}))
""", str(storage))
    return storage


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"checkpoint_n": 100_000}, full={"checkpoint_n": 1_000_000})
    n = ctx.size("checkpoint_n")
    if n <= 0:
        return []
    storage = _build(ctx, n)
    full, lazy = [], []
    for r in range(ctx.rounds):
        ctx.log(f"checkpoint {n:,} x 300 B round {r + 1}/{ctx.rounds}")
        full.append(run_child(CHILD, str(storage), "s", "full"))
    lazy.append(run_child(CHILD, str(storage), "s", "lazy"))
    rows = [
        compare(GROUP, f"longest event-loop stall, periodic checkpoint, {n:,} x 300 B in memory",
                [x["max_gap"] * 1000 for x in full], [x["one_dump"] * 1000 for x in full], unit="ms",
                ref_name="one orjson.dumps of the state (the stall before the stepwise write)"),
        compare(GROUP, f"longest add_message during it, {n:,} x 300 B",
                [x["max_add"] * 1000 for x in full], [x["one_dump"] * 1000 for x in full], unit="ms",
                ref_name="one orjson.dumps of the state (the stall before the stepwise write)"),
        info(GROUP, f"longest stall, first checkpoint after a lazy open ({n:,}, history still on disk)",
             lazy[0]["max_gap"] * 1000, "ms"),
        compare(GROUP, f"periodic checkpoint written (in the background), {n:,} x 300 B in memory",
                [x["write"] * 1000 for x in full], [x["one_dump"] * 1000 for x in full], unit="ms",
                ref_name="one orjson.dumps of the state", note="from its start to its file renamed in place"),
        info(GROUP, f"periodic checkpoint's size, {n:,} x 300 B in memory", full[0]["bytes"] / 1e6, "MB"),
        info(GROUP, f"mean add_message while checkpoints are written, {n:,} x 300 B",
             median([x["mean_add"] * 1000 for x in full]), "ms"),
    ]
    return rows
