"""How long the event loop stalls while one large message is tokenised.

Workload: one message of ``loop_mb`` MB of text without spaces (a run of letters, the worst case for
tiktoken's pre-tokeniser), added to a store; a heartbeat task records the longest gap between its ticks.
Ours: ``get_token_count()`` (the count runs in a worker thread, in pieces). Reference: the same count made
on the loop's thread with one ``encode_ordinary`` of the whole text (what a count on the loop costs).
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
from context_persistent.model.tokens import DEFAULT_ENCODING

from ._harness import Ctx, Row, compare, info, median

GROUP = "loop"


async def _stall(work: Any) -> tuple[float, float]:
    """(longest gap between heartbeat ticks, seconds the work took) while ``work()`` runs."""
    gaps = [0.0]
    stop = False

    async def beat() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    task = asyncio.create_task(beat())
    await asyncio.sleep(0.01)
    t = time.perf_counter()
    await work()
    took = time.perf_counter() - t
    stop = True
    await task
    return gaps[0], took


async def _round(storage: Path, text: str) -> tuple[float, float, float, float]:
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                tokenizer=DEFAULT_ENCODING)
    try:
        encode = store._counter._encode if store._counter.exact else None
        assert encode is not None
        await store.add_message({"role": "user", "content": text})
        ours_gap, ours_s = await _stall(store.get_token_count)

        async def on_loop() -> None:
            encode(text)

        ref_gap, ref_s = await _stall(on_loop)
        return ours_gap, ref_gap, ours_s, ref_s
    finally:
        await store.close()


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"loop_mb": 2}, full={"loop_mb": 8})
    mb = ctx.size("loop_mb")
    text = "".join(random.Random(1).choices(string.ascii_letters, k=mb << 20))
    folder = ctx.tempdir("loop")
    ours, ref, ours_t, ref_t = [], [], [], []
    for r in range(ctx.rounds):
        ctx.log(f"loop stall, one {mb} MB message without spaces, round {r + 1}/{ctx.rounds}")
        g, rg, t, rt = asyncio.run(_round(folder / f"store-{r}", text))
        ours.append(g)
        ref.append(rg)
        ours_t.append(t)
        ref_t.append(rt)
    return [
        compare(GROUP, f"longest loop stall while counting one {mb} MB message without spaces", ours, ref,
                unit="s", ref_name="the same count on the loop's thread (encode_ordinary of the whole text)",
                target="<= 0.05"),
        info(GROUP, f"time to count it (ours: worker thread, in pieces; whole on the loop: {median(ref_t):.2f} s)",
             median(ours_t), "s", samples=ours_t),
    ]
