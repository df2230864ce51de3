"""PostgreSQL: an append whose connection is terminated (``pg_terminate_backend``, as an administrator or a
failover does) is settled while the server is reachable: acknowledged or refused (``stored=False``), never
"whether the records were stored is unknown" (``stored=None``), even when the connections opened to find out are
terminated too (#28, item 11a)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import chained
import pytest
from pgfixtures import execute, pg_dsn, pg_schema, run_sql, sid  # noqa: F401
from test_postgres_crash import stored_messages

from context_persistent import PersistentContextManager
from context_persistent.errors import DatabaseError
from context_persistent.storage.pg import PostgresEventLog
from context_persistent.storage.pg import log as pg_log

pytestmark = pytest.mark.postgres


@pytest.fixture
def own_schema(pg_dsn: str) -> Iterator[str]:
    """A schema of the test's own: its many aborted inserts stay out of the tables other tests look into
    (tests/test_erase_seams.py reads a table's pages for dead row versions)."""
    name = f"cp_settle_{uuid.uuid4().hex[:12]}"
    yield name
    run_sql(pg_dsn, f"DROP SCHEMA IF EXISTS {name} CASCADE")


async def test_reconnections_terminated_while_settling_still_settle(pg_dsn: str, own_schema: str, sid: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's connection is terminated while its append waits on a row lock, and so are the next three
    connections the log opens to learn the outcome: the append is refused (stored=False, nothing stored) and the
    log, still the writer, stores the same seq next."""
    pg_schema = own_schema
    log = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    await log.append(chained.lines(sid, 1, 1), 1)
    admin = await asyncpg.connect(pg_dsn)
    real = pg_log.reconnect
    killed: list[int] = []

    async def terminated_reconnect(dsn: str, window: float, *, writer: bool = False) -> Any:
        conn = await real(dsn, window, writer=writer)
        if len(killed) < 3:  # each of these dies before the log can use it
            killed.append(conn.get_server_pid())
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", killed[-1])
        return conn

    monkeypatch.setattr(pg_log, "reconnect", terminated_reconnect)
    try:
        tx = admin.transaction()
        await tx.start()  # hold the session row so the append blocks inside its statement
        await admin.execute(f"SELECT 1 FROM {pg_schema}.sessions WHERE session_id = $1 FOR UPDATE", sid)
        second = chained.lines(sid, 2, 1)
        append = asyncio.create_task(log.append(second, 2))
        waiting = None
        for _ in range(500):
            waiting = await admin.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                                           log.backend_pid)
            if waiting == "Lock":
                break
            await asyncio.sleep(0.01)
        assert waiting == "Lock"
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", log.backend_pid)
        await tx.rollback()
        with pytest.raises(DatabaseError, match="nothing was stored; the log reconnected") as e:
            await append
        assert e.value.stored is False
        assert len(killed) == 3
        await log.append(second, 2)  # still the writer: the same seq goes in now
    finally:
        await admin.close()
        await log.close()
    rows = await execute(pg_dsn, f"SELECT seq FROM {pg_schema}.events WHERE session_id = $1 ORDER BY seq", sid)
    assert [r["seq"] for r in rows] == [1, 2]


@pytest.mark.slow
async def test_25_terminations_during_appends_leave_nothing_unknown(pg_dsn: str, own_schema: str, sid: str,
                                                                    tmp_path: Path) -> None:
    """The writer's connection is terminated 25 times, each time as soon as it exists (during appends, during
    the reconnection that settles one, during the reads that learn its outcome): every append is acknowledged or
    refused with stored=False, and the log holds exactly the acknowledged messages, in order."""
    pg_config = {"backend": "postgres", "dsn": pg_dsn, "pg_schema": own_schema}
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, recognise_replay=False,
                                                **pg_config)
    log = store._log
    admin = await asyncpg.connect(pg_config["dsn"])
    acked: list[str] = []
    refused: list[str] = []
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while kills < 25:
            await asyncio.sleep(0.002)
            pid = log.backend_pid
            if pid is not None and await admin.fetchval("SELECT pg_terminate_backend($1)", pid):
                kills += 1

    big = "x" * 20_000  # larger records keep each append in flight longer
    k = asyncio.create_task(killer())
    deadline = time.monotonic() + 60  # (a bound for a broken build; the loop takes about a second)
    i = 0
    try:
        while not k.done() and time.monotonic() < deadline:
            content = f"{i}:{big}"
            try:
                await store.add_message({"role": "user", "content": content})
                acked.append(content)
            except DatabaseError as e:
                assert e.stored is False, e  # the server stays reachable: the outcome is always learned
                refused.append(content)
            i += 1
    finally:
        k.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await k  # (before its connection closes)
        await admin.close()
    assert kills == 25
    await store.add_message({"role": "user", "content": "after"})  # still the writer
    await store.close()
    assert await stored_messages(pg_config["dsn"], pg_config["pg_schema"], sid) == acked + ["after"]
