"""Preparing each LLM request: ``get_messages_for_request`` as the session grows.

Calls the public ``get_messages_for_request`` (default budget), so it measures whatever request view is
wired at the time (compaction included). Baseline: the reference module, which re-reads and re-parses
its whole ``context-messages.jsonl`` on every request (see :mod:`benchmarks.peers`). Ours runs with
``fsync="never"`` so the "after one new message" figure is the request alone, not the append.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
from ._harness import Ctx, Row, compare, median
from .peers import ReferenceReRead
from .workloads import sized_message, sized_messages, write_reference, write_session

GROUP = "request"


async def _ours(storage: Path, calls: int, new_msg: dict[str, Any]) -> tuple[float, float]:
    """(median seconds of an unchanged request, median seconds of a request after one new message)."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never")
    try:
        await store.get_messages_for_request()  # first request: counts tokens once
        pc = time.perf_counter
        unchanged, after = [], []
        for _ in range(calls):
            t = pc()
            await store.get_messages_for_request()
            unchanged.append(pc() - t)
        for _ in range(calls):
            await store.add_message(new_msg)
            t = pc()
            await store.get_messages_for_request()
            after.append(pc() - t)
        return median(unchanged), median(after)
    finally:
        await store.close()


def _reference(path: Path, calls: int, new_msg: dict[str, Any]) -> tuple[float, float]:
    ref = ReferenceReRead(path)
    pc = time.perf_counter
    unchanged, after = [], []
    for _ in range(calls):
        t = pc()
        ref.get_messages_for_request()
        unchanged.append(pc() - t)
    for _ in range(calls):
        ref.add_message(new_msg)
        t = pc()
        ref.get_messages_for_request()
        after.append(pc() - t)
    return median(unchanged), median(after)


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"request_small": 1000, "request_large": 10_000, "request_large_4k": 0, "request_huge": 0,
                        "request_calls": 5},
                 full={"request_small": 1000, "request_large": 10_000, "request_large_4k": 10_000,
                       "request_huge": 100_000, "request_calls": 15})
    calls = ctx.size("request_calls")
    cases = [(ctx.size("request_small"), 300), (ctx.size("request_large"), 300)]
    if ctx.size("request_large_4k"):
        cases.append((ctx.size("request_large_4k"), 4096))
    if ctx.size("request_huge"):
        cases.append((ctx.size("request_huge"), 300))
    new_msg = sized_message(300, seed=99)
    results: dict[tuple[int, int], dict[str, list[float]]] = {}
    rows: list[Row] = []
    for n, size in cases:
        folder = ctx.tempdir(f"request-{n}-{size}")
        msgs = sized_messages(n, size)
        got: dict[str, list[float]] = {"unchanged": [], "after": [], "ref_unchanged": [], "ref_after": []}
        for r in range(ctx.rounds):
            ctx.log(f"request {n:,} x {size} B round {r + 1}/{ctx.rounds}")
            storage = folder / f"store-{r}"
            write_session(storage, "s", msgs)
            ref_path = write_reference(folder / f"ref-{r}.jsonl", msgs)
            k = max(3, calls // 5) if n >= 100_000 else calls  # each call is O(n) for the reference
            u, a = asyncio.run(_ours(storage, k, new_msg))
            ru, ra = _reference(ref_path, k, new_msg)
            for k, v in (("unchanged", u), ("after", a), ("ref_unchanged", ru), ("ref_after", ra)):
                got[k].append(v * 1000)
        results[(n, size)] = got
        label = f"{n:,} x {size} B"
        target = ">= 100" if (n, size) == (ctx.size("request_large"), 300) else None
        rows += [
            compare(GROUP, f"unchanged {label}: reference / ours", got["unchanged"], got["ref_unchanged"], unit="ms",
                    invert=True, target=target, ref_name="reference: re-read + re-parse per request"),
            compare(GROUP, f"after one new message {label}: reference / ours", got["after"], got["ref_after"],
                    unit="ms", invert=True, ref_name="reference: re-read + re-parse per request"),
        ]
    small = results[(ctx.size("request_small"), 300)]["after"]
    for n in (ctx.size("request_large"), ctx.size("request_huge")):
        if n and (n, 300) in results:
            rows.append(compare(GROUP, f"after one new message: {n:,} / {ctx.size('request_small'):,} messages",
                                results[(n, 300)]["after"], small, unit="ms",
                                ref_name=f"ours on {ctx.size('request_small'):,} messages",
                                target="<= 2" if n == ctx.size("request_large") else None,
                                note="O(1) in session length means ~1"))
    return rows
