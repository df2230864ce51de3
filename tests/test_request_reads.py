"""A request view is a read: it never writes or syncs the log, even when it compacts. The `compacted` audit
records it makes go out in the same write as the next appended event (or at close), so none is lost on a clean
run and each matches a compaction. A view warning (a budget too small for what must be kept) is said once per
budget, not on every request."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode

SESSION = "r"


def turn(i: int) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": '{"p": "f"}'}}
    return [{"role": "user", "content": f"question {i} " + "words " * 30},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "output " * 60},
            {"role": "assistant", "content": f"answer {i} " + "more " * 20}]


def log_records(storage: Path) -> list[dict[str, Any]]:
    return [decode(x) for x in (storage / SESSION / "events.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_request_views_never_write_or_sync_and_their_audits_ride_with_the_next_append(
        storage: Path, monkeypatch: pytest.MonkeyPatch, fsync: str) -> None:
    syncs: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real_fdatasync(fd))[1])
    compactions = 0
    store = await PersistentContextManager.open(storage_path=storage, session_id=SESSION, fsync=fsync,
                                                max_tokens=1500)
    path = storage / SESSION / "events.jsonl"
    for i in range(30):
        for m in turn(i):
            await store.add_message(m)
        size, nsyncs = path.stat().st_size, len(syncs)
        before = store.last_compaction
        await store.get_messages_for_request()
        assert path.stat().st_size == size and len(syncs) == nsyncs, f"turn {i}: the request view wrote"
        compactions += store.last_compaction is not before
    assert compactions >= 5  # the loop does compact, many times
    on_disk = [r for r in log_records(storage) if r["type"] == "compacted"]
    assert len(on_disk) == compactions - 1  # each one is written with the next append; the last waits for close
    await store.close()
    audits = [r for r in log_records(storage) if r["type"] == "compacted"]
    assert len(audits) == compactions
    seqs = [r["seq"] for r in log_records(storage)]
    assert seqs == list(range(1, len(seqs) + 1))
    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION) as again:
        assert len(await again.get_messages()) == 120  # audit records are not messages


async def test_a_failed_append_keeps_the_deferred_audit_for_the_next_one(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SESSION, max_tokens=1500)
    for i in range(10):
        for m in turn(i):
            await store.add_message(m)
    await store.get_messages_for_request()
    assert store.last_compaction is not None and store._deferred
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(Exception, match="No space left"):
        await store.add_message({"role": "user", "content": "x"})
    monkeypatch.setattr(os, "pwrite", real)
    await store.add_message({"role": "user", "content": "y"})
    await store.close()
    types = [(r["type"], (r["data"].get("message") or {}).get("content")) for r in log_records(storage)[-2:]]
    assert types == [("compacted", None), ("message_added", "y")]


async def test_the_too_small_budget_warning_is_said_once_per_budget(
        storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="context_persistent")
    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION, fsync="never") as s:
        await s.add_message({"role": "system", "content": "rules " * 400})
        for i in range(8):
            await s.add_message({"role": "user", "content": f"q{i} " + "x " * 50})
            await s.get_messages_for_request(token_budget=300)
        await s.get_messages_for_request(token_budget=250)
    said = [r for r in caplog.records if "request view" in r.getMessage()]
    warnings = [r for r in said if r.levelno == logging.WARNING]
    assert len(said) >= 9  # every view over the budget is still noted (at debug level after the first)
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # once for 300, once for 250
    assert "300" in warnings[0].getMessage() and "250" in warnings[1].getMessage()
