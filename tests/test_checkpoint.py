"""Checkpoints: resume = checkpoint + tail, and every bad checkpoint is ignored without changing the result."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import payload as cpmod
from context_persistent.storage.checkpoint import CheckpointError, FileCheckpointStore, decode, encode, snapshot
from context_persistent.storage.log import scan
from context_persistent.storage.paths import CHECKPOINT_NAME, LOG_NAME
from context_persistent.model.projection import Projection
from context_persistent.model.tokens import TokenCounter

S = "s"


def msg(i: int) -> dict[str, Any]:
    return {"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "word " * (i % 7)}


def _full_fold(log: Path) -> dict[str, Any]:
    """The projection of the log folded from its first record (no checkpoint), as plain JSON, tokens left out."""
    state = Projection()
    for rec, _ in scan(log):
        state.apply(rec)
    return _plain(state)


def _plain(state: Projection) -> dict[str, Any]:
    out = orjson.loads(orjson.dumps(state.to_state()))
    out.pop("tokens")
    return out


async def _rich_session(storage: Path, session: str = S, every: int = 5) -> None:
    """A session exercising every event: messages, pins, unpins, redactions, a clear, a replacement."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=session,
                                                   checkpoint_every=every) as store:
        for i in range(8):
            await store.add_message(msg(i))
        await store.pin(1)
        await store.pin(2)
        await store.unpin(2)
        await store.redact(3)
        await store.clear()
        for i in range(8, 20):
            await store.add_message(msg(i))
            await asyncio.sleep(0)  # let background checkpoint writes run
        await store.pin(0)
        await store.get_token_count()  # token counts become part of the next checkpoint


async def _open_state(storage: Path, session: str = S, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=session, **kw) as store:
        return _plain(store._state), store.stats()["checkpoint"]


async def test_resume_uses_the_checkpoint_and_equals_a_full_replay(storage: Path) -> None:
    """After close, open starts from the checkpoint written at close and reaches the exact full-replay state."""
    await _rich_session(storage)
    written = decode((storage / S / CHECKPOINT_NAME).read_bytes()).seq
    state, info = await _open_state(storage)
    assert info["loaded_seq"] == written > 20 and info["ignored"] is None
    assert state == _full_fold(storage / S / LOG_NAME)


async def test_every_projection_field_survives_a_checkpoint(storage: Path) -> None:
    """Each field of Projection restored from a checkpoint equals the fold's (bar caches: version counters, tokens).

    A new Projection field makes this fail until it is added to to_state/from_state or listed here as a cache.
    """
    await _rich_session(storage)
    folded = Projection()
    for rec, _ in scan(storage / S / LOG_NAME):
        folded.apply(rec)
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        assert store.stats()["checkpoint"]["loaded_seq"] > 0
        restored = store._state
        fields = [name for c in Projection.__mro__ for name in getattr(c, "__slots__", ())]
        assert "messages" in fields and "pinned" in fields
        for name in fields:
            if name not in ("version", "counted_version", "tokens", "pager"):  # (pager: where messages are read)
                assert getattr(restored, name) == getattr(folded, name), name


async def test_checkpoints_are_written_every_n_events_while_appending(storage: Path) -> None:
    """With checkpoint_every=4, a checkpoint appears during appends (in the background), not only at close."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=S, checkpoint_every=4)
    for i in range(9):
        await store.add_message(msg(i))
        await asyncio.sleep(0)
    while store._checkpoints._task is not None:  # a write still in flight (not a timing assertion: we wait)
        await asyncio.sleep(0.005)
    assert not store.closed
    cp = decode((storage / S / CHECKPOINT_NAME).read_bytes())
    assert cp.seq >= 4 and store.stats()["checkpoint"]["seq"] == cp.seq
    await store.close()


async def test_a_stale_checkpoint_is_used_and_the_tail_replayed(storage: Path) -> None:
    """A checkpoint older than the log is valid: open replays only the events after it."""
    await _rich_session(storage)
    old = (storage / S / CHECKPOINT_NAME).read_bytes()
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, checkpoint_every=5) as store:
        for i in range(30, 40):
            await store.add_message(msg(i))
    # (read through the store: a based checkpoint's state section may be in checkpoint.base)
    assert decode(FileCheckpointStore(storage / S).read_sync() or b"").seq > decode(old).seq
    (storage / S / CHECKPOINT_NAME).write_bytes(old)
    state, info = await _open_state(storage)
    assert info["loaded_seq"] == decode(old).seq and state == _full_fold(storage / S / LOG_NAME)


def _truncate(b: bytes) -> bytes:
    return b[: len(b) // 2]


def _flip(b: bytes) -> bytes:
    """A bit flipped a third into the header, front and state sections (a damaged message section, which
    follows them, costs only itself: test_message_section.py)."""
    out = bytearray(b)
    nl = b.index(b"\n")
    head = orjson.loads(b[:nl])
    out[(nl + 1 + head["front_bytes"] + 10 + head["state_bytes"]) // 3] ^= 0x08
    return bytes(out)


FAULTS = {
    "truncated": _truncate,
    "empty": lambda b: b"",
    "garbage": lambda b: b"\x00\xff not a checkpoint at all \n" * 10,
    "bit-flip": _flip,
    "missing-trailer": lambda b: b[:-9],
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_damaged_checkpoint_is_ignored_and_removed(storage: Path, fault: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Truncated, empty, garbage or bit-flipped checkpoints are ignored (logged with the reason), removed by the
    writer, and the state equals a full replay."""
    await _rich_session(storage)
    path = storage / S / CHECKPOINT_NAME
    path.write_bytes(FAULTS[fault](path.read_bytes()))
    ro_state, ro_info = await _open_state(storage, readonly=True)
    assert ro_info["loaded_seq"] == 0 and ro_info["ignored"]
    assert path.exists()  # readers never touch it
    with caplog.at_level(logging.INFO, logger="context_persistent"):
        state, info = await _open_state(storage)
    assert "ignoring the checkpoint" in caplog.text
    assert info["loaded_seq"] == 0 and info["ignored"]
    assert state == ro_state == _full_fold(storage / S / LOG_NAME)
    assert not path.exists()


