"""Deeply nested messages: what the store accepts it can carry through every path (log, checkpoints, close,
reopen, exports, forks, set_messages); deeper is refused up front with a ValueError; and a failure after a
record is durable (a checkpoint that cannot be written) never surfaces as a failed append."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

import context_persistent.model.events as ev
from context_persistent import MalformedInputError, PersistentContextManager, import_
from context_persistent.model.codec import MAX_DEPTH, ORJSON_MAX_DEPTH, WRAP_DEPTH
from context_persistent.storage.log import scan


def nested(depth: int, role: str = "user") -> dict[str, Any]:
    """A message nesting ``depth`` containers, the message dict included."""
    value: Any = "deep"
    for _ in range(depth - 1):
        value = [value]
    return {"role": role, "content": value}


def test_the_limits_match_orjson() -> None:
    """orjson writes ORJSON_MAX_DEPTH levels and no more; the store keeps a margin below what it can wrap."""
    orjson.dumps(nested(ORJSON_MAX_DEPTH))
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(nested(ORJSON_MAX_DEPTH + 1))
    assert MAX_DEPTH + WRAP_DEPTH < ORJSON_MAX_DEPTH


async def test_a_message_at_the_limit_goes_through_every_path(storage: Path, tmp_path: Path) -> None:
    deep = nested(MAX_DEPTH)
    async with await PersistentContextManager.open(storage_path=storage, session_id="d", checkpoint_every=1) as s:
        await s.add_message({"role": "user", "content": "hi"})
        await s.add_message(deep)
        await s.add_message({"role": "assistant", "content": "ok"})
        await s.get_messages_for_request()
        for fmt in ("jsonl", "json", "markdown"):
            await s.export(tmp_path / f"x.{fmt}", format=fmt)
        await s.fork("f")
        assert s.stats()["checkpoint"]["error"] is None
    assert (storage / "d" / "checkpoint.json").exists()
    for rec, _ in scan(storage / "d" / "events.jsonl"):
        orjson.dumps(rec)  # a record printed as JSON (tail --json) carries it too
    async with await PersistentContextManager.open(storage_path=storage, session_id="d") as s:
        assert s.stats()["checkpoint"]["loaded_seq"] > 0
        assert (await s.get_messages())[1] == deep
        await s.add_message({"role": "user", "content": "again"})
    imported = await import_(tmp_path / "x.jsonl", session_id="i", storage_path=storage)
    assert imported["messages"] == 3
    async with await PersistentContextManager.open(storage_path=storage, session_id="n") as s:
        await s.set_messages([deep, {"role": "assistant", "content": "ok"}])
        assert (await s.get_messages())[0] == deep


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, ORJSON_MAX_DEPTH - 1, ORJSON_MAX_DEPTH + 1, 2000])
async def test_a_deeper_message_is_refused_up_front_and_nothing_is_written(storage: Path, tmp_path: Path,
                                                                           depth: int) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="d") as s:
        await s.add_message({"role": "user", "content": "hi"})
        before = (storage / "d" / "events.jsonl").read_bytes()
        with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} levels deep"):
            await s.add_message(nested(depth))
        with pytest.raises(ValueError, match=rf"messages\[1\] is nested more than {MAX_DEPTH} levels"):
            await s.set_messages([{"role": "user", "content": "x"}, nested(depth)])
        assert (storage / "d" / "events.jsonl").read_bytes() == before
        assert len(await s.get_messages()) == 1
    if depth < 1000:  # (orjson reads at most 1024 levels: deeper is "not valid JSON", refused all the same)
        path = tmp_path / "transcript.jsonl"
        inner = b"[" * (depth - 2) + b'"deep"' + b"]" * (depth - 2)
        path.write_bytes(b'{"role":"user","content":"x"}\n{"role":"user","content":[' + inner + b"]}\n")
        with pytest.raises(MalformedInputError, match=f"line 2: the message is nested more than {MAX_DEPTH}"):
            await import_(path, session_id="imp", storage_path=storage)


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_checkpoint_that_cannot_be_written_never_fails_an_append_or_close(
        storage: Path, fsync: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        lazy_fronts: None) -> None:
    """A log written before the limit existed can hold a message too deep for a checkpoint: every append after
    it succeeds, close succeeds, the failure is logged and shown by stats(), and the checkpoint is retried later.
    (A lazy front section nests its messages deeper than the log does; a front written whole leaves the
    messages to the message section, one level deeper than alone, so such a message fits there.)"""
    too_deep = nested(ORJSON_MAX_DEPTH - 1)  # fine alone, too deep inside a checkpoint section
    with monkeypatch.context() as m:
        m.setattr(ev, "check_depth", lambda *a, **k: None)  # as the program before the limit accepted it
        async with await PersistentContextManager.open(storage_path=storage, session_id="d", fsync=fsync,
                                                       checkpoint_every=2) as s:
            await s.add_message(too_deep)
    caplog.set_level(logging.WARNING, "context_persistent")
    caplog.clear()
    s = await PersistentContextManager.open(storage_path=storage, session_id="d", fsync=fsync, checkpoint_every=2)
    for i in range(7):
        await s.add_message({"role": "user", "content": f"m{i}"})  # none of these may raise
    info = s.stats()["checkpoint"]
    assert info["error"] and "Recursion" in info["error"] and info["seq"] == 0
    attempts = [r for r in caplog.records if "could not write a checkpoint" in r.getMessage()]
    assert len(attempts) == 4  # at seq 3, 5, 7, 9: retried every 2 events, not on every append
    await s.close()  # must not raise
    async with await PersistentContextManager.open(storage_path=storage, session_id="d", readonly=True) as r:
        with pytest.raises(ValueError, match="cannot export session 'd' as json: .*format 'jsonl'"):
            await r.export(storage / "x.json", format="json")
        await r.export(storage / "x.jsonl", format="jsonl")
    async with await PersistentContextManager.open(storage_path=storage, session_id="d", readonly=True) as r:
        msgs = await r.get_messages()
    assert msgs[0] == too_deep and [m["content"] for m in msgs[1:]] == [f"m{i}" for i in range(7)]
