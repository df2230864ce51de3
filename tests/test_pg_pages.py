"""Bounded memory on PostgreSQL: the history holds refs (the messages' keys) and reads the messages back
through pg/pages.PostgresMessageReader (its own connection, a bounded cache), with results identical to the
file backend's; checkpoints store refs; lost connections, damaged or missing rows, erasure and retention."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from pgfixtures import execute, pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import decode
from context_persistent.errors import DatabaseError, RecordCorruptedError, StoreClosedError
from context_persistent.storage.pg.pages import PostgresMessageReader
from context_persistent.model.projection import LazyList, PagedList
from context_persistent.model.retention import RetentionPolicy

from strategies import tool_turns

pytestmark = pytest.mark.postgres

CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)


def _messages(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "x" * 1000}
            for i in range(n)]


async def _open(storage: Path, sid: str, cfg: dict[str, Any], **kw: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=sid, **{**CONFIG, **cfg, **kw})


def _pager(store: PersistentContextManager) -> PostgresMessageReader:
    pager = store._s.pager
    assert isinstance(pager, PostgresMessageReader)
    return pager


def _refs_only(store: PersistentContextManager) -> None:
    """The history holds no message: one int per message, the message's key (a lazily opened history is
    loaded first)."""
    messages = store._state.messages
    if type(messages) is LazyList:
        messages = messages._all()
    assert type(messages) is PagedList
    assert all(type(v) is int for v in messages.items)
    assert messages.items == list(store._state.keys)


async def test_history_holds_keys_and_the_cache_stays_within_its_budget(storage: Path, sid: str,
                                                                        pg_config: dict[str, Any]) -> None:
    budget = 64_000
    added = _messages(600)  # about 620 KB of messages: ten times the cache
    async with await _open(storage, sid, pg_config, page_cache_bytes=budget) as store:
        await store.add_messages(added[:300])
        for m in added[300:]:
            await store.add_message(m)
        pager = _pager(store)
        _refs_only(store)
        assert pager.held_bytes <= budget
        seen = []
        async for m in store.iter_messages(chunk=50):
            seen.append(m)
            assert pager.held_bytes <= budget
        assert seen == added
        assert await store.get_messages() == added
        assert pager.held_bytes <= budget and pager.reads > 0
    rows = await execute(pg_config["dsn"], f"SELECT payload FROM {pg_config['pg_schema']}.checkpoints "
                         "WHERE session_id = $1", sid)
    assert len(rows) == 1
    cp = decode(bytes(rows[0]["payload"]))
    assert cp.state is not None and all(type(m) is int for m in cp.state["messages"])  # refs, no message inline
    async with await _open(storage, sid, pg_config, page_cache_bytes=budget) as store:
        _refs_only(store)
        pager = _pager(store)
        assert pager.reads == 0 and pager.held_bytes == 0
        assert store.stats()["checkpoint"]["loaded_seq"] == store.head_seq
        assert store._state.messages[7] == added[7]
        assert await store.get_messages() == added
        assert pager.held_bytes <= budget


async def _history(store: PersistentContextManager) -> None:
    """The same history on either backend: a set_messages, tool turns, a system prompt change, pins, a
    redaction and an erasure."""
    await store.set_messages([{"role": "system", "content": "You are helpful."}, *tool_turns(3)])
    await store.add_messages(tool_turns(40, size=200))
    await store.pin(5)
    await store.pin(seq=store.head_seq - 3)
    await store.redact(9)
    await store.erase(11, reason="asked")
    for m in _messages(30):
        await store.add_message(m)


async def _facts(store: PersistentContextManager, at: int) -> dict[str, Any]:
    stats = store.stats()
    past = await store.at(at)
    try:
        past_messages = await past.get_messages()
    finally:
        await past.close()
    return {
        "messages": await store.get_messages(),
        "conversation": await store.get_conversation_view(),
        "reasoning": await store.get_reasoning_view(),
        "request": await store.get_messages_for_request(token_budget=3000),
        "tokens": await store.get_token_count(),
        "stats": {k: stats[k] for k in ("head_seq", "messages", "pinned", "events")},
        "last_compaction": {k: v for k, v in (store.stats()["last_compaction"] or {}).items() if k != "ts"},
        "at": past_messages,
    }


def _exported(path: Path) -> list[str]:
    return path.read_text().splitlines()[1:]  # (the header names the backend's path)


async def test_views_compaction_stats_export_and_time_travel_match_the_file_backend(
        tmp_path: Path, sid: str, pg_config: dict[str, Any]) -> None:
    results = []
    for cfg in ({}, pg_config):
        storage = tmp_path / ("pg" if cfg else "file")
        storage.mkdir()
        async with await _open(storage, sid, cfg, page_cache_bytes=20_000, checkpoint_every=50) as store:
            await _history(store)
            at = store.head_seq - 20
            facts = await _facts(store, at)
            await store.export(storage / "out.jsonl", format="jsonl")
            facts["export"] = _exported(storage / "out.jsonl")
            if cfg:
                _refs_only(store)
        async with await _open(storage, sid, cfg, page_cache_bytes=20_000) as store:  # from its checkpoint
            assert store.stats()["checkpoint"]["loaded_seq"] > 0
            again = await _facts(store, at)
            if cfg:
                _refs_only(store)
        assert again["messages"] == facts["messages"] and again["at"] == facts["at"]
        results.append(facts)
    file, pg = results
    assert len(file["messages"]) > 150 and file["last_compaction"]
    assert pg == file


async def test_a_lost_connection_during_a_read_is_opened_again(storage: Path, sid: str,
                                                               pg_config: dict[str, Any]) -> None:
    added = _messages(40)
    async with await _open(storage, sid, pg_config) as store:
        await store.add_messages(added)
        pager = _pager(store)
        pager.clear()
        assert store._state.messages[3] == added[3] and pager.connects == 1
        await execute(pg_config["dsn"], "SELECT pg_terminate_backend($1)", pager.backend_pid)
        pager.clear()
        assert store._state.messages[4] == added[4]
        assert pager.connects == 2  # (the read found the connection gone, reconnected and read again)
        # The server cannot be reached: a clear error, and the reader recovers once it can.
        dsn, pager.dsn, pager.window = pager.dsn, "postgresql://postgres@127.0.0.1:1/test", 0.3
        await execute(pg_config["dsn"], "SELECT pg_terminate_backend($1)", pager.backend_pid)
        pager.clear()
        with pytest.raises(DatabaseError, match="cannot connect"):
            store._state.messages[5]
        pager.dsn = dsn
        assert await store.get_messages() == added


async def test_a_damaged_or_missing_row_is_an_error_never_skipped(storage: Path, sid: str,
                                                                  pg_config: dict[str, Any]) -> None:
    schema = pg_config["pg_schema"]
    added = _messages(10)
    async with await _open(storage, sid, pg_config) as store:
        await store.add_messages(added)
        pager = _pager(store)
        rows = {r["seq"]: bytes(r["record"]) for r in await execute(
            pg_config["dsn"], f"SELECT seq, record FROM {schema}.events WHERE session_id = $1", sid)}
        key = store._state.keys[2]
        seq = key >> 20
        update = f"UPDATE {schema}.events SET record = $3 WHERE session_id = $1 AND seq = $2"
        await execute(pg_config["dsn"], update, sid, seq, rows[seq].replace(b"message 2 ", b"message X "))
        pager.clear()
        with pytest.raises(RecordCorruptedError, match=f"seq {seq} is corrupt.*fails verification"):
            store._state.messages[2]
        with pytest.raises(RecordCorruptedError):
            await store.get_messages()
        await execute(pg_config["dsn"], update, sid, seq, rows[seq + 1])  # another seq's record
        with pytest.raises(RecordCorruptedError, match=f"says seq {seq + 1}"):
            store._state.messages[2]
        await execute(pg_config["dsn"], f"DELETE FROM {schema}.events WHERE session_id = $1 AND seq = $2", sid,
                      seq)
        with pytest.raises(RecordCorruptedError, match="no record with this seq is stored"):
            await store.get_messages()
        assert store._state.messages[3] == added[3]


async def test_erasure_clears_the_cache(storage: Path, sid: str, pg_config: dict[str, Any]) -> None:
    added = _messages(20)
    async with await _open(storage, sid, pg_config) as store:
        await store.add_messages(added)
        assert store._state.messages[6] == added[6]  # (in the cache)
        await store.erase(6, reason="asked")
        assert added[6] not in await store.get_messages()
        _refs_only(store)
        assert _pager(store).held_bytes == 0 or added[6] not in [v[0] for v in _pager(store)._cache.values()]


async def test_a_reader_of_a_session_moved_to_the_trash_says_so_then_reads_again_once_restored(
        tmp_path: Path, pg_dsn: str) -> None:  # noqa: F811
    from context_persistent.storage.pg.retention import apply_pg, restore_pg

    schema = f"cp_pages_{uuid.uuid4().hex[:8]}"
    cfg = {"backend": "postgres", "dsn": pg_dsn, "pg_schema": schema}
    try:
        added = _messages(10)
        for name in ("a", "b"):
            async with await _open(tmp_path, name, cfg) as store:
                await store.add_messages(added)
        async with await _open(tmp_path, "a", cfg, readonly=True) as reader:
            _refs_only(reader)
            _pager(reader).clear()  # (the open's replay left the messages in the cache)
            assert reader._state.messages[1] == added[1]
            report = await apply_pg(pg_dsn, schema, RetentionPolicy(max_sessions=1))
            assert [t["session_id"] for t in report["trashed"]] == ["a"]
            assert reader._state.messages[1] == added[1]  # (what it read is still served from its cache)
            with pytest.raises(RecordCorruptedError, match="moved to the trash"):
                reader._state.messages[2]
            await restore_pg(pg_dsn, schema, report["trashed"][0]["entry"])
            assert await reader.get_messages() == added
    finally:
        await execute(pg_dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def test_close_ends_the_connection_and_the_thread(storage: Path, sid: str, pg_config: dict[str, Any]) -> None:
    store = await _open(storage, sid, pg_config)
    await store.add_messages(_messages(5))
    pager = _pager(store)
    pager.clear()
    store._state.messages[0]
    thread = pager._thread
    assert thread is not None and thread.is_alive()
    await store.close()
    assert not thread.is_alive() and pager.backend_pid is None
    assert not [t for t in threading.enumerate() if t.name.startswith("context-persistent reader")]
    with pytest.raises(StoreClosedError):
        store._state.messages[1]


async def test_a_checkpoint_holding_messages_opens_as_refs(storage: Path, sid: str, pg_config: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written with the messages inline (by a version without the PostgreSQL reader) is read as
    refs: the history holds no message after the open either."""
    added = _messages(30)
    with monkeypatch.context() as m:
        m.setattr("context_persistent.store.session.pager_for", lambda log, size: None)
        async with await _open(storage, sid, pg_config, checkpoint_every=10) as store:
            await store.add_messages(added)
            assert store._s.pager is None
    rows = await execute(pg_config["dsn"], f"SELECT payload FROM {pg_config['pg_schema']}.checkpoints "
                         "WHERE session_id = $1", sid)
    assert b"message 29 " in bytes(rows[0]["payload"])
    async with await _open(storage, sid, pg_config) as store:
        assert store.stats()["checkpoint"]["loaded_seq"] == store.head_seq
        _refs_only(store)
        assert await store.get_messages() == added