async def test_a_deleted_checkpoint_gives_the_same_state(storage: Path) -> None:
    """Deleting the checkpoint loses nothing: open replays the whole log."""
    await _rich_session(storage)
    with_cp, _ = await _open_state(storage)
    (storage / S / CHECKPOINT_NAME).unlink()
    without, info = await _open_state(storage)
    assert info["loaded_seq"] == 0 and without == with_cp


async def test_a_checkpoint_from_another_session_is_ignored(storage: Path) -> None:
    """A checkpoint copied from another session is refused by its session id."""
    await _rich_session(storage, "other")
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        await store.add_message(msg(0))
    shutil.copy(storage / "other" / CHECKPOINT_NAME, storage / S / CHECKPOINT_NAME)
    state, info = await _open_state(storage)
    assert "belongs to session 'other'" in info["ignored"]
    assert state == _full_fold(storage / S / LOG_NAME)


async def test_a_checkpoint_of_an_earlier_log_under_the_same_id_is_ignored(storage: Path) -> None:
    """A session deleted and recreated under the same id (same messages) does not reuse the old checkpoint."""
    await _rich_session(storage)
    old = (storage / S / CHECKPOINT_NAME).read_bytes()
    shutil.rmtree(storage / S)
    await _rich_session(storage)
    (storage / S / CHECKPOINT_NAME).write_bytes(old)
    state, info = await _open_state(storage)
    assert "first-record fingerprint" in info["ignored"]
    assert state == _full_fold(storage / S / LOG_NAME)


async def test_a_checkpoint_ahead_of_the_log_is_ignored(storage: Path) -> None:
    """A checkpoint written after events the log no longer holds (log restored from a copy) is refused."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        for i in range(5):
            await store.add_message(msg(i))
    short = (storage / S / LOG_NAME).read_bytes()
    await _rich_session(storage)  # continues the same session: more events, checkpoint at the end
    (storage / S / LOG_NAME).write_bytes(short)
    state, info = await _open_state(storage)
    assert "shorter or was rewritten" in info["ignored"]
    assert state == _full_fold(storage / S / LOG_NAME) and len(state["messages"]) == 5


async def test_a_checkpoint_whose_anchor_record_changed_is_ignored(storage: Path) -> None:
    """Same seq at the same offset but a different record (the log was rewritten) is detected by its checksum."""
    await _rich_session(storage)
    path = storage / S / CHECKPOINT_NAME
    cp = decode(path.read_bytes())
    state_json = orjson.dumps(cp.state)
    path.write_bytes(encode(session_id=S, seq=cp.seq, position=cp.position, first_crc=cp.first_crc,
                            last_crc="00000000", tokenizer=cp.tokenizer, state_json=state_json))
    state, info = await _open_state(storage)
    assert "does not hold its seq" in info["ignored"]
    assert state == _full_fold(storage / S / LOG_NAME)


async def test_a_checkpoint_for_another_format_or_layout_is_ignored(storage: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written for another projection layout or log format is not trusted."""
    await _rich_session(storage)
    monkeypatch.setattr(cpmod, "SCHEMA", cpmod.SCHEMA + ["new_field"])
    state, info = await _open_state(storage, readonly=True)
    assert "projection layout" in info["ignored"]
    assert state == _full_fold(storage / S / LOG_NAME)


