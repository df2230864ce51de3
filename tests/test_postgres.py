"""PostgreSQL backend specifics: configuration, schema versioning, locking details, fencing, follow, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import uuid
from typing import Any

import pytest
import chained
from pgfixtures import execute, pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager

from context_persistent.model import codec
from context_persistent.cli import main
from context_persistent.errors import (
    ConcurrencyError,
    DatabaseError,
    SessionLockedError,
    UnsupportedFormatError,
)
from context_persistent.storage.pg import PostgresEventLog, init_schema, status


SID = ""


@pytest.fixture(autouse=True)
def _chain_of(sid: str) -> None:
    global SID
    SID = sid


def lines(first: int, n: int) -> list[bytes]:
    """Records of the test's session, chained (each names the one before it; tests/chained.py)."""
    return chained.lines(SID, first, n, "", lambda seq, tag: {"role": "user", "content": str(seq)})


async def seqs(dsn: str, schema: str, session_id: str) -> list[int]:
    rows = await execute(dsn, f"SELECT seq FROM {schema}.events WHERE session_id = $1 ORDER BY seq", session_id)
    return [r["seq"] for r in rows]


async def wait_closed(log: PostgresEventLog) -> None:
    for _ in range(200):
        if log._conn is None or log._conn.is_closed():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the client never noticed its connection was terminated")


# -- configuration (no server needed) -----------------------------------------------------------------
async def test_missing_asyncpg_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Without asyncpg, opening a postgres store fails with DatabaseError naming the extra to install."""
    monkeypatch.setitem(sys.modules, "asyncpg", None)
    with pytest.raises(DatabaseError, match=r"pip install asyncpg \(the 'postgres' extra"):
        await PersistentContextManager.open(storage_path=tmp_path, session_id="s", backend="postgres",
                                            dsn="postgresql://u@127.0.0.1:1/x")


@pytest.mark.parametrize("config, message", [
    ({"backend": "sqlite"}, "backend must be one of file, postgres"),
    ({"backend": "postgres"}, "needs a dsn"),
    ({"backend": "postgres", "dsn": "mysql://x"}, "postgresql://"),
    ({"backend": "file", "dsn": "postgresql://x"}, "backend is 'file'"),
    ({"dsn": "postgresql://u@h/db", "pg_schema": "Bad-Name"}, "pg_schema must be"),
])
def test_bad_backend_configuration_is_refused(config: dict[str, Any], message: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad backend, a missing or malformed dsn, or a bad schema name is a ValueError saying what is allowed."""
    monkeypatch.delenv("CONTEXT_PERSISTENT_DSN", raising=False)
    with pytest.raises(ValueError, match=message):
        PersistentContextManager.check_config(config)


