"""The search index's part in an erasure (docs/search.md, "Erasure"): only what the erasure changed is
brought in line with the new log (the erased documents removed, the positions after each tombstone and the
anchor moved), and the index is then exactly what indexing the new log from scratch gives (documents and
anchor), on a single-file log, a segmented one, a compressed one, after segment expiry and on PostgreSQL.
Where that cannot be shown (a redacted message erased, an index behind the log, an anchor the new log does not
hold) the session is indexed again whole, with the same result; and a process killed between the two steps
leaves a marker the next catch-up resolves by indexing the session from the new log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.retention import RetentionPolicy
from context_persistent.operations import trash
from context_persistent.operations.search import indexer
from context_persistent.operations.search.file_listing import signature
from context_persistent.operations.search.indexer import catch_up_storage, rebuild_pg
from context_persistent.operations.search.pg_index import PgIndex
from context_persistent.operations.search.sqlite_index import SqliteIndex, discard, index_path
from pgfixtures import pg_dsn, run_sql  # noqa: F401
from search_backends import fresh_schema


class _File:
    def __init__(self, storage: Path, tmp: Path, **config: Any) -> None:
        self.storage, self.tmp, self.config = storage, tmp, config
        self.n = 0

    async def open(self, sid: str, **config: Any) -> PersistentContextManager:
        return await PersistentContextManager.open(storage_path=self.storage, session_id=sid,
                                                   **{**self.config, **config})

    async def current(self, sid: str) -> dict[str, Any]:
        """The index as the erase left it (no catch-up), its session row's signature checked against the log."""
        index = SqliteIndex(self.storage)
        try:
            [row] = [r for r in index.sessions() if r["session_id"] == sid]
            assert row["signature"] == signature(self.storage / sid)
            return index.contents()
        finally:
            index.close()

    async def scratch(self) -> dict[str, Any]:
        """An index built from the logs alone, in a file of its own."""
        self.n += 1
        path = self.tmp / f"scratch-{self.n}.sqlite3"
        index = SqliteIndex(self.storage, path)
        try:
            await catch_up_storage(index)
            return index.contents()
        finally:
            index.close()
            discard(path)

    def index_bytes(self) -> bytes:
        folder = index_path(self.storage).parent
        return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


class _Pg:
    def __init__(self, dsn: str, schema: str, tmp: Path) -> None:
        self.dsn, self.schema, self.tmp = dsn, schema, tmp

    async def open(self, sid: str, **config: Any) -> PersistentContextManager:
        return await PersistentContextManager.open(storage_path=self.tmp, session_id=sid, backend="postgres",
                                                   dsn=self.dsn, pg_schema=self.schema, **config)

    async def _contents(self) -> dict[str, Any]:
        index = PgIndex(self.dsn, self.schema)
        try:
            return await index.contents()
        finally:
            await index.aclose()

    async def current(self, sid: str) -> dict[str, Any]:
        return await self._contents()

    async def scratch(self) -> dict[str, Any]:
        """Every session indexed again from its rows (in place: the tables are the schema's)."""
        await rebuild_pg(self.dsn, self.schema)
        return await self._contents()


