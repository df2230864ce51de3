"""What recording provider-reported usage, and calibrating the budget from it, cost a turn.

Two sessions of the same ``usage_messages`` messages (300 B each) are open side by side and driven turn by
turn, alternately, so both see the same machine noise. A turn is what an agent's turn asks of the store:
``add_message`` (the user's message), ``get_messages_for_request()`` (the request view, default budget), and
on the "with" session ``record_usage(...)`` of a report like a provider's (input tokens 1.3x the store's
count of the view plus 300, as a Claude-class model reports; which session goes first alternates). The record rides with the next append, so its cost shows up
in the turns, not in the call. Rows, each the ratio of the per-round medians: with / without, at
``fsync="always"`` (the default: the disk's sync dominates), at ``fsync="never"`` (the CPU cost alone), and at
``fsync="never"`` with reports that wobble +-3% around the straight line, as a real provider's do, and with
a ratio that rises by 8% over the turns (the calibrated budget then keeps falling a little).

The calibrated budget: the request rows of bench_request (``usage_request_messages`` messages of 300 B;
``get_messages_for_request()`` unchanged, and after one new message), on a session calibrated by 20 reports
against the same session opened with ``calibrate: false`` (today's request view). The calibrated view fits a
budget 1.3x smaller in our tokens, so it compacts to a different view; the row is what that costs.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
from context_persistent.model.tokens import TokenCounter
from ._harness import Ctx, Row, Skip, compare, info, median
from .workloads import sized_message, sized_messages, write_session

GROUP = "usage"
RATIO = 1.3
FIXED = 300
#: How much a real provider's count wanders around a straight line of ours (its tokenizer is not ours: the
#: ratio moves with the content); the third case draws each report's factor from 1 +- this.
WOBBLE = 0.03
#: The fourth case: a provider whose ratio to ours rises over the session (its tokenizer counts what the
#: session accumulates, code or data, more heavily than the prose it started with), by this much in all.
DRIFT = 0.08


_COUNTER = TokenCounter()


def _report(view: list[dict[str, Any]]) -> dict[str, Any]:
    """What a Claude-class provider would report for ``view``: 1.3x the store's count plus 300 fixed."""
    tokens = sum(_COUNTER.count_message(m) for m in view)
    return {"input_tokens": int(tokens * RATIO) + FIXED, "output_tokens": 40, "total_tokens": 0}


async def _turns(storage: Path, turns: int, fsync: str, wobble: float, drift: float) -> tuple[float, float, float]:
    """(median turn without, median turn with record_usage, median record_usage call), seconds. The reports
    are 1.3x the view's count + 300, times a factor drawn from [1 - wobble, 1 + wobble] (seeded) and times
    1 + drift x (the fraction of the turns done)."""
    rng = random.Random(7)
    plain = await PersistentContextManager.open(storage_path=storage, session_id="plain", fsync=fsync)
    usage = await PersistentContextManager.open(storage_path=storage, session_id="usage", fsync=fsync)
    try:
        for store in (plain, usage):
            await store.get_messages_for_request()  # the first request counts every message once
        # The report follows the view's count, kept up to date by the new message's count alone: counting the
        # whole view each turn would leave garbage that the next turn, timed, would collect.
        tokens = sum(_COUNTER.count_message(m) for m in await usage.get_messages_for_request())
        pc = time.perf_counter
        without, with_, calls = [], [], []

        async def turn_without(msg: dict[str, Any]) -> None:
            t = pc()
            await plain.add_message(msg)
            await plain.get_messages_for_request()
            without.append(pc() - t)

        async def turn_with(msg: dict[str, Any], report: dict[str, Any]) -> None:
            t = pc()
            await usage.add_message(msg)
            await usage.get_messages_for_request()
            c = pc()
            await usage.record_usage(report, provider="bench", model="bench-1")
            done = pc()
            with_.append(done - t)
            calls.append(done - c)

        for i in range(turns):
            msg = sized_message(300, seed=1000 + i)
            tokens += _COUNTER.count_message(msg)
            reported = int((tokens * RATIO + FIXED) * (1 + rng.uniform(-wobble, wobble)) * (1 + drift * i / turns))
            report = {"input_tokens": reported, "output_tokens": 40, "total_tokens": 0}
            if i % 2:  # (alternate which goes first, so neither always follows the other's garbage)
                await turn_without(msg)
                await turn_with(msg, report)
            else:
                await turn_with(msg, report)
                await turn_without(msg)
        return median(without), median(with_), median(calls)
    finally:
        await plain.close()
        await usage.close()


