"""Appending: the latency each message adds to an agent turn, per durability mode, against the floor and peers.

Floors: the same record bytes written with ``os.write`` + ``os.fdatasync`` per record, and one coalesced
``os.write`` + ``os.fdatasync`` per group of 64 records. Peers: openai-agents ``SQLiteSession.add_items``
(WAL, synchronous=FULL) and stdlib sqlite3 (WAL, synchronous=FULL, one commit per row or per 64 rows).
Each round runs ours and every reference one after the other on fresh files, so they share the noise.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson

from context_persistent import PersistentContextManager

from context_persistent.model import codec
from context_persistent.model import events as ev
from ._harness import Ctx, Row, compare, percentile
from .peers import durable_sqlite_session_class, sqlite_session_pragmas, sqlite_wal
from .workloads import sized_message

GROUP = "append"


def _line(msg: dict[str, Any], seq: int = 2) -> bytes:
    return codec.encode(seq, ev.MESSAGE_ADDED, b'{"message":%s}' % orjson.dumps(msg))


# -- ours -------------------------------------------------------------------------------------------
async def add_latencies(storage: Path, msg: dict[str, Any], n: int, *, session_id: str = "lat",
                        **config: Any) -> list[float]:
    """Microseconds of each of ``n`` sequential ``add_message`` calls (after 10 warm-up calls)."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=session_id, **config)
    try:
        for _ in range(10):
            await store.add_message(msg)
        pc = time.perf_counter_ns
        out = []
        for _ in range(n):
            t = pc()
            await store.add_message(msg)
            out.append((pc() - t) / 1000)
        return out
    finally:
        await store.close()


