"""Export, time travel, fork, import and follow on the PostgreSQL backend (skipped without a server, required
in CI): the same API as on files, through the EventLog protocol only."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, SessionExistsError, import_
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "reference" / "context-messages.jsonl"
MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "ünïcödé ✓"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]


async def test_export_at_seq_fork_and_import_on_postgres(tmp_path: Path, pg_config: dict[str, Any],  # noqa: F811
                                                        sid: str) -> None:  # noqa: F811
    """Snapshots (now and at a seq), a fork and a re-import all work and agree on the PostgreSQL backend."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config) as store:
        for m in MESSAGES:
            await store.add_message(m)
        await store.pin(1)
        await store.export(tmp_path / "now.jsonl")
        header = await store.export(tmp_path / "at3.json", format="json", at_seq=3)
        result = await store.fork(f"{sid}-fork", at_seq=4)
        with pytest.raises(SessionExistsError):
            await store.fork(f"{sid}-fork")
    assert header["seq_range"] == [1, 3] and header["messages"] == 2
    assert result["parent"] == sid and result["messages"] == 3 and result["pinned"] == 0
    await import_(tmp_path / "now.jsonl", session_id=f"{sid}-copy", storage_path=tmp_path, **pg_config)
    with pytest.raises(SessionExistsError):
        await import_(FIXTURE, session_id=f"{sid}-copy", storage_path=tmp_path, **pg_config)
    for name, expected, pins in ((f"{sid}-copy", MESSAGES, 1), (f"{sid}-fork", MESSAGES[:3], 0)):
        async with await PersistentContextManager.open(storage_path=tmp_path, session_id=name, readonly=True,
                                                       **pg_config) as copy:
            assert await copy.get_messages() == expected
            assert len(copy._state.pinned) == pins
            assert copy._state.session.get("parent", {}).get("seq") in (None, 4)
    assert not list(tmp_path.glob(f"{sid}*"))  # nothing was written to the file backend


async def test_store_follow_on_postgres(tmp_path: Path, pg_config: dict[str, Any], sid: str) -> None:  # noqa: F811
    """store.follow() on PostgreSQL yields the records another store appends, once each, in order."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config) as store:
        seen: list[int] = []

        async def collect() -> None:
            async with contextlib.aclosing(store.follow(after_seq=0)) as records:
                async for rec in records:
                    seen.append(rec["seq"])
                    if rec["seq"] == 6:
                        return

        task = asyncio.ensure_future(collect())
        for i in range(5):
            await store.add_message({"role": "user", "content": f"m{i}"})
        async with asyncio.timeout(20):
            await task
    assert seen == [1, 2, 3, 4, 5, 6]
