"""PostgreSQL next to the file log: add_message latency, resume (open + replay) time, takeover after a kill,
and the peak memory of a long session (open + first request view + a pass over the whole history).

The reference for every PostgreSQL figure is the file log (fsync=always) measured in the same round on the
same machine. The server is $CONTEXT_PERSISTENT_BENCH_DSN, else $CONTEXT_PERSISTENT_TEST_DSN, else
postgresql://postgres@127.0.0.1:5432/test; the plug-in is skipped when none answers. Everything is written
to a throwaway schema that is dropped at the end. Takeover: a child process holds a session and is
SIGKILLed; we time from the kill to a successful writer open in this process (docs/postgres.md).

Memory: a session of ``pg_long_n`` messages of the 4 KB agent mix (benchmarks/long_data.py), written once
on each backend and closed (which writes its checkpoint); then, in a fresh interpreter, the store is opened,
asked for its first request view and iterated over (``iter_messages``, every message once); the row is that
child's peak RSS, next to the same steps on the file backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager, SessionLockedError
from ._harness import CHILD_REPORT, ROOT, Ctx, Row, Skip, compare, info, percentile, run_child
from .bench_append import add_latencies
from .long_data import messages as long_messages
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
    from context_persistent.storage.pg import connect

    conn = await connect(dsn, timeout=3)
    await conn.close()


async def _drop(dsn: str, schema: str) -> None:
    from context_persistent.storage.pg import connect

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


#: A fresh interpreter: open, first request view, one pass over the history; prints times and the peak RSS.
#: (argv: storage, session id, configuration as JSON.)
LONG_CHILD = """
import asyncio, json, sys, time
from context_persistent import PersistentContextManager
async def main():
    t = time.perf_counter()
    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id=sys.argv[2],
                                                **json.loads(sys.argv[3]))
    out = {"open_s": time.perf_counter() - t}
    t = time.perf_counter()
    out["request_messages"] = len(await store.get_messages_for_request())
    out["request_s"] = time.perf_counter() - t
    t = time.perf_counter()
    n = 0
    async for _ in store.iter_messages():
        n += 1
    out["iter_s"], out["messages"] = time.perf_counter() - t, n
    await store.close()
    return out
result = asyncio.run(main())
""" + CHILD_REPORT


async def write_long(storage: Path, sid: str, cfg: dict[str, Any], n: int) -> None:
    """A session of ``n`` messages of the 4 KB agent mix, added 500 at a time, then closed (its checkpoint)."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, fsync="never",
                                                   recognise_replay=False, **cfg) as s:
        chunk: list[dict[str, Any]] = []
        for m in long_messages(n):
            chunk.append(m)
            if len(chunk) == 500:
                await s.add_messages(chunk)
                chunk = []
        if chunk:
            await s.add_messages(chunk)


def _long_steps(storage: Path, sid: str, cfg: dict[str, Any]) -> dict[str, Any]:
    return run_child(LONG_CHILD, str(storage), sid, json.dumps(cfg))


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"pg_append_n": 300, "pg_resume_n": 5000, "pg_long_n": 10_000},
                 full={"pg_append_n": 2000, "pg_resume_n": 50_000, "pg_long_n": 100_000})
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
        rows += _long_rows(ctx, pg)
    finally:
        asyncio.run(_drop(dsn, schema))
    return rows


def _long_rows(ctx: Ctx, pg: dict[str, Any]) -> list[Row]:
    n = ctx.size("pg_long_n")
    sid = f"long-{uuid.uuid4().hex[:8]}"
    ctx.log(f"postgres: writing a session of {n:,} messages of the 4 KB mix on each backend")
    pg_dir, file_dir = ctx.tempdir("pg-long"), ctx.tempdir("file-long")
    asyncio.run(write_long(pg_dir, sid, pg, n))
    asyncio.run(write_long(file_dir, sid, {}, n))
    ours, ref = [], []
    for r in range(ctx.rounds):
        ctx.log(f"postgres long session round {r + 1}/{ctx.rounds}")
        ours.append(_long_steps(pg_dir, sid, pg))
        ref.append(_long_steps(file_dir, sid, {}))
        for name, x in (("PostgreSQL", ours[-1]), ("file", ref[-1])):
            ctx.log(f"  {name}: open {x['open_s']:.2f} s, first request {x['request_s']:.2f} s, "
                    f"iter_messages {x['iter_s']:.2f} s, peak RSS {x['maxrss_kb'] / 1024:,.0f} MB")
    for x in ours + ref:
        if x["messages"] != n:
            raise RuntimeError(f"the pass over the history gave {x['messages']} messages, not {n}")
    label = f"{n:,} messages of 4 KB"
    file_name = "file log, same steps"
    return [
        compare(GROUP, f"{label}: peak RSS, open + first request + iter_messages on PostgreSQL",
                [x["maxrss_kb"] / 1024 for x in ours], [x["maxrss_kb"] / 1024 for x in ref], unit="MB",
                ref_name=file_name, note="fresh interpreter; opened from the checkpoint the writer's close wrote"),
        compare(GROUP, f"{label}: open + first request on PostgreSQL", [x["open_s"] + x["request_s"] for x in ours],
                [x["open_s"] + x["request_s"] for x in ref], unit="s", ref_name=file_name),
        compare(GROUP, f"{label}: iter_messages over the history on PostgreSQL", [x["iter_s"] for x in ours],
                [x["iter_s"] for x in ref], unit="s", ref_name=file_name),
    ]
