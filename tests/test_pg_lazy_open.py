"""Lazy open on PostgreSQL: a checkpoint's front section is read alone at open (never the whole payload), the
first request view reads only its window, the state section is read when something needs the whole history,
results are those of a full open, a checkpoint written without a front section still opens, and a state
section that cannot be used (damaged, replaced, removed) is replaced by the log, read again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pgfixtures import execute, pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import decode
from context_persistent.storage.pg.log import PostgresStateSection
from context_persistent.storage.pg.pages import PostgresMessageReader

from strategies import tool_turns

pytestmark = pytest.mark.postgres

CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False, max_tokens=2000)


async def _open(storage: Path, sid: str, cfg: dict[str, Any], **kw: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=sid, **{**CONFIG, **cfg, **kw})


def _history() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are helpful."}, *tool_turns(700, size=100),
            {"role": "system", "content": "Be brief."}, *tool_turns(20, size=120)]


async def _write(storage: Path, sid: str, cfg: dict[str, Any], added: list[dict[str, Any]]) -> None:
    async with await _open(storage, sid, cfg) as store:
        await store.add_messages(added)
        await store.get_messages_for_request(token_budget=2000)  # (counts the newest messages)


async def _full_open_results(storage: Path, sid: str, cfg: dict[str, Any]) -> tuple[Any, ...]:
    """The view, messages and token figures of a full replay (the checkpoint row removed first)."""
    await execute(cfg["dsn"], f"DELETE FROM {cfg['pg_schema']}.checkpoints WHERE session_id = $1", sid)
    async with await _open(storage, sid, cfg, readonly=True) as store:
        assert store._s.checkpoints.loaded_seq == 0
        store.WINDOW_MIN_MESSAGES = 100
        view = await store.get_messages_for_request(token_budget=2000)
        return view, await store.get_messages(), store.stats()["messages"]


class _Counts:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []  # refs read per query
        self.sections = 0  # state sections read
        self.prefixes: list[int] = []  # bytes of a payload read at open
        rows, read_state = PostgresMessageReader._rows, PostgresStateSection.read_state
        init = PostgresStateSection.__init__

        def counted_rows(reader: PostgresMessageReader, seqs: list[int]) -> dict[int, bytes]:
            self.rows.append(len(seqs))
            return rows(reader, seqs)

        def counted_state(section: PostgresStateSection, offset: int, length: int) -> dict[str, Any]:
            self.sections += 1
            return read_state(section, offset, length)

        def seen(section: PostgresStateSection, log: Any, reader: Any, prefix: bytes) -> None:
            self.prefixes.append(len(prefix))
            init(section, log, reader, prefix)

        monkeypatch.setattr(PostgresMessageReader, "_rows", counted_rows)
        monkeypatch.setattr(PostgresStateSection, "read_state", counted_state)
        monkeypatch.setattr(PostgresStateSection, "__init__", seen)


async def test_the_open_reads_the_front_section_only_and_the_first_view_only_its_window(
        storage: Path, sid: str, pg_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    added = _history()
    await _write(storage, sid, pg_config, added)
    payload = (await execute(pg_config["dsn"], f"SELECT payload FROM {pg_config['pg_schema']}.checkpoints "
                             "WHERE session_id = $1", sid))[0]["payload"]
    cp = decode(bytes(payload))
    assert cp.front is not None and cp.front["system"] == [0, 2801]
    counts = _Counts(monkeypatch)
    async with await _open(storage, sid, pg_config) as store:
        assert store._s.checkpoints.loaded_seq == store.head_seq
        assert store._state.is_lazy and counts.sections == 0 and not counts.rows
        assert counts.prefixes and counts.prefixes[0] < len(payload) // 2  # (header and front: the state is not read)
        store.WINDOW_MIN_MESSAGES = 100
        view = await store.get_messages_for_request(token_budget=2000)
        stats = store.stats()["messages"]
        assert store._state.is_lazy and counts.sections == 0 and sum(counts.rows) < len(view)
        assert "window" in store.stats()["last_compaction"]
        messages = await store.get_messages()  # (the whole history: the state section is read now, once)
        assert counts.sections == 1 and not store._state.is_lazy
    assert (view, messages, stats) == await _full_open_results(storage, sid, pg_config)
    assert view[0] == added[0] and added[2801] in view and messages == added


async def test_a_checkpoint_written_without_a_front_section_still_opens(
        storage: Path, sid: str, pg_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    added = _history()
    async with await _open(storage, sid, pg_config) as store:
        store._s.checkpoints.front_hints = None  # (as a checkpoint of an earlier version: the whole payload)
        await store.add_messages(added)
    payload = (await execute(pg_config["dsn"], f"SELECT payload FROM {pg_config['pg_schema']}.checkpoints "
                             "WHERE session_id = $1", sid))[0]["payload"]
    assert decode(bytes(payload)).front is None
    counts = _Counts(monkeypatch)
    async with await _open(storage, sid, pg_config) as store:
        assert store._s.checkpoints.loaded_seq == store.head_seq and not store._state.is_lazy
        assert counts.sections == 0  # (read whole by load())
        store.WINDOW_MIN_MESSAGES = 100
        view = await store.get_messages_for_request(token_budget=2000)
        messages = await store.get_messages()
        stats = store.stats()["messages"]
    assert (view, messages, stats) == await _full_open_results(storage, sid, pg_config)


@pytest.mark.parametrize("damage", ["state byte", "replaced", "removed"])
async def test_a_state_section_that_cannot_be_used_is_replaced_by_the_log(
        storage: Path, sid: str, pg_config: dict[str, Any], damage: str) -> None:
    added = _history()
    await _write(storage, sid, pg_config, added)
    table = f"{pg_config['pg_schema']}.checkpoints"
    async with await _open(storage, sid, pg_config) as store:
        assert store._state.is_lazy
        store.WINDOW_MIN_MESSAGES = 100
        view = await store.get_messages_for_request(token_budget=2000)
        if damage == "state byte":  # (the last byte of the state section's JSON)
            await execute(pg_config["dsn"], f"UPDATE {table} SET payload = overlay(payload placing '\\x20'::bytea "
                          "from length(payload) - 10 for 1) WHERE session_id = $1", sid)
        elif damage == "replaced":  # (the same state, another front: as a newer checkpoint would be)
            await execute(pg_config["dsn"], f"UPDATE {table} SET payload = overlay(payload placing '\\x20'::bytea "
                          "from position('\\x0a'::bytea in payload) + 1 for 1) WHERE session_id = $1", sid)
        else:
            await execute(pg_config["dsn"], f"DELETE FROM {table} WHERE session_id = $1", sid)
        assert await store.get_messages() == added
        ignored = store._s.checkpoints.ignored
        assert ignored is not None and ignored.startswith("state section: "), ignored
        assert ("checksum" in ignored) == (damage == "state byte"), ignored
        assert ("replaced or removed" in ignored) == (damage != "state byte"), ignored
        assert await store.get_messages_for_request(token_budget=2000) == view
        await store.add_message({"role": "user", "content": "after"})
        assert (await store.get_messages())[-1]["content"] == "after"


async def test_erasing_a_message_of_the_front_section_after_a_lazy_open(storage: Path, sid: str,
                                                                       pg_config: dict[str, Any]) -> None:
    """The front section holds message contents: erasing one of them removes it from the history, the view and
    the stored checkpoint, and a later open does not bring it back."""
    added = _history()
    await _write(storage, sid, pg_config, added)
    target = len(added) - 4  # (a user turn of the newest ones: in the front section)
    async with await _open(storage, sid, pg_config) as store:
        assert store._state.is_lazy
        await store.erase(target, reason="asked")
        after = await store.get_messages()
        assert added[target] not in after
        assert added[target] not in await store.get_messages_for_request(token_budget=2000)
    secret = added[target]["content"].encode()
    rows = await execute(pg_config["dsn"], f"SELECT payload FROM {pg_config['pg_schema']}.checkpoints "
                         "WHERE session_id = $1", sid)
    assert all(secret not in bytes(r["payload"]) for r in rows)
    async with await _open(storage, sid, pg_config) as store:
        messages = await store.get_messages()
        assert messages == after
        assert added[target] not in await store.get_messages_for_request(token_budget=2000)
