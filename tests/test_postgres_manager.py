"""Manager-level behaviour on both backends (views, resume rule, readonly, mount), and moving a session
between them (file -> PostgreSQL -> file keeps the identical history)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, ReadOnlyError, SessionLockedError

from context_persistent import mount
from context_persistent.cli import main

TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": "a"}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "body"}
HISTORY = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "ünïcödé ✓", "metadata": {"k": [1, 2.5, None]}},
    TOOL_CALL, TOOL_RESULT,
    {"role": "assistant", "content": "done"},
]


@pytest.fixture(params=["file", "postgres"])
def cfg(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Backend configuration for PersistentContextManager.open / mount."""
    if request.param == "file":
        return {}
    return request.getfixturevalue("pg_config")


async def open_store(storage: Path, sid: str, cfg: dict[str, Any], **kw: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=sid, **cfg, **kw)


async def test_add_get_views_and_reopen(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """Messages, the conversation view and token counts are the same after a reopen, on either backend."""
    async with await open_store(storage, sid, cfg) as s:
        for m in HISTORY:
            await s.add_message(m)
        conversation = await s.get_conversation_view()
        tokens = await s.get_token_count()
        assert await s.get_messages() == HISTORY
    async with await open_store(storage, sid, cfg) as s:
        assert s.loaded_from_file
        assert await s.get_messages() == HISTORY
        assert await s.get_conversation_view() == conversation
        assert TOOL_RESULT not in conversation
        assert await s.get_token_count() == tokens
        assert s.head_seq == 1 + len(HISTORY)


async def test_resume_rule_clear_and_pins_survive(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """set_messages is accepted on a fresh session, ignored after a resume; clear and pins persist."""
    async with await open_store(storage, sid, cfg) as s:
        await s.set_messages(HISTORY[:2])
        await s.pin(0)
    async with await open_store(storage, sid, cfg) as s:
        await s.set_messages([{"role": "user", "content": "stale transcript"}])
        assert await s.get_messages() == HISTORY[:2]
        assert s.stats()["pinned"] == 1
        await s.clear()
    async with await open_store(storage, sid, cfg) as s:
        assert await s.get_messages() == []


async def test_second_writer_locked_and_readonly_store_reads(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """While a store is open, another writer is refused and a readonly store reads it but cannot write."""
    async with await open_store(storage, sid, cfg) as s:
        await s.add_message(HISTORY[1])
        with pytest.raises(SessionLockedError):
            await open_store(storage, sid, cfg)
        async with await open_store(storage, sid, cfg, readonly=True) as r:
            assert await r.get_messages() == [HISTORY[1]]
            with pytest.raises(ReadOnlyError):
                await r.add_message(HISTORY[1])


async def test_concurrent_adds_keep_their_order(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """Many concurrent add_message calls (group commit) all land, in call order, with no gap."""
    async with await open_store(storage, sid, cfg) as s:
        await asyncio.gather(*(s.add_message({"role": "user", "content": str(i)}) for i in range(50)))
    async with await open_store(storage, sid, cfg, readonly=True) as r:
        assert [m["content"] for m in await r.get_messages()] == [str(i) for i in range(50)]
        assert r.head_seq == 51


async def test_mount_uses_the_configured_backend(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """mount() with backend/dsn config stores the session there; the cleanup releases it."""
    class Coordinator:
        session_id = sid
        hooks = None
        mounted: dict[str, Any] = {}

        async def mount(self, name: str, obj: Any) -> None:
            self.mounted[name] = obj

    coordinator = Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(storage), **cfg})
    await coordinator.mounted["context"].add_message(HISTORY[1])
    await cleanup()
    async with await open_store(storage, sid, cfg) as s:
        assert await s.get_messages() == [HISTORY[1]]


def test_file_to_postgres_to_file_keeps_the_history(pg_dsn: str, pg_schema: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """export/import through the CLI moves a session file -> PostgreSQL -> file with the identical history."""
    import uuid

    monkeypatch.setenv("CONTEXT_PERSISTENT_PG_SCHEMA", pg_schema)
    store, ids = str(tmp_path / "store"), [f"rt-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]

    async def make() -> None:
        async with await PersistentContextManager.open(storage_path=store, session_id=ids[0]) as s:
            for m in HISTORY:
                await s.add_message(m)
            await s.pin(1)

    asyncio.run(make())
    hop1, hop2 = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert main(["export", ids[0], hop1, "--storage", store]) == 0
    assert main(["import", hop1, ids[1], "--dsn", pg_dsn]) == 0
    assert main(["export", ids[1], hop2, "--dsn", pg_dsn]) == 0
    assert main(["import", hop2, ids[2], "--storage", store]) == 0
    capsys.readouterr()

    async def state(session_id: str, **cfg: Any) -> tuple[list[dict[str, Any]], int]:
        async with await PersistentContextManager.open(storage_path=store, session_id=session_id, readonly=True,
                                                       **cfg) as s:
            return await s.get_messages(), s.stats()["pinned"]

    original = asyncio.run(state(ids[0]))
    assert asyncio.run(state(ids[1], dsn=pg_dsn)) == original == (HISTORY, 1)
    assert asyncio.run(state(ids[2])) == original
    body = [json.loads(x) for x in Path(hop2).read_text().splitlines()[1:]]
    assert [json.loads(x) for x in Path(hop1).read_text().splitlines()[1:]] == body


async def test_host_semantics_on_both_backends(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    """The system prompt event, a host repair and a confirmed replay fold behave the same on either backend."""
    orphan = [*HISTORY[:3]]  # the call c1 has no result
    async with await open_store(storage, sid, cfg) as s:
        for m in orphan:
            await s.add_message(m)
    async with await open_store(storage, sid, cfg, recognise_replay=True) as s:
        async def factory() -> str:
            return "new sys"
        await s.set_system_prompt_factory(factory)
        for m in orphan[1:]:  # a replay of the transcript, then the new instruction confirms it
            await s.add_message(m)
        await s.add_message({"role": "user", "content": "go on"})
        await s.get_messages_for_request()
        current = await s.get_messages()
        result = {"role": "tool", "tool_call_id": "c1", "content": "interrupted"}
        await s.set_messages([*current[:3], result, *current[3:]])  # as foundation's repair places it
        expected = [{"role": "system", "content": "new sys"}, *orphan[1:],
                    {"role": "tool", "tool_call_id": "c1", "content": "interrupted"}, {"role": "user", "content": "go on"}]
        assert await s.get_messages() == expected
    async with await open_store(storage, sid, cfg) as s:
        assert await s.get_messages() == expected
        assert s.stats()["events"].get("replay_recognised") == 1
        assert s.stats()["events"].get("system_prompt_set") == 1
