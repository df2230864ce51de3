"""openai-agents sessions: our ``PersistentSession`` against its ``SQLiteSession`` on the same workload.

The workload is an agent's: turns of four Responses items (the user's message, a function call, its output,
the answer; about 300 bytes each), as ``Runner`` stores them (the input first, then the turn's new items).
Both stores are durable: ours with ``fsync="always"``, SQLiteSession with WAL and ``synchronous=FULL``
(peers.py). Measured on fresh folders each round, ours and the peer alternating call by call (so both see the
same noise of a shared machine):

- add: the time of one ``add_items`` call, one item (the user's message) and three (the rest of a turn),
  and of the two together (a turn);
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


def ours(folder: Path) -> PersistentSession:
    return PersistentSession("bench", folder, fsync="always")


def peer(folder: Path) -> Any:
    return durable_sqlite_session_class()("bench", db_path=folder / "agents.db")


async def _close(session: Any) -> None:
    if isinstance(session, PersistentSession):
        await session.aclose()
    else:
        session.close()


async def _timed(call: Any) -> tuple[float, Any]:
    t = time.perf_counter_ns()
    result = await call
    return (time.perf_counter_ns() - t) / 1000, result


async def _round(ctx: Ctx, add_work: list[list[dict[str, Any]]], fill_work: list[list[dict[str, Any]]],
                 calls: int) -> tuple[dict[str, float], dict[str, float]]:
    """One round: every measurement alternates ours and the peer call by call, so both see the same noise."""
    makers = (ours, peer)
    samples: list[dict[str, list[float]]] = [{}, {}]

    def note(side: int, key: str, us: float) -> None:
        samples[side].setdefault(key, []).append(us)

    sessions = [make(ctx.tempdir(f"{name}-add")) for make, name in zip(makers, ("ours", "peer"))]
    warm = min(5, len(add_work) // 2)  # the first turns warm up, untimed
    try:
        for k, items in enumerate(add_work):
            for side, session in enumerate(sessions):
                us1, _ = await _timed(session.add_items(items[:1]))
                us3, _ = await _timed(session.add_items(items[1:]))
                if k >= warm:
                    note(side, "add1", us1)
                    note(side, "add3", us3)
                    note(side, "turn", us1 + us3)
    finally:
        for session in sessions:
            await _close(session)
    folders = [ctx.tempdir(f"{name}-get") for name in ("ours", "peer")]
    sessions = [make(folder) for make, folder in zip(makers, folders)]
    expected = 4 * len(fill_work)
    try:
        for items in fill_work:
            for session in sessions:
                await session.add_items(items[:1])
                await session.add_items(items[1:])
        for _ in range(calls):
            for side, session in enumerate(sessions):
                us, got = await _timed(session.get_items())
                assert len(got) == expected, (side, len(got))
                note(side, "get_all", us)
                us, got = await _timed(session.get_items(limit=50))
                assert len(got) == min(50, expected), (side, len(got))
                note(side, "get_50", us)
    finally:
        for session in sessions:
            await _close(session)
    for side, (make, folder) in enumerate(zip(makers, folders)):
        t = time.perf_counter_ns()
        session = make(folder)
        try:
            got = await session.get_items()
            note(side, "resume", (time.perf_counter_ns() - t) / 1e6)
            assert len(got) == expected, (side, len(got))
        finally:
            await _close(session)
    out: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for side in (0, 1):
        got = samples[side]
        out[side].update(add1_p50=percentile(got["add1"], 50), add1_p99=percentile(got["add1"], 99),
                         add3_p50=percentile(got["add3"], 50), turn_p50=percentile(got["turn"], 50),
                         get_all=median(got["get_all"]),
                         get_50=median(got["get_50"]), resume=got["resume"][0])
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
        o, p = asyncio.run(_round(ctx, add_work, fill_work, calls))
        mine.append(o)
        theirs.append(p)
    ref = "openai-agents SQLiteSession (WAL, synchronous=FULL)"
    rows = []
    for key, name, unit in (
            ("add1_p50", "add_items, 1 item, p50: SQLiteSession / ours", "µs"),
            ("add1_p99", "add_items, 1 item, p99: SQLiteSession / ours", "µs"),
            ("add3_p50", "add_items, 3 items, p50: SQLiteSession / ours", "µs"),
            ("turn_p50", "a turn's adds (1 item, then 3), p50: SQLiteSession / ours", "µs"),
            ("get_all", f"get_items() of {n:,} items: SQLiteSession / ours", "µs"),
            ("get_50", f"get_items(limit=50) of {n:,}: SQLiteSession / ours", "µs"),
            ("resume", f"resume {n:,} items (new session + get_items): SQLiteSession / ours", "ms")):
        rows.append(compare(GROUP, name, [m[key] for m in mine], [t[key] for t in theirs], unit=unit,
                            ref_name=ref, invert=True))
    return rows