@pytest.mark.parametrize("windowed", [False, True])
async def test_the_first_request_view_reads_the_history_in_runs_not_a_query_a_message(
        storage: Path, sid: str, pg_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch, windowed: bool) -> None:
    """Opened from a checkpoint without token counts, the first request view reads with a query per run of
    messages, not one per message: a whole build reads the whole history; a windowed rebuild reads nothing
    beyond the checkpoint's front section (which lists the system messages)."""
    added = [{"role": "system", "content": "You are helpful."}, *tool_turns(700, size=100)]
    async with await _open(storage, sid, pg_config, tokenizer="o200k_base") as store:
        await store.add_messages(added)
    queries = []
    rows = PostgresMessageReader._rows

    def counted(self: PostgresMessageReader, seqs: list[int]) -> dict[int, bytes]:
        queries.append(len(seqs))
        return rows(self, seqs)

    monkeypatch.setattr(PostgresMessageReader, "_rows", counted)
    async with await _open(storage, sid, pg_config, tokenizer="o200k_base") as store:
        assert store._s.checkpoints.loaded_seq == store.head_seq and not queries
        if windowed:
            store.WINDOW_MIN_MESSAGES = 100
        view = await store.get_messages_for_request(token_budget=2000)
        assert view[0] == added[0] and view[-1] == added[-1] and len(view) < len(added)
        if windowed:
            assert store._state.is_lazy and sum(queries) < len(view)
        else:
            assert sum(queries) >= len(added) - len(view)  # (it did read the older history)
        assert len(queries) < 300, len(queries)
        assert ("window" in store.stats()["last_compaction"]) == windowed


async def test_a_large_message_counted_off_the_loop_keeps_its_count(storage: Path, sid: str,
                                                                    pg_config: dict[str, Any]) -> None:
    """The request view counts long uncounted messages in a worker thread; in a paged history (read back, not
    held) the count is kept: it is stored by the message's ref, not by the identity of a second read."""
    large = {"role": "user", "content": "word " * 20_000}  # (100,000 characters: counted off the loop)
    added = [{"role": "system", "content": "You are helpful."}, *tool_turns(100, size=100), large,
             *tool_turns(200, size=100)]
    async with await _open(storage, sid, pg_config, tokenizer="o200k_base") as store:
        await store.add_messages(added)
    async with await _open(storage, sid, pg_config, tokenizer="o200k_base") as store:
        store.WINDOW_MIN_MESSAGES = 100
        assert store._state.tokens[401] is None
        await store.get_messages_for_request(token_budget=2000)
        assert store._state.tokens[401] is not None
        assert "window" in store.stats()["last_compaction"]  # (the large message is in the omitted part)