@pytest.fixture(params=["file", "segmented", "compressed", "postgres"])
def side(request: pytest.FixtureRequest, storage: Path, tmp_path: Path) -> Iterator[Any]:
    if request.param == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        schema = fresh_schema()
        yield _Pg(dsn, schema, tmp_path)
        run_sql(dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        return
    config: dict[str, Any] = {}
    if request.param != "file":
        config = {"segment_bytes": 4096, "compress_sealed": request.param == "compressed"}
    yield _File(storage, tmp_path, **config)


@pytest.fixture
def reindexed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sessions indexed again whole (indexer._reindex), by this process."""
    calls: list[str] = []
    real = indexer._reindex

    async def counted(index: Any, log: Any, sig: Any, out: Any) -> None:
        calls.append(log.session_id)
        await real(index, log, sig, out)
    monkeypatch.setattr(indexer, "_reindex", counted)
    return calls


async def _settled(store: PersistentContextManager) -> None:
    """The writer's index thread done with what was appended (as erase itself waits for it)."""
    if store._s.indexer is not None:
        await store._s.indexer.wait(store.session_id)


def _text(i: int) -> str:
    return f"w{i}z " + "filler " * (i * 7 % 80)  # (lengths vary: tombstones longer and shorter than records)


async def _erased(side: Any, store: PersistentContextManager, reindexed: list[str], *, whole: bool | None = False,
                  **which: Any) -> dict[str, Any]:
    """Erase, then check the receipt's index entry and that the index equals one built from scratch."""
    await _settled(store)
    reindexed.clear()
    receipt = await store.erase(**which)
    entry = receipt["index"]
    assert entry["action"] == "purged" and entry["session_indexed_again"] is (bool(reindexed) if whole is None else
                                                                             whole), entry
    assert whole is None or bool(reindexed) is whole
    if not entry["session_indexed_again"]:
        assert entry["documents_indexed_again"] == 0
    assert await store.verify_erasure(receipt) == []
    assert await side.current(store.session_id) == await side.scratch()
    return receipt


async def test_an_erase_moves_only_what_changed_and_equals_an_index_built_from_scratch(
        side: Any, reindexed: list[str]) -> None:
    """Erasing a message with a copy in a replacement, one after it, a pinned one and a tool call: each time
    only the erased documents leave (documents_removed), nothing is indexed again, and the index (documents,
    positions, anchor, ``ls`` facts and signature) is what a build from the new log gives."""
    async with await side.open("e") as store:
        await store.add_message({"role": "system", "content": "be brief"})
        for i in range(30):
            await store.add_message({"role": "user" if i % 2 else "assistant", "content": _text(i)})
        await store.pin(4)
        await store.replace_messages((await store.get_messages())[:25] + [{"role": "user", "content": "w100z new"}])
        for i in range(30, 40):
            await store.add_message({"role": "user" if i % 2 else "assistant", "content": _text(i)})
        await store.add_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "w200z"}'}}]})
        await _settled(store)
        assert await side.current("e") == await side.scratch()
        # seq 4 (index 2 of the history): held by its record and carried by the replacement
        receipt = await _erased(side, store, reindexed, seq=4)
        assert len(receipt["records"]) == 2 and receipt["index"]["documents_removed"] == 2
        receipt = await _erased(side, store, reindexed, message_index=30)  # (after the replacement)
        assert receipt["index"]["documents_removed"] == 1
        await _erased(side, store, reindexed, message_index=4)  # (the pinned one)
        await _erased(side, store, reindexed, message_index=len(await store.get_messages()) - 1)  # (tool call)
        # (the system prompt, the first message: every position after it moves; indexed again whole or not as
        # the leading system messages decide)
        await _erased(side, store, reindexed, whole=None, seq=2)
        await store.add_message({"role": "user", "content": "w300z after the erasures"})
        await _settled(store)
    assert await side.current("e") == await side.scratch()


async def test_an_erase_after_segment_expiry_equals_an_index_built_from_scratch(
        storage: Path, tmp_path: Path, reindexed: list[str]) -> None:
    """A pinned message carried by an ``expired`` record (its own record in the trash): the tombstone of the
    ``expired`` record moves what follows it, and the index equals one built from the new log."""
    side = _File(storage, tmp_path, segment_bytes=4096)
    async with await side.open("x") as store:
        for i in range(60):
            await store.add_message({"role": "user", "content": _text(i)})
        await store.pin(2)
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    async with await side.open("x") as store:
        await store.add_message({"role": "user", "content": "w500z later"})
        await _settled(store)
        assert await side.current("x") == await side.scratch()
        await _erased(side, store, reindexed, message_index=0)  # (the pinned one: carried)
        await _erased(side, store, reindexed, message_index=3)


async def test_where_the_changes_alone_cannot_be_trusted_the_session_is_indexed_again_whole(
        side: Any, reindexed: list[str]) -> None:
    """A message redacted before it is erased (messages hidden as identical to it may show again), an index
    behind the log (``search_index: false``), and an anchor the new log does not hold: the session is indexed
    again whole, and the index still equals one built from scratch."""
    async with await side.open("f") as store:
        for i in range(12):
            await store.add_message({"role": "user", "content": _text(i)})
        await store.redact(2)  # (seq 4: seq 1 starts the session)
        await _erased(side, store, reindexed, whole=True, seq=4)
        await _erased(side, store, reindexed, seq=7)  # (another message: only what changed again)
    async with await side.open("f", search_index=False) as store:
        await store.add_message({"role": "user", "content": "w600z not indexed yet"})
        await _erased(side, store, reindexed, whole=True, seq=9)
    if isinstance(side, _File):  # (an anchor the new log does not hold: the row's position made wrong)
        index = SqliteIndex(side.storage)
        try:
            index.db.execute("UPDATE sessions SET position = position - 1 WHERE session_id = 'f'")
        finally:
            index.close()
        async with await side.open("f") as store:
            await _erased(side, store, reindexed, whole=True, seq=11)


