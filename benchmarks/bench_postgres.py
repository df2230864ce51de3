"""PostgreSQL next to the file log: add_message latency, resume (open + replay) time, takeover after a kill.

The reference for every PostgreSQL figure is the file log (fsync=always) measured in the same round on the
same machine. The server is $CONTEXT_PERSISTENT_BENCH_DSN, else $CONTEXT_PERSISTENT_TEST_DSN, else
postgresql://postgres@127.0.0.1:5432/test; the plug-in is skipped when none answers. Everything is written
to a throwaway schema that is dropped at the end. Takeover: a child process holds a session and is
SIGKILLed; we time from the kill to a successful writer open in this process (docs/postgres.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager, SessionLockedError

from ._harness import ROOT, Ctx, Row, Skip, compare, info, percentile
from .bench_append import add_latencies
from .workloads import sized_message

GROUP = "postgres"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
HOLDER = """
import asyncio, sys
from context_persistent import PersistentContextManager
async def main():
    s = await PersistentContextManager.open(storage_path=sys.argv[1], session_id=sys.argv[2], backend="postgres",
                                            dsn=sys.argv[3], pg_schema=sys.argv[4])
    await s.add_message({"role": "user", "content": "held"})
    print("READY", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _dsn() -> str:
    return os.environ.get("CONTEXT_PERSISTENT_BENCH_DSN") or os.environ.get("CONTEXT_PERSISTENT_TEST_DSN") or DEFAULT_DSN


async def _probe(dsn: str) -> None:
    from context_persistent.pg import connect

    conn = await connect(dsn, timeout=3)
    await conn.close()


async def _drop(dsn: str, schema: str) -> None:
    from context_persistent.pg import connect

    conn = await connect(dsn)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()


async def _latencies(storage: Path, cfg: dict[str, Any], msg: dict[str, Any], n: int) -> list[float]:
    return await add_latencies(storage, msg, n, session_id=f"lat-{uuid.uuid4().hex[:8]}", recognise_replay=False,
                               **cfg)


async def _resume(storage: Path, cfg: dict[str, Any], msg: dict[str, Any], n: int) -> float:
    sid = f"resume-{uuid.uuid4().hex[:8]}"
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, **cfg) as s:
        await s.set_messages([msg] * n)  # one event: fast to write, and replay still decodes every message
        for _ in range(n // 10):
            await s.add_message(msg)
    t = time.perf_counter()
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, **cfg) as s:
        await s.get_messages()
    return time.perf_counter() - t


async def _takeover(storage: Path, cfg: dict[str, Any]) -> float:
    sid = f"takeover-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(storage), sid, cfg["dsn"], cfg["pg_schema"]],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "READY":
            raise RuntimeError("the holder process did not start")
        t = time.perf_counter()
        child.send_signal(signal.SIGKILL)
        while True:
            try:
                store = await PersistentContextManager.open(storage_path=storage, session_id=sid, **cfg)
                break
            except SessionLockedError:
                if time.perf_counter() - t > 60:
                    raise
                await asyncio.sleep(0.001)
        dt = time.perf_counter() - t
        await store.close()
        return dt
    finally:
        child.kill()
        child.wait()


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"pg_append_n": 300, "pg_resume_n": 5000},
                 full={"pg_append_n": 2000, "pg_resume_n": 50_000})
    dsn = _dsn()
    try:
        asyncio.run(_probe(dsn))
    except Exception as e:
        raise Skip(f"no PostgreSQL at {dsn}: {e}") from None
    schema = f"cp_bench_{uuid.uuid4().hex[:8]}"
    pg = {"backend": "postgres", "dsn": dsn, "pg_schema": schema}
    n, resume_n = ctx.size("pg_append_n"), ctx.size("pg_resume_n")
    msg = sized_message(300)
    rows: list[Row] = []
    try:
        ours, ref, res_pg, res_file, takeover = [], [], [], [], []
        for r in range(ctx.rounds):
            ctx.log(f"postgres round {r + 1}/{ctx.rounds}")
            ours.append(asyncio.run(_latencies(ctx.tempdir("pg"), pg, msg, n)))
            ref.append(asyncio.run(_latencies(ctx.tempdir("file"), {}, msg, n)))
            res_pg.append(asyncio.run(_resume(ctx.tempdir("pg"), pg, msg, resume_n)))
            res_file.append(asyncio.run(_resume(ctx.tempdir("file"), {}, msg, resume_n)))
            takeover.append(asyncio.run(_takeover(ctx.tempdir("pg"), pg)) * 1000)
        file_name = "file log, fsync=always, same machine"
        for p in (50, 99):
            rows.append(compare(GROUP, f"add_message 300 B p{p} on PostgreSQL", [percentile(x, p) for x in ours],
                                [percentile(x, p) for x in ref], unit="µs", ref_name=file_name,
                                note="one statement = one transaction per append (group commit when concurrent)"))
        label = f"{resume_n + resume_n // 10:,} messages"
        rows.append(compare(GROUP, f"resume (open + replay + get_messages) {label} on PostgreSQL", res_pg,
                            res_file, unit="s", ref_name=file_name, note="no checkpoint"))
        rows.append(info(GROUP, "takeover after SIGKILL of the writer process", sorted(takeover)[len(takeover) // 2],
                         "ms", note="kill -> next writer's open succeeds (advisory lock freed)", samples=takeover))
    finally:
        asyncio.run(_drop(dsn, schema))
    return rows