async def _ours_rate(storage: Path, msg: dict[str, Any], total: int, producers: int, fsync: str) -> float:
    store = await PersistentContextManager.open(storage_path=storage, session_id="rate", fsync=fsync)
    per = max(1, total // producers)

    async def produce() -> None:
        for _ in range(per):
            await store.add_message(msg)

    try:
        t = time.perf_counter()
        await asyncio.gather(*(produce() for _ in range(producers)))
        dt = time.perf_counter() - t
    finally:
        await store.close()
    return per * producers / dt


# -- floors -----------------------------------------------------------------------------------------
def _floor_latencies(folder: Path, line: bytes, n: int) -> list[float]:
    fd = os.open(folder / "floor.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for _ in range(10):
            os.write(fd, line)
            os.fdatasync(fd)
        pc = time.perf_counter_ns
        out = []
        for _ in range(n):
            t = pc()
            os.write(fd, line)
            os.fdatasync(fd)
            out.append((pc() - t) / 1000)
        return out
    finally:
        os.close(fd)


def _floor_group_rate(folder: Path, line: bytes, total: int, group: int) -> float:
    fd = os.open(folder / "group.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    batch = line * group
    rounds = max(1, total // group)
    try:
        t = time.perf_counter()
        for _ in range(rounds):
            os.write(fd, batch)
            os.fdatasync(fd)
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    return rounds * group / dt


def _floor_nosync_rate(folder: Path, line: bytes, total: int) -> float:
    fd = os.open(folder / "nosync.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        t = time.perf_counter()
        for _ in range(total):
            os.write(fd, line)
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    return total / dt


# -- peers ------------------------------------------------------------------------------------------
async def _sqlite_session_latencies(folder: Path, msg: dict[str, Any], n: int) -> list[float]:
    session = durable_sqlite_session_class()("lat", db_path=folder / "agents.db")
    try:
        for _ in range(10):
            await session.add_items([msg])
        pc = time.perf_counter_ns
        out = []
        for _ in range(n):
            t = pc()
            await session.add_items([msg])
            out.append((pc() - t) / 1000)
        return out
    finally:
        session.close()


async def _sqlite_session_rate(folder: Path, msg: dict[str, Any], total: int, producers: int) -> float:
    session = durable_sqlite_session_class()("rate", db_path=folder / "agents-rate.db")
    per = max(1, total // producers)

    async def produce() -> None:
        for _ in range(per):
            await session.add_items([msg])

    try:
        t = time.perf_counter()
        await asyncio.gather(*(produce() for _ in range(producers)))
        return per * producers / (time.perf_counter() - t)
    finally:
        session.close()


def _sqlite_latencies(folder: Path, data: str, n: int) -> list[float]:
    conn = sqlite_wal(folder / "raw.db")
    try:
        pc = time.perf_counter_ns
        out = []
        for i in range(n + 10):
            t = pc()
            conn.execute("INSERT INTO messages (session, data) VALUES (?, ?)", ("s", data))
            if i >= 10:
                out.append((pc() - t) / 1000)
        return out
    finally:
        conn.close()


def _sqlite_group_rate(folder: Path, data: str, total: int, group: int) -> float:
    conn = sqlite_wal(folder / "raw-group.db")
    rows = [("s", data)] * group
    rounds = max(1, total // group)
    try:
        t = time.perf_counter()
        for _ in range(rounds):
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO messages (session, data) VALUES (?, ?)", rows)
            conn.execute("COMMIT")
        return rounds * group / (time.perf_counter() - t)
    finally:
        conn.close()


# -- the plug-in ------------------------------------------------------------------------------------
def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"append_n": 300, "batch_total": 64 * 40, "never_total": 5000},
                 full={"append_n": 2000, "batch_total": 64 * 200, "never_total": 50_000})
    n, total, never_total = ctx.size("append_n"), ctx.size("batch_total"), ctx.size("never_total")
    producers = 64
    rows: list[Row] = []
    pragmas = sqlite_session_pragmas(ctx.tempdir("pragma") / "probe.db")
    ctx.log(f"append: SQLiteSession pragmas {pragmas}")

    for size in (300, 4096):
        msg = sized_message(size)
        line, data = _line(msg), orjson.dumps(msg).decode()
        ours, resv, floor, peer, raw = [], [], [], [], []  # per-round sample lists
        for r in range(ctx.rounds):
            ctx.log(f"append {size} B fsync=always round {r + 1}/{ctx.rounds}")
            ours.append(asyncio.run(add_latencies(ctx.tempdir("ours"), msg, n, fsync="always")))
            resv.append(asyncio.run(add_latencies(ctx.tempdir("ours-r"), msg, n, fsync="always",
                                                  reserve_tail=True)))
            floor.append(_floor_latencies(ctx.tempdir("floor"), line, n))
            if size == 300:
                peer.append(asyncio.run(_sqlite_session_latencies(ctx.tempdir("peer"), msg, n)))
                raw.append(_sqlite_latencies(ctx.tempdir("sqlite"), data, n))
        p50 = [percentile(x, 50) for x in ours]
        p99 = [percentile(x, 99) for x in ours]
        target = "<= 1.5" if size == 300 else None
        rows.append(compare(GROUP, f"add_message fsync=always {size} B p50", p50,
                            [percentile(x, 50) for x in floor], unit="µs",
                            ref_name="floor: os.write+fdatasync per record", target=target))
        rows.append(compare(GROUP, f"add_message fsync=always {size} B p99", p99,
                            [percentile(x, 99) for x in floor], unit="µs",
                            ref_name="floor: os.write+fdatasync per record"))
        # The opt-in reserved tail (docs/format.md): the same appends over zeros written ahead of the data.
        for pct in (50, 99):
            rows.append(compare(GROUP, f"add_message fsync=always reserve_tail {size} B p{pct}",
                                [percentile(x, pct) for x in resv], [percentile(x, pct) for x in floor],
                                unit="µs", ref_name="floor: os.write+fdatasync per record"))
        if size == 300:
            rows.append(compare(GROUP, "fsync=always 300 B p50: SQLiteSession.add_items / ours", p50,
                                [percentile(x, 50) for x in peer], unit="µs", invert=True, target=">= 2",
                                ref_name="openai-agents SQLiteSession (WAL, FULL)",
                                extra={"pragmas": pragmas}))
            rows.append(compare(GROUP, "fsync=always reserve_tail 300 B p50: SQLiteSession.add_items / ours",
                                [percentile(x, 50) for x in resv], [percentile(x, 50) for x in peer], unit="µs",
                                invert=True, ref_name="openai-agents SQLiteSession (WAL, FULL)"))
            rows.append(compare(GROUP, "fsync=always 300 B p50: sqlite3 commit per row / ours", p50,
                                [percentile(x, 50) for x in raw], unit="µs", invert=True,
                                ref_name="sqlite3 WAL synchronous=FULL"))

    msg = sized_message(300)
    line, data = _line(msg), orjson.dumps(msg).decode()
    ours_b, floor_b, peer_b, raw_b, ours_n, floor_n = [], [], [], [], [], []
    for r in range(ctx.rounds):
        ctx.log(f"append fsync=batch/never round {r + 1}/{ctx.rounds}")
        ours_b.append(asyncio.run(_ours_rate(ctx.tempdir("ours-b"), msg, total, producers, "batch")))
        floor_b.append(_floor_group_rate(ctx.tempdir("floor-b"), line, total, producers))
        peer_b.append(asyncio.run(_sqlite_session_rate(ctx.tempdir("peer-b"), msg, total // 4, producers)))
        raw_b.append(_sqlite_group_rate(ctx.tempdir("sqlite-b"), data, total, producers))
        ours_n.append(asyncio.run(_ours_rate(ctx.tempdir("ours-n"), msg, never_total, 1, "never")))
        floor_n.append(_floor_nosync_rate(ctx.tempdir("floor-n"), line, never_total))
    rows.append(compare(GROUP, "add_message fsync=batch, 64 producers, 300 B", ours_b, floor_b, unit="ev/s",
                        ref_name="floor: one write+fdatasync per 64 records", target=">= 0.25"))
    rows.append(compare(GROUP, "fsync=batch, 64 producers: ours vs SQLiteSession (x faster)", ours_b, peer_b,
                        unit="ev/s", ref_name="SQLiteSession.add_items, 64 concurrent producers"))
    rows.append(compare(GROUP, "fsync=batch, 64 producers: ours vs sqlite3 64 rows/commit", ours_b, raw_b,
                        unit="ev/s", ref_name="sqlite3 WAL FULL, executemany 64 rows per commit"))
    rows.append(compare(GROUP, "add_message fsync=never, 300 B", ours_n, floor_n, unit="ev/s",
                        ref_name="floor: os.write per record, no sync"))
    return rows