async def test_an_erase_that_moves_other_messages_out_of_the_views_indexes_the_session_again(
        side: Any, reindexed: list[str]) -> None:
    """``system_prompt_set`` replaces the leading system messages: with the user message between two system
    messages erased, the second one becomes leading and is replaced too, so it leaves the views. The keys
    after are not those before less the erased one: the session is indexed again whole, as from scratch."""
    async with await side.open("p") as store:
        await store.add_message({"role": "system", "content": "w1z first prompt"})
        await store.add_message({"role": "user", "content": "w2z between"})
        await store.add_message({"role": "system", "content": "w3z second system"})
        await store.add_message({"role": "user", "content": "w4z question"})

        async def factory() -> str:
            return "w5z the new prompt"

        await store.set_system_prompt_factory(factory)
        await store.get_messages_for_request(token_budget=3000)
        await store.set_system_prompt_factory(None)
        assert [m["content"] for m in await store.get_messages()] == [
            "w5z the new prompt", "w2z between", "w3z second system", "w4z question"]
        await _erased(side, store, reindexed, whole=True, message_index=1)
        assert [m["content"] for m in await store.get_messages()] == ["w5z the new prompt", "w4z question"]


async def test_an_erase_that_fails_before_its_commit_leaves_the_index_as_the_unchanged_log(
        storage: Path, tmp_path: Path, reindexed: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The log cannot be replaced (the rename fails: nothing was changed): the documents removed before come
    back, the session is indexed again whole from the unchanged log, and no marker is left."""
    from context_persistent.storage.log import FileEventLog

    side = _File(storage, tmp_path)
    async with await side.open("u") as store:
        for i in range(8):
            await store.add_message({"role": "user", "content": _text(i)})
        await _settled(store)

        def refused(self: Any, new: Path, size: int) -> None:
            raise OSError("rename refused")
        monkeypatch.setattr(FileEventLog, "swap_in", refused)
        reindexed.clear()
        with pytest.raises(OSError, match="rename refused"):
            await store.erase(seq=4)
        assert reindexed == ["u"]
        assert await side.current("u") == await side.scratch()
        index = SqliteIndex(storage)
        try:
            assert await index.holds("u", 4 << 20) and not await index.erasing("u")
        finally:
            index.close()


_CHILD = """
import asyncio, os, signal, sys
from context_persistent import PersistentContextManager
from context_persistent.operations.search import erasing, sqlite_index, pg_index

where = sys.argv[1]
if where == "after":  # killed once the log is erased, before the index is brought in line
    async def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    erasing._after = killed
else:  # killed inside the index's last transaction (documents moved, row not saved)
    async def killed(self, row):
        os.kill(os.getpid(), signal.SIGKILL)
    sqlite_index.SqliteIndex.save_session = pg_index.PgIndex.save_session = killed

async def main():
    config = {"storage_path": sys.argv[2]}
    if len(sys.argv) > 3:
        config.update(backend="postgres", dsn=sys.argv[3], pg_schema=sys.argv[4])
    store = await PersistentContextManager.open(session_id="k", search_index=False, **config)
    await store.erase(seq=4, reason="killed")
asyncio.run(main())
"""


@pytest.mark.parametrize("side", ["file", "segmented", "postgres"], indirect=True)  # (compressed: as segmented)
@pytest.mark.parametrize("where", ["after", "inside"])
async def test_a_process_killed_between_the_log_and_the_index_leaves_what_the_next_catch_up_resolves(
        side: Any, where: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """SIGKILLed after the new log is committed and before (or while) the index is brought in line with it:
    the erased message's words are in no byte of the index files (file backend) and in no document, the marker
    stays, and the next catch-up (its process gone) indexes the session from the new log: the index then
    equals one built from scratch."""
    async with await side.open("k") as store:
        for i in range(20):
            await store.add_message({"role": "user", "content": _text(i)})
    args = [sys.executable, "-c", _CHILD, where, str(getattr(side, "storage", tmp_path))]
    if isinstance(side, _Pg):
        args += [side.dsn, side.schema]
    done = subprocess.run(args, env=subprocess_env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    async with await side.open("k", readonly=True) as store:
        assert "w2z" not in str(await store.get_messages())  # (the log was erased: seq 4)
    if isinstance(side, _File):
        assert b"w2z" not in side.index_bytes()
        index = SqliteIndex(side.storage)
        try:
            assert await index.erasing("k") and not await index.holds("k", 4 << 20)
            await catch_up_storage(index)
            assert not await index.erasing("k")
            assert index.contents() == await side.scratch()
        finally:
            index.close()
    else:
        index = PgIndex(side.dsn, side.schema)
        try:
            assert await index.erasing("k") and not await index.holds("k", 4 << 20)
            await indexer.catch_up_session(index, "k")
            assert not await index.erasing("k")
            before = await index.contents()
        finally:
            await index.aclose()
        assert before == await side.scratch()
