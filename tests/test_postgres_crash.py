"""PostgreSQL under failure: two worker processes racing, writers SIGKILLed or cut off mid-append.

Worker processes (postgres_worker.py) stand in for agent workers on other machines.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import chained
import pytest
from pgfixtures import execute, pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, SessionLockedError
from context_persistent.errors import DatabaseError
from context_persistent.storage.pg import PostgresEventLog

WORKER = str(Path(__file__).with_name("postgres_worker.py"))
#: How long a takeover may take after a worker process dies: the server frees the lock as soon as it
#: sees the socket close (milliseconds); the bound only keeps a broken build from hanging the suite.
TAKEOVER_BOUND = 30.0


def worker(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


async def stored_messages(pg_dsn: str, pg_schema: str, session_id: str) -> list[str]:
    """Every message content in the session, read by a fresh read-only manager (which verifies every record)."""
    async with await PersistentContextManager.open(storage_path="/nonexistent", session_id=session_id,
                                                   readonly=True, backend="postgres", dsn=pg_dsn,
                                                   pg_schema=pg_schema) as store:
        return [m["content"] for m in await store.get_messages()]


async def open_when_free(cfg: dict[str, Any], session_id: str, storage: Path) -> PersistentContextManager:
    deadline = time.monotonic() + TAKEOVER_BOUND
    while True:
        try:
            return await PersistentContextManager.open(storage_path=storage, session_id=session_id,
                                                       recognise_replay=False, **cfg)
        except SessionLockedError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


@pytest.fixture
def env(subprocess_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**subprocess_env, "CONTEXT_PERSISTENT_DIR": str(tmp_path / "worker-store")}


@pytest.mark.slow
def test_two_processes_race_and_exactly_one_writes(pg_dsn: str, pg_schema: str, sid: str, env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """Two worker processes open and append to one session at once: one writes, the other gets SessionLockedError."""
    go, release = tmp_path / "go", tmp_path / "release"
    procs = [worker(env, "race", pg_dsn, pg_schema, sid, "25", str(go), str(release)) for _ in range(2)]
    try:
        time.sleep(1.0)  # let both start their interpreters and spin on the go file
        go.touch()
        outputs: dict[int, list[str]] = {}
        for p in procs:
            assert p.stdout is not None
            out = []
            for line in p.stdout:
                out.append(line.strip())
                if line.startswith(("HOLDING", "LOCKED")):
                    break
            outputs[p.pid] = out
        release.touch()
        codes = sorted(p.wait(30) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 3], outputs
    winner = next(pid for pid, out in outputs.items() if out[-1] == "HOLDING")
    loser = next(pid for pid, out in outputs.items() if out[-1].startswith("LOCKED"))
    assert f"is locked by pid {winner}" in outputs[loser][-1]
    contents = asyncio.run(stored_messages(pg_dsn, pg_schema, sid))
    assert contents == [f"pid{winner}-{i}" for i in range(25)]  # the read verified seqs 1..N, no gap


@pytest.mark.slow
async def test_sigkilled_writer_is_taken_over_with_every_acknowledged_message(
        pg_config: dict[str, Any], sid: str, env: dict[str, str], tmp_path: Path) -> None:
    """A writer process SIGKILLed mid-session frees the session; the next worker opens it with every acked message."""
    acked: list[int] = []
    for round_ in range(2):  # the second round takes over a session that already has history
        proc = worker(env, "write", pg_config["dsn"], pg_config["pg_schema"], sid, f"r{round_}")
        assert proc.stdout is not None
        target = 40 + 17 * round_
        n = 0
        for line in proc.stdout:
            if line.startswith("ACK"):
                n = int(line.split()[1]) + 1
                if n == target:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        for line in proc.stdout:  # acknowledged before the kill landed (the pipe can hold ACKs not read yet)
            if line.startswith("ACK"):
                n = int(line.split()[1]) + 1
        acked.append(n)
        store = await open_when_free(pg_config, sid, tmp_path / "store")
        try:
            messages = [m["content"] for m in await store.get_messages()]
        finally:
            await store.close()
        expected = [f"r{r}-{i}" for r in range(round_ + 1) for i in range(acked[r])]
        # Every acknowledged message is there, in order; at most the one in flight when killed follows each round.
        for r in range(round_ + 1):
            prefix = [m for m in messages if m.startswith(f"r{r}-")]
            assert prefix[:acked[r]] == [f"r{r}-{i}" for i in range(acked[r])]
            assert len(prefix) - acked[r] in (0, 1)
        assert len(messages) >= len(expected)


async def test_terminating_the_writer_repeatedly_keeps_the_log_consistent(
        pg_config: dict[str, Any], sid: str, tmp_path: Path) -> None:
    """pg_terminate_backend on the writer while it appends: every acknowledged message survives, no refused one."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, recognise_replay=False,
                                                **pg_config)
    log = store._log
    acked, refused, kills = [], [], 0
    big = "x" * 50_000  # larger records keep each append in flight longer

    async def killer() -> None:
        nonlocal kills
        for i in range(12):
            await asyncio.sleep(0.004 * (i % 4 + 1))
            pid = log.backend_pid
            if pid is not None and (await execute(pg_config["dsn"], "SELECT pg_terminate_backend($1) AS ok", pid)
                                    )[0]["ok"]:
                kills += 1

    k = asyncio.create_task(killer())
    i = 0
    while not k.done() or i < 20:
        content = f"{i}:{big}"
        try:
            await store.add_message({"role": "user", "content": content})
            acked.append(content)
        except DatabaseError as e:
            assert e.stored is False, e  # the server stays up, so the outcome is always learned
            refused.append(content)
        i += 1
    await k
    await store.close()
    assert kills >= 3
    assert await stored_messages(pg_config["dsn"], pg_config["pg_schema"], sid) == acked


class CutProxy:
    """A TCP proxy to the server that can drop the connection right after the server answers (reply lost)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut_next_reply = False
        self.cuts = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection(*self.target)
        armed = asyncio.Event()

        async def up() -> None:
            while data := await creader.read(65536):
                if self.cut_next_reply:
                    self.cut_next_reply = False
                    armed.set()  # this request goes through; its answer will not
                swriter.write(data)
                await swriter.drain()

        async def down() -> None:
            while data := await sreader.read(65536):
                if armed.is_set():
                    self.cuts += 1
                    break
                cwriter.write(data)
                await cwriter.drain()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except Exception:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (cwriter, swriter):
                w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_append_whose_reply_is_lost_is_found_committed(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """If the connection dies after the server committed but before the reply, the append learns it and succeeds."""
    u = urlsplit(pg_dsn)
    proxy = CutProxy(u.hostname or "127.0.0.1", u.port or 5432)
    port = await proxy.start()
    dsn = urlunsplit(u._replace(netloc=f"{u.username}@127.0.0.1:{port}"))
    try:
        log = await PostgresEventLog.open(dsn, sid, schema=pg_schema)
        rec = chained.lines(sid, 1, 3, "", lambda s, _: {"role": "user", "content": str(s)})
        await log.append(rec[:1], 1)
        old = log.backend_pid
        proxy.cut_next_reply = True
        await log.append(rec[1:2], 2)  # committed, reply lost, reconciled: no error, no duplicate
        assert proxy.cuts == 1 and log.backend_pid != old and log.last_seq == 2
        await log.append(rec[2:], 3)
        await log.close()
    finally:
        await proxy.close()
    rows = await execute(pg_dsn, f"SELECT seq FROM {pg_schema}.events WHERE session_id = $1 ORDER BY seq", sid)
    assert [r["seq"] for r in rows] == [1, 2, 3]
