"""Concurrency at the seams of erase (#28, 6, 7, 9): appends racing an erase, an appender that never stops, and
readers iterating across an erase."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401


async def _filled(storage: Path, session_id: str = "s", n: int = 20, **cfg: Any) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session_id, **cfg)
    for i in range(n):
        await store.add_message({"role": "user", "content": f"m{i} " + "x" * 100})
    return store


async def _appending(store: PersistentContextManager, tasks: int, acked: list[str], stop: asyncio.Event
                     ) -> list[asyncio.Future[None]]:
    async def appender(k: int) -> None:
        i = 0
        while not stop.is_set():
            text = f"loop {k}.{i}"
            await store.add_message({"role": "user", "content": text})
            acked.append(text)
            i += 1

    return [asyncio.ensure_future(appender(k)) for k in range(tasks)]


@pytest.mark.postgres
async def test_appends_during_erases_on_postgres_are_kept_and_later_appends_work(
        pg_config: dict[str, str], sid: str, tmp_path: Path) -> None:
    """add_message calls running during erase() on PostgreSQL are stored, the state follows the log, and every
    later append succeeds (no ConcurrencyError), also after reopening."""
    store = await _filled(tmp_path, sid, 6, **pg_config)
    acked: list[str] = []
    stop = asyncio.Event()
    tasks = await _appending(store, 3, acked, stop)
    for seq in (3, 4, 5, 6):
        await asyncio.sleep(0.02)
        await store.erase(seq=seq)
    stop.set()
    await asyncio.gather(*tasks)
    await store.add_message({"role": "user", "content": "after"})
    got = [m["content"] for m in await store.get_messages()]
    assert sorted(c for c in got if c.startswith("loop")) == sorted(acked) and got[-1] == "after"
    await store.close()
    again = await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config)
    assert [m["content"] for m in await again.get_messages()] == got
    await again.close()


async def test_an_erase_racing_inline_appends_keeps_every_append(tmp_path: Path) -> None:
    """With the file log (inline appends), appends racing an erase are all in the history and in the log."""
    store = await _filled(tmp_path, n=6)
    racing = [store.add_message({"role": "user", "content": f"racing {i}"}) for i in range(5)]
    await asyncio.gather(store.erase(seq=3), *racing)
    got = [m["content"] for m in await store.get_messages()]
    await store.close()
    again = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert [m["content"] for m in await again.get_messages()] == got and sum(c.startswith("racing") for c in got) == 5
    await again.close()


async def test_a_task_that_keeps_appending_does_not_starve_erase_or_close(tmp_path: Path) -> None:
    """With fsync batch, erase() and close() return while other tasks append without pause."""
    await _not_starved(tmp_path, "s", fsync="batch")


@pytest.mark.postgres
async def test_appenders_do_not_starve_erase_or_close_on_postgres(pg_config: dict[str, str], sid: str,
                                                                 tmp_path: Path) -> None:
    """On PostgreSQL (group commit, appends that wait on the server), erase() and close() return while other
    tasks append without pause."""
    await _not_starved(tmp_path, sid, **pg_config)


async def _not_starved(tmp_path: Path, session_id: str, **cfg: Any) -> None:
    store = await _filled(tmp_path, session_id, n=4, **cfg)
    stop = asyncio.Event()
    acked: list[str] = []
    tasks = await _appending(store, 4, acked, stop)
    await asyncio.sleep(0.05)
    receipt = await asyncio.wait_for(store.erase(seq=3), 10)
    assert receipt["records"] and len(acked) > 0
    n = len(acked)
    await asyncio.sleep(0.05)
    assert len(acked) > n  # (the appender went on after the erase)
    closing = asyncio.ensure_future(store.close())
    await asyncio.wait_for(asyncio.shield(closing), 10)  # (the appenders still run: their next append fails)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    again = await PersistentContextManager.open(storage_path=tmp_path, session_id=session_id, **cfg)
    contents = [m["content"] for m in await again.get_messages()]
    assert sorted(c for c in contents if c.startswith("loop")) == sorted(acked)
    await again.close()


@pytest.mark.parametrize("erased", ["behind", "ahead"])
async def test_iter_messages_goes_on_across_an_erase(tmp_path: Path, erased: str) -> None:
    """An iteration running across an erase raises nothing: it yields the history it began with, less the
    erased message when it had not reached it yet."""
    store = await _filled(tmp_path, n=300, page_cache_bytes=0)
    before = await store.get_messages()
    seen = []
    async for m in store.iter_messages(chunk=20):
        seen.append(m)
        if len(seen) == 100:
            await store.erase(seq=10 if erased == "behind" else 249)  # (m8 or m247: the tombstone moves what follows)
    want = before if erased == "behind" else [m for m in before if not m["content"].startswith("m247 ")]
    assert seen == want
    await store.close()


@pytest.mark.postgres
async def test_iter_messages_on_postgres_goes_on_across_an_erase(pg_config: dict[str, str], sid: str,
                                                                  tmp_path: Path) -> None:
    """The same on PostgreSQL: the iteration reads the rows after the erase without an error."""
    store = await _filled(tmp_path, sid, 120, page_cache_bytes=0, **pg_config)
    before = await store.get_messages()
    seen = []
    async for m in store.iter_messages(chunk=20):
        seen.append(m)
        if len(seen) == 30:
            await store.erase(seq=99)
    assert seen == [m for m in before if not m["content"].startswith("m97 ")]
    await store.close()


async def _in_pages(dsn: str, table: str, token: bytes) -> bool:
    """Whether any page of ``table`` (its heap file, dead row versions and free space included) holds ``token``
    (pageinspect reads the raw pages)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        await conn.execute("CHECKPOINT")
        pages = await conn.fetchval("SELECT pg_relation_size($1::regclass) / 8192", table)
        for i in range(pages):
            if token in bytes(await conn.fetchval("SELECT get_raw_page($1, $2::int)", table, i)):
                return True
        return False
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_erase_on_postgres_leaves_old_row_versions_until_vacuum_full(pg_config: dict[str, str], sid: str,
                                                                          tmp_path: Path) -> None:
    """After a plain erase the old row version still holds the bytes in the table's pages (the receipt says so);
    vacuum="full" removes them from the pages; a file store refuses vacuum."""
    token = b"VACUUMTOKEN" + sid.encode()
    # A schema of its own: another test's VACUUM (FULL) of a shared events table would clean the old row version
    # this test looks for, whatever the store did.
    pg_config = {**pg_config, "pg_schema": f"cp_vacuum_{sid.replace('-', '_')}"}
    table = f"{pg_config['pg_schema']}.events"
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config)
    for text in ("one", f"secret {token.decode()}", "two", f"again {token.decode()}"):
        await store.add_message({"role": "user", "content": text})
    receipt = await store.erase(seq=3)
    assert "dead row versions" in {n["what"] for n in receipt["not_covered"]} and "vacuum" not in receipt
    assert await _in_pages(pg_config["dsn"], table, b"secret " + token)  # (what the receipt says remains)
    receipt = await store.erase(seq=5, vacuum="full")
    assert receipt["vacuum"]["command"] == "VACUUM (FULL)" and await store.verify_erasure(receipt) == []
    assert "dead row versions" not in {n["what"] for n in receipt["not_covered"]}
    assert not await _in_pages(pg_config["dsn"], table, token)
    await store.add_message({"role": "user", "content": "after"})
    assert [m["content"] for m in await store.get_messages()] == ["one", "two", "after"]
    with pytest.raises(ValueError, match="vacuum must be"):
        await store.erase(seq=2, vacuum="yes")
    await store.close()
    import asyncpg

    conn = await asyncpg.connect(pg_config["dsn"])
    try:
        await conn.execute(f"DROP SCHEMA {pg_config['pg_schema']} CASCADE")
    finally:
        await conn.close()
    file_store = await _filled(tmp_path, "f", 2)
    with pytest.raises(ValueError, match="PostgreSQL backend only"):
        await file_store.erase(seq=2, vacuum=True)
    await file_store.close()
