"""Opening and closing on their own (Lifecycle over a Session, a Writer and Appends): a fresh log starts with
session_started; a log with history is loaded and the session start begins; a torn last record is cut and
reported (a read-only open leaves it); close writes the deferred audit records, releases the lock and is
idempotent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from context_persistent.model import events as ev
from context_persistent.store.appends import Appends
from context_persistent.store.lifecycle import Lifecycle
from context_persistent.store.system_prompt import SystemPrompt
from context_persistent.store.writer import Writer
from parts import Hooks, open_session, records


async def lifecycle_over(storage: Path, **config: Any) -> tuple[Any, Writer, Appends, Lifecycle]:
    session = await open_session(storage, tokenizer="chars/4", **config)
    writer = Writer(session)
    appends = Appends(session, writer, SystemPrompt(session, writer))
    return session, writer, appends, Lifecycle(session, writer, appends)


async def test_a_fresh_log_starts_with_session_started_and_a_loaded_one_begins_a_resume(storage: Path) -> None:
    """First open: one session_started, nothing loaded. Second open: the history is loaded, no new
    session_started, the session start and the replay watch begin."""
    session, _, appends, life = await lifecycle_over(storage)
    await life.load()
    assert [r["type"] for r in records(storage)] == [ev.SESSION_STARTED] and not session.loaded_from_file
    await appends.add_message({"role": "user", "content": "q"})
    await life.close()
    session, _, appends, life = await lifecycle_over(storage, recognise_replay=True)
    await life.load()
    assert session.loaded_from_file and session.state.messages == [{"role": "user", "content": "q"}]
    assert appends.replay is not None
    assert len(records(storage)) == 2
    await life.close()


async def test_a_torn_tail_is_cut_and_reported_but_left_to_the_writer_when_read_only(storage: Path) -> None:
    """The incomplete last record is cut by a writable open (context:recovered with its place); a read-only
    open reads past it and changes nothing."""
    session, _, appends, life = await lifecycle_over(storage)
    await life.load()
    await appends.add_message({"role": "user", "content": "q"})
    await life.close()
    path = storage / "part" / "events.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"v":2,"seq":3,"prev":"0')
    reader, _, _, reading = await lifecycle_over(storage, readonly=True)
    await reading.load()
    assert reader.recovered is None and path.read_bytes().endswith(b'"prev":"0')
    await reading.close()
    hooks = Hooks()
    session, _, _, life = await lifecycle_over(storage)
    session.hooks = hooks
    await life.load()
    assert session.recovered is not None and path.read_bytes() == whole
    assert hooks.names() == ["context:recovered"] and hooks.seen[0][1]["last_seq"] == 2
    await life.close()


async def test_close_writes_deferred_records_releases_the_lock_and_is_idempotent(storage: Path) -> None:
    """After close the session is closed, the deferred audit record is in the log, and a new writer opens."""
    session, writer, _, life = await lifecycle_over(storage)
    await life.load()
    writer.defer(ev.COMPACTED, {"budget": 5})
    await life.close()
    await life.close()
    assert session.closed and [r["type"] for r in records(storage)] == [ev.SESSION_STARTED, ev.COMPACTED]
    again, _, _, life = await lifecycle_over(storage)
    await life.load()
    assert again.state.head_seq == 2
    await life.close()
