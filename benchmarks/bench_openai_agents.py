"""openai-agents sessions: our ``PersistentSession`` against its ``SQLiteSession`` on the same workload.

The workload is an agent's: turns of four Responses items (the user's message, a function call, its output,
the answer; about 300 bytes each), as ``Runner`` stores them (the input first, then the turn's new items).
Both stores are durable: ours with ``fsync="always"``, SQLiteSession with WAL and ``synchronous=FULL``
(peers.py). Measured, each round side by side on fresh folders:

- add: the time of one ``add_items`` call, one item (the user's message) and three (the rest of a turn);
- get: ``get_items()`` of the whole history, and ``get_items(limit=50)``, on a session of ``oa_items`` items;
- resume: a new session object on that stored session, up to its first ``get_items()`` returning.

Rows are "the peer takes N times as long as ours" (> 1: ours is faster).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from context_persistent.integrations.openai_agents import PersistentSession

from ._harness import Ctx, Row, compare, median, percentile
from .peers import durable_sqlite_session_class
from .workloads import text

GROUP = "openai-agents"


def turn(k: int, rng: random.Random) -> list[dict[str, Any]]:
    """One turn's four items, each about 300 bytes of JSON."""
    return [
        {"role": "user", "content": text(rng, 270)},
        {"arguments": '{"query": "%s"}' % text(rng, 150), "call_id": f"call_{k}", "name": "search",
         "type": "function_call", "id": f"fc_{k}", "status": "completed"},
        {"call_id": f"call_{k}", "output": text(rng, 230), "type": "function_call_output"},
        {"id": f"msg_{k}", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text(rng, 180), "annotations": [], "logprobs": []}]},
    ]


def turns(n_items: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [turn(k, rng) for k in range(max(1, n_items // 4))]


async def _adds(session: Any, work: list[list[dict[str, Any]]]) -> tuple[list[float], list[float]]:
    """Microseconds of each add_items call: one item (the input), three items (the turn's new items)."""
    one, three = [], []
    pc = time.perf_counter_ns
    for items in work[:5]:  # warm-up
        await session.add_items(items[:1])
        await session.add_items(items[1:])
    for items in work:
        t = pc()
        await session.add_items(items[:1])
        one.append((pc() - t) / 1000)
        t = pc()
        await session.add_items(items[1:])
        three.append((pc() - t) / 1000)
    return one, three


async def _fill(session: Any, work: list[list[dict[str, Any]]]) -> None:
    for items in work:
        await session.add_items(items[:1])
        await session.add_items(items[1:])


async def _gets(session: Any, calls: int) -> tuple[float, float, int]:
    """Median microseconds of get_items() and of get_items(limit=50), and the item count seen."""
    pc = time.perf_counter_ns
    full, limited = [], []
    n = 0
    for _ in range(calls):
        t = pc()
        n = len(await session.get_items())
        full.append((pc() - t) / 1000)
        t = pc()
        await session.get_items(limit=50)
        limited.append((pc() - t) / 1000)
    return median(full), median(limited), n


def ours(folder: Path) -> PersistentSession:
    return PersistentSession("bench", folder, fsync="always")


def peer(folder: Path) -> Any:
    return durable_sqlite_session_class()("bench", db_path=folder / "agents.db")


async def _close(session: Any) -> None:
    if isinstance(session, PersistentSession):
        await session.aclose()
    else:
        session.close()


async def _round(ctx: Ctx, make: Any, name: str, add_work: list[list[dict[str, Any]]],
                 fill_work: list[list[dict[str, Any]]], calls: int) -> dict[str, float]:
    out: dict[str, float] = {}
    session = make(ctx.tempdir(f"{name}-add"))
    try:
        one, three = await _adds(session, add_work)
    finally:
        await _close(session)
    out["add1_p50"], out["add3_p50"] = percentile(one, 50), percentile(three, 50)
    out["add1_p99"] = percentile(one, 99)
    folder = ctx.tempdir(f"{name}-get")
    session = make(folder)
    try:
        await _fill(session, fill_work)
        out["get_all"], out["get_50"], n = await _gets(session, calls)
        assert n == 4 * len(fill_work), (name, n)
    finally:
        await _close(session)
    t = time.perf_counter()
    session = make(folder)
    try:
        n = len(await session.get_items())
        out["resume"] = (time.perf_counter() - t) * 1000
        assert n == 4 * len(fill_work), (name, n)
    finally:
        await _close(session)
    return out


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"oa_add_turns": 150, "oa_items": 2000, "oa_get_calls": 5},
                 full={"oa_add_turns": 1000, "oa_items": 20_000, "oa_get_calls": 10})
    add_work = turns(4 * ctx.size("oa_add_turns"), seed=1)
    fill_work = turns(ctx.size("oa_items"), seed=2)
    calls = ctx.size("oa_get_calls")
    n = 4 * len(fill_work)
    mine, theirs = [], []
    for r in range(ctx.rounds):
        ctx.log(f"openai-agents round {r + 1}/{ctx.rounds}")
        mine.append(asyncio.run(_round(ctx, ours, "ours", add_work, fill_work, calls)))
        theirs.append(asyncio.run(_round(ctx, peer, "peer", add_work, fill_work, calls)))
    ref = "openai-agents SQLiteSession (WAL, synchronous=FULL)"
    rows = []
    for key, name, unit in (
            ("add1_p50", "add_items, 1 item, p50: SQLiteSession / ours", "µs"),
            ("add1_p99", "add_items, 1 item, p99: SQLiteSession / ours", "µs"),
            ("add3_p50", "add_items, 3 items, p50: SQLiteSession / ours", "µs"),
            ("get_all", f"get_items() of {n:,} items: SQLiteSession / ours", "µs"),
            ("get_50", f"get_items(limit=50) of {n:,}: SQLiteSession / ours", "µs"),
            ("resume", f"resume {n:,} items (new session + get_items): SQLiteSession / ours", "ms")):
        rows.append(compare(GROUP, name, [m[key] for m in mine], [t[key] for t in theirs], unit=unit,
                            ref_name=ref, invert=True))
    return rows