async def _requests(storage: Path, calls: int, calibrate: bool) -> tuple[float, float]:
    """(median unchanged request, median request after one new message), seconds; calibrated by 20 reports."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                calibrate=calibrate)
    try:
        for i in range(20):
            view = await store.get_messages_for_request()
            await store.record_usage(_report(view), provider="bench", model="bench-1")
            await store.add_message(sized_message(300, role="assistant", seed=2000 + i))
        await store.get_messages_for_request()
        pc = time.perf_counter
        unchanged, after = [], []
        for _ in range(calls):
            t = pc()
            await store.get_messages_for_request()
            unchanged.append(pc() - t)
        new_msg = sized_message(300, seed=99)
        for _ in range(calls):
            await store.add_message(new_msg)
            t = pc()
            await store.get_messages_for_request()
            after.append(pc() - t)
        return median(unchanged), median(after)
    finally:
        await store.close()


def run(ctx: Ctx) -> list[Row]:
    if not hasattr(PersistentContextManager, "record_usage"):
        raise Skip("this build has no record_usage (issue #22)")
    ctx.defaults(quick={"usage_messages": 1000, "usage_turns": 100, "usage_request_messages": 10_000,
                        "usage_request_calls": 5},
                 full={"usage_messages": 1000, "usage_turns": 400, "usage_request_messages": 10_000,
                       "usage_request_calls": 15})
    n, turns = ctx.size("usage_messages"), ctx.size("usage_turns")
    msgs = sized_messages(n, 300)
    rows: list[Row] = []
    for fsync, wobble, drift in (("always", 0.0, 0.0), ("never", 0.0, 0.0), ("never", WOBBLE, 0.0),
                                 ("never", 0.0, DRIFT)):
        got: dict[str, list[float]] = {"without": [], "with": [], "call": []}
        case = f"fsync={fsync}" + (f", reports wobbling +-{wobble:.0%}" if wobble else "") + (
            f", the provider's ratio rising {drift:.0%} over the turns" if drift else "")
        folder = ctx.tempdir(f"usage-turns-{fsync}-{wobble}-{drift}")
        for r in range(ctx.rounds):
            ctx.log(f"usage: {turns} turns on {n:,} messages, {case}, round {r + 1}/{ctx.rounds}")
            storage = folder / f"store-{r}"
            write_session(storage, "plain", msgs)
            write_session(storage, "usage", msgs)
            without, with_, call = asyncio.run(_turns(storage, turns, fsync, wobble, drift))
            got["without"].append(without * 1e6)
            got["with"].append(with_ * 1e6)
            got["call"].append(call * 1e6)
        rows.append(compare(GROUP, f"turn on {n:,} x 300 B, {case}: with record_usage / without",
                            got["with"], got["without"], unit="µs", target="<= 1.1",
                            ref_name="the same turn without record_usage (add_message + get_messages_for_request)"))
        rows.append(info(GROUP, f"record_usage call, {case} (the record rides with the next append)",
                         median(got["call"]), "µs", samples=got["call"]))
    m, calls = ctx.size("usage_request_messages"), ctx.size("usage_request_calls")
    msgs = sized_messages(m, 300)
    folder = ctx.tempdir("usage-request")
    req: dict[str, list[float]] = {"cal_u": [], "cal_a": [], "off_u": [], "off_a": []}
    for r in range(ctx.rounds):
        ctx.log(f"usage: request view on {m:,} messages, calibrated and not, round {r + 1}/{ctx.rounds}")
        for calibrate, key in ((False, "off"), (True, "cal")):
            storage = folder / f"store-{r}-{key}"
            write_session(storage, "s", msgs)
            u, a = asyncio.run(_requests(storage, calls, calibrate))
            req[f"{key}_u"].append(u * 1000)
            req[f"{key}_a"].append(a * 1000)
    label = f"{m:,} x 300 B"
    rows += [
        compare(GROUP, f"request unchanged {label}: calibrated / calibrate=false", req["cal_u"], req["off_u"],
                unit="ms", target="<= 1.1", ref_name="the same request view uncalibrated (today's)"),
        compare(GROUP, f"request after one new message {label}: calibrated / calibrate=false", req["cal_a"],
                req["off_a"], unit="ms", target="<= 1.1", ref_name="the same request view uncalibrated (today's)"),
    ]
    return rows
