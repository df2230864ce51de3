"""The EventLog contract, one suite run against every backend: the file log and the PostgreSQL log.

PostgreSQL cases skip with a one-line reason when no server is reachable (fail in CI; see pgfixtures.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import chained
import pytest
from pgfixtures import execute, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent.model import codec
from context_persistent.errors import (
    ConcurrencyError,
    ContextPersistentError,
    LogCorruptedError,
    SessionLockedError,
    SessionNotFoundError,
)
from context_persistent.storage.eventlog import EventLog
from context_persistent.storage.log import FileEventLog


class FileBackend:
    def __init__(self, root: Path) -> None:
        self.root = root

    async def open(self, session_id: str, *, readonly: bool = False, create: bool = True) -> Any:
        return FileEventLog(self.root / session_id, session_id, readonly=readonly, create=create)

    async def corrupt(self, session_id: str, seq: int) -> None:
        path = self.root / session_id / "events.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        lines[seq - 1] = lines[seq - 1].replace(b'"data":{', b'"data":{"x":1,', 1)
        path.write_bytes(b"".join(lines))


class PostgresBackend:
    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema

    async def open(self, session_id: str, *, readonly: bool = False, create: bool = True) -> Any:
        from context_persistent.storage.pg import PostgresEventLog

        return await PostgresEventLog.open(self.dsn, session_id, schema=self.schema, readonly=readonly,
                                           create=create)

    async def corrupt(self, session_id: str, seq: int) -> None:
        await execute(self.dsn, f"UPDATE {self.schema}.events SET record = convert_to(replace(convert_from("
                                f"record, 'UTF8'), '\"data\":{{', '\"data\":{{\"x\":1,'), 'UTF8') "
                                "WHERE session_id = $1 AND seq = $2", session_id, seq)


@pytest.fixture(params=["file", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "file":
        return FileBackend(tmp_path / "store")
    return PostgresBackend(request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema"))


SID = ""


@pytest.fixture(autouse=True)
def _chain_of(sid: str) -> None:
    global SID
    SID = sid


def lines(first: int, n: int, tag: str = "m") -> list[bytes]:
    """Records of the test's session, chained (each names the one before it; tests/chained.py)."""
    return chained.lines(SID, first, n, tag)


async def read_all(log: Any, after_seq: int = 0, **kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for batch in log.read_batches(after_seq, **kw):
        out.extend(batch)
    return out


async def test_satisfies_the_protocol(backend: Any, sid: str) -> None:
    """Each backend is an EventLog with the documented attributes, fresh sessions not marked as existing."""
    log = await backend.open(sid)
    try:
        assert isinstance(log, EventLog)
        assert (log.session_id, log.readonly, log.existed, log.last_seq) == (sid, False, False, 0)
    finally:
        await log.close()


async def test_append_then_read_back_in_order(backend: Any, sid: str) -> None:
    """Appended records come back verified, in seq order, across batch boundaries and a reopen."""
    written = lines(1, 3) + lines(4, 7)
    log = await backend.open(sid)
    await read_all(log)
    await log.append(written[:3], 1)
    await log.append(written[3:], 4)
    assert log.last_seq == 10
    await log.close()
    log = await backend.open(sid)
    try:
        assert log.existed
        batches = [b async for b in log.read_batches(batch=4)]
        assert [len(b) for b in batches] == [4, 4, 2]
        assert [r for b in batches for r in b] == [codec.decode(x) for x in written]
        assert log.last_seq == 10
        assert [r["seq"] for r in await read_all(log, 7)] == [8, 9, 10]
        assert [r["seq"] for r in await read_all(log, 7, position=log.position)] == [8, 9, 10]
    finally:
        await log.close()


async def test_wrong_expected_seq_is_a_concurrency_error_and_stores_nothing(backend: Any, sid: str) -> None:
    """Appending with a first seq other than last_seq + 1 raises ConcurrencyError; the log is unchanged."""
    log = await backend.open(sid)
    try:
        await read_all(log)
        await log.append(lines(1, 2), 1)
        for first in (1, 2, 4):
            with pytest.raises(ConcurrencyError):
                await log.append(lines(first, 1, "dup"), first)
        await log.append(lines(3, 1), 3)
        assert [r["seq"] for r in await read_all(log)] == [1, 2, 3]
    finally:
        await log.close()


async def test_second_writer_is_locked_out_and_readers_are_not(backend: Any, sid: str) -> None:
    """While a writer holds a session another writer gets SessionLockedError; readers open freely."""
    writer = await backend.open(sid)
    await read_all(writer)
    await writer.append(lines(1, 2), 1)
    with pytest.raises(SessionLockedError) as e:
        await backend.open(sid)
    assert sid in str(e.value)
    reader = await backend.open(sid, readonly=True)
    assert [r["seq"] for r in await read_all(reader)] == [1, 2]
    with pytest.raises(ContextPersistentError):
        await reader.append(lines(3, 1), 3)
    await reader.close()
    await writer.close()
    again = await backend.open(sid)  # the lock went with the writer
    try:
        await read_all(again)
        await again.append(lines(3, 1), 3)
    finally:
        await again.close()


async def test_missing_session_is_not_found_for_readers_and_create_false(backend: Any, sid: str) -> None:
    """A read-only open, or a writer open with create=False, of a session that does not exist fails clearly."""
    with pytest.raises(SessionNotFoundError):
        await backend.open(sid, readonly=True)
    with pytest.raises(SessionNotFoundError):
        await backend.open(sid, create=False)
    log = await backend.open(sid)  # and the failed opens left no lock behind
    await log.close()


async def test_close_is_idempotent_and_later_appends_fail(backend: Any, sid: str) -> None:
    """close() may be called twice; an append after close raises a ContextPersistentError."""
    log = await backend.open(sid)
    await read_all(log)
    await log.append(lines(1, 1), 1)
    await log.close()
    await log.close()
    with pytest.raises(ContextPersistentError):
        await log.append(lines(2, 1), 2)


async def test_corrupt_record_in_the_middle_is_reported_not_skipped(backend: Any, sid: str) -> None:
    """A record that fails its checksum before the end raises LogCorruptedError naming it; nothing is skipped."""
    log = await backend.open(sid)
    await read_all(log)
    await log.append(lines(1, 4), 1)
    await log.close()
    await backend.corrupt(sid, 2)
    reader = await backend.open(sid, readonly=True)
    try:
        with pytest.raises(LogCorruptedError) as e:
            await read_all(reader)
        assert "checksum" in str(e.value)
    finally:
        await reader.close()


async def test_follow_sees_existing_then_new_records_once(backend: Any, sid: str) -> None:
    """follow() from a reader yields records after the given seq, then other writers' appends, no gap or repeat."""
    writer = await backend.open(sid)
    await read_all(writer)
    await writer.append(lines(1, 3), 1)
    reader = await backend.open(sid, readonly=True)
    seen: list[int] = []

    async def consume() -> None:
        async for rec in reader.follow(after_seq=1):
            seen.append(rec["seq"])
            if rec["seq"] == 12:
                return

    task = asyncio.create_task(consume())
    try:
        for first in range(4, 13, 3):
            await asyncio.sleep(0.02)
            await writer.append(lines(first, 3), first)
        await asyncio.wait_for(task, 20)
        assert seen == list(range(2, 13))
    finally:
        task.cancel()
        await reader.close()
        await writer.close()