async def test_token_counts_are_restored_and_not_recomputed(storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming from a checkpoint reuses its token counts: no message it covers is tokenised again (only the
    messages of the tail after it)."""
    await _rich_session(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        expected = await store.get_token_count()
    covered = decode((storage / S / CHECKPOINT_NAME).read_bytes()).seq
    tail = [rec["data"]["message"] for rec, _ in scan(storage / S / LOG_NAME)
            if rec["seq"] > covered and rec["type"] == "message_added"]
    calls = []
    real = TokenCounter.count_message
    monkeypatch.setattr(TokenCounter, "count_message", lambda self, m: calls.append(m) or real(self, m))
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        assert store.stats()["checkpoint"]["loaded_seq"] == covered > 0
        assert await store.get_token_count() == expected
        assert calls == tail and len(tail) < 5  # (at most checkpoint_every events are not covered)
        calls.clear()
        await store.add_message(msg(50))
        await store.get_token_count()
        assert calls == [msg(50)]  # only the new message


async def test_token_counts_from_another_tokenizer_are_recounted(storage: Path) -> None:
    """A checkpoint counted with cl100k is resumed with chars/4: counts are recomputed with the new counter."""
    await _rich_session(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, tokenizer="chars/4") as store:
        assert store.stats()["checkpoint"]["loaded_seq"] > 0
        counted = await store.get_token_count()
        counter = TokenCounter("chars/4")
        assert counted == sum(counter.count_message(m) for m in await store.get_messages())


def test_the_payload_detects_truncation_and_every_sampled_bit_flip() -> None:
    """decode rejects a payload cut at any length and with any single flipped bit (checked on a sample)."""
    state = Projection()
    for seq in range(1, 6):
        state.apply({"seq": seq, "type": "message_added", "data": {"message": msg(seq)}})
    data = encode(session_id=S, seq=5, position=1234, first_crc="0badf00d", last_crc="12345678", tokenizer=None,
                  state_json=snapshot(state))
    assert decode(data).state == orjson.loads(snapshot(state))
    for cut in range(len(data)):
        with pytest.raises(CheckpointError):
            decode(data[:cut])
    for pos in range(0, len(data), 3):
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(CheckpointError):
            decode(bytes(bad))


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 50)),
    st.tuples(st.just("pin"), st.integers(0, 10)),
    st.tuples(st.just("unpin"), st.integers(0, 10)),
    st.tuples(st.just("redact"), st.integers(0, 10)),
    st.tuples(st.just("clear"), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0)),
    st.tuples(st.just("count"), st.just(0)),
), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, every=st.integers(1, 6))
def test_any_history_resumes_from_checkpoints_to_the_full_replay_state(tmp_path: Path, ops: list[Any],
                                                                       every: int) -> None:
    """Property: whatever the events and wherever the store is reopened, checkpoint + tail == full replay."""
    storage = tmp_path / f"h{abs(hash((tuple(ops), every)))}"

    async def run() -> None:
        store = await PersistentContextManager.open(storage_path=storage, session_id=S, checkpoint_every=every)
        try:
            for op, n in ops:
                count = len(await store.get_messages())
                if op == "add":
                    await store.add_message(msg(n))
                elif op in ("pin", "unpin", "redact") and count:
                    await getattr(store, op)(n % count)
                elif op == "clear":
                    await store.clear()
                elif op == "count":
                    await store.get_token_count()
                elif op == "reopen":
                    await store.close()
                    store = await PersistentContextManager.open(storage_path=storage, session_id=S,
                                                                checkpoint_every=every)
                    assert _plain(store._state) == _full_fold(store.path)
                await asyncio.sleep(0)
        finally:
            await store.close()
        state, _ = await _open_state(storage, checkpoint_every=every)
        assert state == _full_fold(storage / S / LOG_NAME)

    asyncio.run(run())


async def test_verify_reports_the_checkpoint_and_repair_removes_a_bad_one(storage: Path) -> None:
    """verify says a good checkpoint is valid and how far behind it is; a damaged one fails verify until repair
    removes it (the log itself is left byte-identical)."""
    from context_persistent.operations.repair import repair, verify

    await _rich_session(storage)
    report = verify(storage / S, S)
    assert report.ok and report.checkpoint["status"] == "valid" and report.checkpoint["behind"] >= 0
    path = storage / S / CHECKPOINT_NAME
    path.write_bytes(_flip(path.read_bytes()))
    report = verify(storage / S, S)
    assert not report.ok and "checksum mismatch" in report.checkpoint["reason"]
    log_before = (storage / S / LOG_NAME).read_bytes()
    result = repair(storage / S, S)
    assert not result.changed and result.checkpoint_removed and not path.exists()
    assert (storage / S / LOG_NAME).read_bytes() == log_before
    assert verify(storage / S, S).ok
