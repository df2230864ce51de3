"""The writer alone: every event becomes one chained record and is applied once durable; fsync=batch groups
concurrent events into one append; deferred audit records ride along with the next write and are kept when
that write fails; close writes what is still deferred."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from context_persistent.model import events as ev
from context_persistent.errors import LogWriteError
from context_persistent.store.writer import Writer
from parts import records, started

MSG = {"role": "user", "content": "hello"}


async def test_an_inline_commit_writes_one_chained_record_and_applies_it(storage: Path) -> None:
    """commit returns the seq; the record carries the data bytes given; the projection has the message."""
    session, writer = await started(storage)
    assert writer.inline
    data_json = b'{"message":{"role":"user","content":"hello"}}'
    seq = await writer.commit(ev.MESSAGE_ADDED, {"message": dict(MSG)}, data_json)
    assert seq == 2 and session.state.head_seq == 2 and session.state.messages == [MSG]
    assert [r["type"] for r in records(storage)] == [ev.SESSION_STARTED, ev.MESSAGE_ADDED]
    assert (storage / "part" / "events.jsonl").read_bytes().splitlines()[1].count(data_json) == 1
    await session.log.close()


async def test_the_epoch_moves_for_view_changing_events_only(storage: Path) -> None:
    """message_added and audit events keep the epoch (a view can be extended); a clear moves it."""
    session, writer = await started(storage)
    before = session.epoch
    await writer.commit(ev.MESSAGE_ADDED, {"message": dict(MSG)})
    await writer.commit(ev.TRANSCRIPT_IGNORED, {"count": 0, "digest": "x", "bytes": 0, "kind": "k", "reason": "r"})
    assert session.epoch == before
    await writer.commit(ev.CLEARED, {})
    assert session.epoch == before + 1 and session.state.messages == []
    await session.log.close()


async def test_batch_mode_writes_concurrent_events_in_one_append(storage: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Events queued before the flush task runs go out in one append; each caller gets its own seq."""
    session, writer = await started(storage, fsync="batch")
    assert not writer.inline
    appends: list[int] = []
    real = session.log.append

    async def counting(lines: Any, first: int) -> Any:
        appends.append(len(lines))
        return await real(lines, first)

    monkeypatch.setattr(session.log, "append", counting)
    seqs = await asyncio.gather(*[writer.enqueue(ev.MESSAGE_ADDED, {"message": {"role": "user", "content": str(i)}},
                                                 b'{"message":{"role":"user","content":"%d"}}' % i)
                                  for i in range(5)])
    assert appends == [5] and seqs == [2, 3, 4, 5, 6]
    assert [m["content"] for m in session.state.messages] == ["0", "1", "2", "3", "4"]
    assert len(records(storage)) == 6
    await writer.close()
    await session.log.close()


async def test_deferred_audit_records_ride_with_the_next_write_and_survive_a_failed_one(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred record is written before the next event in the same append; if that append fails, it
    stays deferred and nothing is applied."""
    session, writer = await started(storage)
    writer.defer(ev.COMPACTED, {"budget": 10})
    real = session.log.append

    async def failing(lines: Any, first: int) -> Any:
        raise LogWriteError(str(session.log.path), "write", OSError(5, "Input/output error"))

    monkeypatch.setattr(session.log, "append", failing)
    with pytest.raises(LogWriteError):
        await writer.commit(ev.MESSAGE_ADDED, {"message": dict(MSG)})
    assert len(writer.deferred) == 1 and session.state.head_seq == 1
    monkeypatch.setattr(session.log, "append", real)
    seq = await writer.commit(ev.MESSAGE_ADDED, {"message": dict(MSG)})
    assert seq == 3 and writer.deferred == []
    assert [r["type"] for r in records(storage)] == [ev.SESSION_STARTED, ev.COMPACTED, ev.MESSAGE_ADDED]
    await session.log.close()


async def test_close_writes_what_is_still_deferred(storage: Path) -> None:
    """An audit record kept after the last event is written at close."""
    session, writer = await started(storage, fsync="batch")
    writer.defer(ev.COMPACTED, {"budget": 10})
    await writer.close()
    assert [r["type"] for r in records(storage)] == [ev.SESSION_STARTED, ev.COMPACTED]
    await session.log.close()


async def test_a_closed_or_readonly_session_refuses_commits(storage: Path) -> None:
    """commit checks the session first: nothing is written after close or on a read-only session."""
    from context_persistent.errors import ReadOnlyError, StoreClosedError
    from parts import open_session

    session, writer = await started(storage)
    await session.log.close()
    session.closed = True
    with pytest.raises(StoreClosedError):
        await writer.commit(ev.CLEARED, {})
    reader = await open_session(storage, readonly=True)
    with pytest.raises(ReadOnlyError):
        await Writer(reader).commit(ev.CLEARED, {})
    await reader.log.close()
    assert len(records(storage)) == 1