def test_dsn_comes_from_the_environment_and_selects_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend='postgres' takes its dsn from $CONTEXT_PERSISTENT_DSN; a dsn alone selects the postgres backend."""
    monkeypatch.setenv("CONTEXT_PERSISTENT_DSN", "postgresql://env@h/db")
    assert PersistentContextManager.check_config({"backend": "postgres"})["dsn"] == "postgresql://env@h/db"
    cfg = PersistentContextManager.check_config({"dsn": "postgresql://cfg@h/db"})
    assert (cfg["backend"], cfg["dsn"], cfg["pg_schema"]) == ("postgres", "postgresql://cfg@h/db", "context_persistent")
    assert PersistentContextManager.check_config({})["backend"] == "file"


def test_cli_reports_an_unreachable_server_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`db status` against a server that does not answer exits 1 with one line naming the address."""
    assert main(["db", "status", "--dsn", "postgresql://postgres@127.0.0.1:1/test"]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot connect to PostgreSQL at postgresql://postgres@127.0.0.1:1/test" in err and "\n" not in err


# -- schema ------------------------------------------------------------------------------------------
def test_cli_db_init_and_status(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`db init` creates a schema once (idempotent); `db status` reports its version and counts."""
    schema = f"cp_cli_{uuid.uuid4().hex[:8]}"
    try:
        assert main(["db", "status", "--dsn", pg_dsn, "--pg-schema", schema]) == 1
        assert "not created yet" in capsys.readouterr().out
        assert main(["db", "init", "--dsn", pg_dsn, "--pg-schema", schema, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["created"] is True
        assert main(["db", "init", "--dsn", pg_dsn, "--pg-schema", schema, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) | {"dsn": None} == {
            "dsn": None, "schema": schema, "version": 1, "created": False}
        assert main(["db", "status", "--dsn", pg_dsn, "--pg-schema", schema, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["version"], info["sessions"], info["events"], info["writers"]) == (1, 0, 0, [])
    finally:
        asyncio.run(execute(pg_dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


async def test_newer_schema_version_is_refused(pg_dsn: str, sid: str) -> None:
    """A database whose layout version is newer than this program's is refused clearly, for writers and readers."""
    schema = f"cp_ver_{uuid.uuid4().hex[:8]}"
    try:
        assert (await init_schema(pg_dsn, schema))["created"]
        await execute(pg_dsn, f"UPDATE {schema}.schema_version SET version = 99")
        for readonly in (False, True):
            with pytest.raises(UnsupportedFormatError, match="layout version 99, newer than this program's 1"):
                await PostgresEventLog.open(pg_dsn, sid, schema=schema, readonly=readonly)
    finally:
        await execute(pg_dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def test_records_are_stored_byte_for_byte(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """The events table holds exactly the file format's record lines (same envelope and checksum)."""
    written = lines(1, 3)
    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as log:
        await log.append(written, 1)
    rows = await execute(pg_dsn, f"SELECT record FROM {pg_schema}.events WHERE session_id = $1 ORDER BY seq", sid)
    assert [bytes(r["record"]) for r in rows] == written


# -- locking and fencing -------------------------------------------------------------------------------
async def test_locked_error_names_the_holder(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """The second writer's SessionLockedError names the holder's pid and host; db status lists the writer."""
    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as log:
        with pytest.raises(SessionLockedError) as e:
            await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
        assert e.value.pid == os.getpid()
        assert f"on host {socket.gethostname()}" in str(e.value)
        assert f"PostgreSQL backend pid {log.backend_pid}" in str(e.value)
        writers = (await status(pg_dsn, pg_schema))["writers"]
        assert [(w["session_id"], w["pid"]) for w in writers if w["session_id"] == sid] == [(sid, log.backend_pid)]


async def test_the_database_refuses_a_stale_append(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """If the log moved behind a writer's back, its append is refused with ConcurrencyError: no duplicate seq."""
    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as log:
        await log.append(lines(1, 2), 1)
        # Another writer appended seq 3 (e.g. while this one was cut off): move the log as it would.
        await execute(pg_dsn, f"INSERT INTO {pg_schema}.events VALUES ($1, 3, $2)", sid, lines(3, 1)[0])
        await execute(pg_dsn, f"UPDATE {pg_schema}.sessions SET last_seq = 3 WHERE session_id = $1", sid)
        with pytest.raises(ConcurrencyError, match="another writer appended; nothing was stored"):
            await log.append(lines(3, 1), 3)
        assert log.last_seq == 3
        await log.append(lines(4, 1), 4)
    assert await seqs(pg_dsn, pg_schema, sid) == [1, 2, 3, 4]


async def test_idle_connection_loss_reconnects_transparently(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """A writer whose idle connection was terminated re-takes its lock on the next append and goes on."""
    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as log:
        await log.append(lines(1, 1), 1)
        old = log.backend_pid
        await execute(pg_dsn, "SELECT pg_terminate_backend($1)", old)
        await wait_closed(log)
        await log.append(lines(2, 1), 2)
        assert log.backend_pid not in (None, old)
    assert await seqs(pg_dsn, pg_schema, sid) == [1, 2]


async def test_a_writer_that_lost_its_lock_is_fenced(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """After its connection dies and another worker takes over, the old writer's appends fail and store nothing."""
    old = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    await old.append(lines(1, 1), 1)
    await execute(pg_dsn, "SELECT pg_terminate_backend($1)", old.backend_pid)
    await wait_closed(old)
    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as new:
        await new.append(lines(2, 1), 2)
        for _ in range(2):
            with pytest.raises(SessionLockedError):
                await old.append(lines(2, 1), 2)
        await new.append(lines(3, 1), 3)
    await old.close()
    assert await seqs(pg_dsn, pg_schema, sid) == [1, 2, 3]


async def test_terminated_mid_append_stores_nothing_and_says_so(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """An append whose connection is killed while it runs raises DatabaseError(stored=False); the log is intact."""
    import asyncpg

    log = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    await log.append(lines(1, 1), 1)
    blocker = await asyncpg.connect(pg_dsn)
    try:
        tx = blocker.transaction()
        await tx.start()  # hold the session row so the append blocks inside its statement
        await blocker.execute(f"SELECT 1 FROM {pg_schema}.sessions WHERE session_id = $1 FOR UPDATE", sid)
        append = asyncio.create_task(log.append(lines(2, 1), 2))
        for _ in range(500):
            waiting = await blocker.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                                             log.backend_pid)
            if waiting == "Lock":
                break
            await asyncio.sleep(0.01)
        assert waiting == "Lock"
        assert await blocker.fetchval("SELECT pg_terminate_backend($1)", log.backend_pid)
        await tx.rollback()
    finally:
        await blocker.close()
    with pytest.raises(DatabaseError, match="nothing was stored; the log reconnected") as e:
        await append
    assert e.value.stored is False
    await log.append(lines(2, 1), 2)  # still the writer: the same seq goes in now
    await log.close()
    assert await seqs(pg_dsn, pg_schema, sid) == [1, 2]


# -- follow --------------------------------------------------------------------------------------------
async def test_follow_started_during_appends_misses_and_repeats_nothing(pg_dsn: str, pg_schema: str,
                                                                         sid: str) -> None:
    """A follower that starts (and catches up) while a writer keeps appending sees every seq exactly once."""
    writer = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    reader = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema, readonly=True)
    total = 150

    async def write() -> None:
        for first in range(1, total + 1, 3):
            await writer.append(lines(first, 3), first)

    async def follow() -> list[int]:
        got = []
        async for rec in reader.follow(0):
            got.append(rec["seq"])
            if rec["seq"] >= total:
                return got
        return got

    try:
        w = asyncio.create_task(write())
        await asyncio.sleep(0.01)
        got = await asyncio.wait_for(follow(), 30)
        await w
        assert got == list(range(1, total + 1))
    finally:
        await reader.close()
        await writer.close()


async def test_follow_survives_losing_its_connection(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """A follower whose listening connection is terminated reconnects and resumes after the last seq it gave."""
    writer = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    reader = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema, readonly=True)
    got: list[int] = []
    first_two = asyncio.Event()

    async def follow() -> None:
        async for rec in reader.follow(0):
            got.append(rec["seq"])
            if rec["seq"] == 2:
                first_two.set()
            if rec["seq"] == 6:
                return

    task = asyncio.create_task(follow())
    try:
        await writer.append(lines(1, 2), 1)
        await asyncio.wait_for(first_two.wait(), 10)
        (conn,) = reader._followers
        await execute(pg_dsn, "SELECT pg_terminate_backend($1)", conn.get_server_pid())
        await writer.append(lines(3, 2), 3)
        await asyncio.sleep(0.05)
        await writer.append(lines(5, 2), 5)
        await asyncio.wait_for(task, 10)
        assert got == [1, 2, 3, 4, 5, 6]
    finally:
        task.cancel()
        await reader.close()
        await writer.close()


# -- checkpoints ---------------------------------------------------------------------------------------
async def test_checkpoints_are_stored_in_the_database_and_used(pg_config: dict[str, Any], sid: str,
                                                               tmp_path: Any) -> None:
    """A postgres session writes its checkpoint to the checkpoints table and resumes from it with the same state."""
    cfg = {**pg_config, "checkpoint_every": 10}
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **cfg) as s:
        for i in range(35):
            await s.add_message({"role": "user", "content": str(i)})
        expected = await s.get_messages()
    for readonly in (False, True):
        rows = await execute(pg_config["dsn"], f"SELECT seq FROM {pg_config['pg_schema']}.checkpoints "
                                               "WHERE session_id = $1", sid)
        assert rows and rows[0]["seq"] >= 30
        async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, readonly=readonly,
                                                       **cfg) as s:
            assert s.stats()["checkpoint"]["loaded_seq"] == rows[0]["seq"]
            assert await s.get_messages() == expected
    assert not any(tmp_path.iterdir())  # nothing went to the file system


async def test_a_corrupt_database_checkpoint_is_ignored_and_removed(pg_config: dict[str, Any], sid: str,
                                                                   tmp_path: Any) -> None:
    """A damaged checkpoint row is never used: the session replays the log fully and the row is discarded."""
    cfg = {**pg_config, "checkpoint_every": 5}
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **cfg) as s:
        for i in range(12):
            await s.add_message({"role": "user", "content": str(i)})
        expected = await s.get_messages()
    table = f"{pg_config['pg_schema']}.checkpoints"
    await execute(pg_config["dsn"], f"UPDATE {table} SET payload = substring(payload from 1 for 40) "
                                    "WHERE session_id = $1", sid)
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid,
                                                   **{**cfg, "checkpoint_every": 1000}) as s:
        assert s.stats()["checkpoint"]["loaded_seq"] == 0
        assert "truncated" in s.stats()["checkpoint"]["ignored"] or "checksum" in s.stats()["checkpoint"]["ignored"]
        assert await s.get_messages() == expected
    assert await execute(pg_config["dsn"], f"SELECT 1 FROM {table} WHERE session_id = $1", sid) == []


async def test_writer_connection_carries_the_keepalive_settings(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """The writer's connection asks the server for TCP keepalive, which bounds takeover after a machine vanishes."""
    from context_persistent.storage.pg import WRITER_KEEPALIVE

    async with await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema) as log:
        rows = await execute(pg_dsn, "SELECT application_name FROM pg_stat_activity WHERE pid = $1", log.backend_pid)
        assert rows[0]["application_name"].startswith(f"context-persistent pid={os.getpid()}")
        for name, value in WRITER_KEEPALIVE.items():
            got = await log._conn.fetchval(f"SHOW {name}")
            assert got.rstrip("ms") == value or got == f"{int(value) // 1000}s", (name, got)


async def test_closing_the_log_ends_its_followers(pg_dsn: str, pg_schema: str, sid: str) -> None:
    """A follow() in progress ends (no error) when its log is closed, and its connection is released."""
    writer = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema)
    await writer.append(lines(1, 1), 1)
    reader = await PostgresEventLog.open(pg_dsn, sid, schema=pg_schema, readonly=True)
    got: list[int] = []

    async def follow() -> None:
        async for rec in reader.follow(0):
            got.append(rec["seq"])

    task = asyncio.create_task(follow())
    try:
        while not got:
            await asyncio.sleep(0.01)
        await reader.close()
        await asyncio.wait_for(task, 10)
        assert got == [1] and not reader._followers
    finally:
        task.cancel()
        await writer.close()


def test_cli_tail_after_reads_from_the_database_after_its_seq(pg_config: dict[str, str], sid: str, tmp_path: Any,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`tail --after SEQ` asks the database for the events after SEQ (the file backend's reading from the log's
    end does not apply); `tail -n N` prints the last N, read from the row before them (seqs are the rows'
    order, without gaps)."""
    async def fill() -> None:
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config)
        await store.add_messages([{"role": "user", "content": f"m{i}"} for i in range(8)])
        await store.close()
    asyncio.run(fill())
    asked: list[int] = []
    original = PostgresEventLog.read_batches

    def spy(self: Any, after_seq: int = 0, *args: Any, **kwargs: Any) -> Any:
        asked.append(after_seq)
        return original(self, after_seq, *args, **kwargs)
    monkeypatch.setattr(PostgresEventLog, "read_batches", spy)
    db = ["--dsn", pg_config["dsn"], "--pg-schema", pg_config["pg_schema"]]
    assert main(["tail", sid, "--after", "6", "--json", *db]) == 0
    assert [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()] == [7, 8, 9]
    assert asked == [6]
    assert main(["tail", sid, "-n", "2", "--json", *db]) == 0
    assert [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()] == [8, 9]
    assert asked == [6, 7]  # (the last N: from the row before them, not from the session's first)
    assert main(["tail", sid, "-n", "20", "--json", *db]) == 0
    assert [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()] == list(range(1, 10))
    assert asked == [6, 7, 0]


async def test_usage_reports_at_open_are_selected_not_read_with_the_whole_log(
        pg_config: dict[str, Any], sid: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The meter's rebuild at open asks PostgreSQL for the rows holding usage reports (storage/newest.py): it
    never reads the whole log for them, also when the caller wants their positions (a file log's list)."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config) as s:
        for turn in range(5):
            await s.add_message({"role": "user", "content": f"turn {turn}"})
            await s.record_usage({"input_tokens": 100 + turn, "output_tokens": 5}, provider="p", model="m",
                                 id=f"r{turn}")
    from context_persistent.storage import newest

    async def whole_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole log was read for the usage reports")
        yield  # (an async generator, as read_batches)

    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config,
                                                   readonly=True) as s:
        monkeypatch.setattr(PostgresEventLog, "read_batches", whole_read)
        where: list[int] = []
        found = await newest.newest_records(s._log, "usage_reported", 3, None, where)
        assert [r["data"]["id"] for r in found] == ["r2", "r3", "r4"] and where == []
        assert s.stats()["last_usage"]["id"] == "r4"
