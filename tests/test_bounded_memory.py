"""Bounded memory: a file log's history holds refs to its records, not the messages (pages.py); a long
session opened from its checkpoint serves the first request view, stats(), appends and a checkpoint while
reading only a bounded number of messages from the log, and every operation after a lazy open gives what a
store that folded the whole log gives."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import FileCheckpointStore, decode
from context_persistent.errors import LogCorruptedError
from context_persistent.storage.log import read_line_at, scan
from context_persistent.storage.pages import MessageReader, make_ref
from context_persistent.storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, LOG_NAME
from context_persistent.model.projection import PagedList

from strategies import tool_turns

S = "s"
CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)


async def _open(storage: Path, **config: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=S, **{**CONFIG, **config})


async def _session(storage: Path, turns: int) -> None:
    """A system prompt and ``turns`` tool-using turns added one message at a time; close writes a checkpoint
    (every message counted first, as request views of a running agent count them)."""
    async with await _open(storage, checkpoint_every=1 << 30) as store:
        await store.add_message({"role": "system", "content": "You are helpful."})
        await store.add_messages(tool_turns(turns))
        await store.get_token_count()


def _eager_copy(storage: Path) -> Path:
    """A copy of the session without its checkpoint: opening it folds the whole log."""
    twin = storage.parent / (storage.name + "-eager")
    shutil.rmtree(twin, ignore_errors=True)
    shutil.copytree(storage, twin)
    (twin / S / CHECKPOINT_NAME).unlink()
    (twin / S / CHECKPOINT_BASE_NAME).unlink(missing_ok=True)
    return twin


@pytest.fixture(scope="module")
def long_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import asyncio

    storage = tmp_path_factory.mktemp("long") / "store"
    asyncio.run(_session(storage, 5000))  # (about 20k messages)
    return storage


def _fresh(long_session: Path, tmp_path: Path) -> Path:
    storage = tmp_path / "store"
    shutil.copytree(long_session, storage)
    return storage


# -- 1. the long session's first steps read a bounded number of messages ----------------------------------
async def test_first_request_stats_appends_and_a_checkpoint_read_few_messages(long_session: Path,
                                                                              tmp_path: Path) -> None:
    storage = _fresh(long_session, tmp_path)
    async with await _open(storage, checkpoint_every=500) as store:
        n = store.stats()["messages"]
        assert n > 18_000 and store._state.is_lazy
        pager = store._s.pager
        assert pager is not None
        view = await store.get_messages_for_request(token_budget=4000)
        stats = store.stats()
        for i in range(600):  # (a periodic checkpoint is written on the way: checkpoint_every=500)
            await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"new {i}"})
        await store.get_messages_for_request(token_budget=4000)
        if store._checkpoints._task is not None:
            await store._checkpoints._task
        after = store.stats()
        assert store._checkpoints.seq > store._checkpoints.loaded_seq  # a checkpoint was written meanwhile
        # Nothing beyond what the front section holds was read from the log, and the history never loaded.
        assert pager.reads == 0 and store._state.is_lazy
        assert after["messages"] == n + 600 and after["tokens"] > stats["tokens"]
        # A based checkpoint: its state section is the one written before, by reference (not copied).
        written = decode(FileCheckpointStore(storage / S).read_sync() or b"")
        assert written.base is not None and written.state_in is not None
        assert (storage / S / CHECKPOINT_BASE_NAME).stat().st_size > (storage / S / CHECKPOINT_NAME).stat().st_size
    twin = _eager_copy(storage)
    async with await _open(twin) as eager:
        assert eager.stats()["tokens"] == after["tokens"]
        assert await eager.get_messages_for_request(token_budget=4000) == await _request(storage, 4000)
    assert len(view) < 100


async def _request(storage: Path, budget: int) -> list[dict[str, Any]]:
    async with await _open(storage) as store:
        return await store.get_messages_for_request(token_budget=budget)


async def test_loading_the_rest_reads_refs_not_messages(long_session: Path, tmp_path: Path) -> None:
    """When something needs the whole history (here: a pin by position far back), what loads is the refs:
    the messages stay in the log until read, and the cache stays within its bound."""
    storage = _fresh(long_session, tmp_path)
    async with await _open(storage, page_cache_bytes=64 << 10) as store:
        await store.pin(store.stats()["messages"] // 2)
        assert not store._state.is_lazy
        messages = store._state.messages
        assert type(messages) is PagedList and sum(type(v) is int for v in messages.items) > len(messages) - 50
        pager = store._s.pager
        assert pager is not None and pager.reads < 20
        got = [m async for m in store.iter_messages()]
        assert pager.held_bytes <= 64 << 10 and pager.reads > len(got) // 2
        assert got == await store.get_messages()


# -- 2. iter_messages ---------------------------------------------------------------------------------------
async def test_iter_messages_equals_get_messages_lazy_loaded_and_after_changes(storage: Path, lazy_fronts: None) -> None:
    await _session(storage, 300)
    async with await _open(storage) as store:
        assert store._state.is_lazy
        assert [m async for m in store.iter_messages(chunk=7)] == await store.get_messages()
        await store.add_message({"role": "user", "content": "after"})
        await store.redact(3)
        await store.set_messages([{"role": "user", "content": "replaced"}], reason="test")
        await store.add_message({"role": "assistant", "content": "reply"})
        got = [m async for m in store.iter_messages()]
        assert got == await store.get_messages() and len(got) == 2
        got[0]["content"] = "changed by the caller"
        assert (await store.get_messages())[0]["content"] == "replaced"  # (copies)


async def test_iter_messages_is_a_snapshot_and_refuses_a_closed_store(storage: Path) -> None:
    from context_persistent.errors import StoreClosedError

    await _session(storage, 200)
    store = await _open(storage)
    it = store.iter_messages(chunk=10)
    first = await it.__anext__()
    await store.add_message({"role": "user", "content": "later"})
    rest = [m async for m in it]
    assert [first, *rest] == (await store.get_messages())[:-1]
    it2 = store.iter_messages(chunk=10)
    await it2.__anext__()
    await store.close()
    with pytest.raises(StoreClosedError):
        async for _ in it2:
            pass
    with pytest.raises(StoreClosedError):
        store.iter_messages().__aiter__()  # (an async generator checks when first advanced)
        await store.iter_messages().__anext__()


# -- 3. operations after a lazy open equal a store that folded the whole log -----------------------------
OPS = ("add", "redact", "pin", "unpin", "prompt", "replace", "clear", "erase", "request", "reopen")


async def _apply(store: PersistentContextManager, op: str, rng: random.Random, i: int) -> None:
    n = len(store._state.messages)
    if op == "add" or n == 0:
        await store.add_messages([{"role": "user", "content": f"q{i} " * rng.randint(1, 30)},
                                  {"role": "assistant", "content": f"a{i} " * rng.randint(1, 30)}])
    elif op == "redact":
        await store.redact(rng.randrange(n))
    elif op == "pin":
        await store.pin(rng.randrange(n))
    elif op == "unpin" and store._state.pinned:
        await store.unpin(seq=sorted(store._state.pinned)[0] >> 20) if sorted(store._state.pinned)[0] & 0xFFFFF == 0 \
            else None
    elif op == "prompt":
        store._start_prompts = None

        async def factory() -> str:
            return f"prompt {i}"

        await store.set_system_prompt_factory(factory)
        await store.get_messages_for_request(token_budget=3000)
        await store.set_system_prompt_factory(None)
    elif op == "replace":
        keep = await store.get_messages(last=rng.randint(1, 40))
        await store.replace_messages(keep)
    elif op == "clear":
        await store.clear()
    elif op == "erase":
        await store.erase(rng.randrange(n))
    elif op == "request":
        await store.get_messages_for_request(token_budget=rng.choice((2000, 8000)))


async def _observe(store: PersistentContextManager) -> dict[str, Any]:
    stats = store.stats()
    return {"messages": await store.get_messages(), "tokens": stats["tokens"], "pinned": stats["pinned"],
            "request": await store.get_messages_for_request(token_budget=3000),
            "reasoning": await store.get_reasoning_view()}


@pytest.mark.parametrize("seed", range(6))
async def test_operations_after_a_lazy_open_equal_a_whole_fold(long_session: Path, tmp_path: Path,
                                                              seed: int) -> None:
    storage = _fresh(long_session, tmp_path)
    rng = random.Random(seed)
    ops = [rng.choice(OPS) for _ in range(8)]
    store = await _open(storage)
    try:
        for i, op in enumerate(ops):
            if op == "reopen":
                await store.close()
                store = await _open(storage)
                continue
            await _apply(store, op, rng, i)
        got = await _observe(store)
    finally:
        await store.close()
    twin = _eager_copy(storage)
    async with await _open(twin) as eager:
        assert type(eager._state.messages) is PagedList and not eager._state.is_lazy
        want = await _observe(eager)
    assert got == want, ops


# -- 4. refs and the reader -----------------------------------------------------------------------------------
async def test_a_corrupt_record_a_ref_names_is_an_error_not_a_skip(long_session: Path, tmp_path: Path) -> None:
    """A record damaged after the checkpoint was written is found when its message is read: LogCorruptedError
    naming its place, never a message skipped or invented."""
    storage = _fresh(long_session, tmp_path)
    log = storage / S / LOG_NAME
    records = list(scan(log, limit=200_000))
    rec, end = records[40]
    start = records[39][1]
    data = bytearray(log.read_bytes())
    at = data.index(b'"content":"', start) + 12
    data[at] = data[at] ^ 0x01
    log.write_bytes(bytes(data))
    # (a budget the checkpoint's message section does not fit: the messages are read from the log; one that fits
    # serves them from the section, test_message_section.py)
    async with await _open(storage, page_cache_bytes=1 << 20) as store:
        with pytest.raises(LogCorruptedError, match=f"byte offset {start}") as e:
            await store.get_messages()
        assert "fails verification" in str(e.value)
        with pytest.raises(LogCorruptedError):
            [m async for m in store.iter_messages()]
        assert store._checkpoints.section_messages == 0
    assert rec["seq"] == 41 and end > start


def test_read_line_at_and_the_reader(tmp_path: Path) -> None:
    from context_persistent.model import codec
    folder = tmp_path / "s"
    folder.mkdir()
    lines = codec.encode_chain([(1, "message_added", {"message": {"role": "user", "content": "x" * 100_000}}, None),
                                (2, "messages_replaced", {"messages": [{"role": "user", "content": "a"},
                                                                       {"role": "assistant", "content": "b"}]}, None)],
                               codec.root_crc("s"))
    (folder / LOG_NAME).write_bytes(b"".join(lines))
    assert read_line_at(folder, 0) == lines[0]  # (longer than one read)
    assert read_line_at(folder, len(lines[0])) == lines[1]
    with pytest.raises(LogCorruptedError, match="no complete record starts at global position"):
        read_line_at(folder, len(lines[0]) + len(lines[1]))
    reader = MessageReader(folder, cache_bytes=1000)
    assert reader.fetch(make_ref(len(lines[0]), 1)) == {"role": "assistant", "content": "b"}
    assert reader.reads == 1 and reader.fetch(make_ref(len(lines[0]), 0))["content"] == "a" and reader.reads == 1
    assert reader.fetch(make_ref(0))["content"] == "x" * 100_000  # (larger than the cache: read, not kept)
    assert reader.fetch(make_ref(0)) and reader.reads == 3 and reader.held_bytes <= 1000
    with pytest.raises(LogCorruptedError, match="holds no message at index 5"):
        reader.fetch(make_ref(len(lines[0]), 5))
    with pytest.raises(LogCorruptedError):
        reader.fetch(make_ref(3))  # (not where a record starts)


async def test_a_layout_3_checkpoint_with_messages_inline_is_still_read(storage: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints of the previous layout hold the messages themselves: still used, and the same history."""
    from context_persistent.storage.checkpoint import encode, payload as payload_mod
    from context_persistent.model.projection import Projection

    await _session(storage, 100)
    path = storage / S / CHECKPOINT_NAME
    cp = decode(path.read_bytes())
    assert cp.state is not None and all(type(m) is int for m in cp.state["messages"])
    state = Projection()
    for rec, _ in scan(storage / S / LOG_NAME):
        state.apply(rec)
    import orjson

    monkeypatch.setattr(payload_mod, "CHECKPOINT_VERSION", 3)
    payload = encode(session_id=S, seq=cp.seq, position=cp.position, first_crc=cp.first_crc,
                     last_crc=cp.last_crc, tokenizer=cp.tokenizer, state_json=orjson.dumps(state.to_state()),
                     front_json=orjson.dumps(cp.front))
    assert payload.startswith(b'{"checkpoint":3,')
    path.write_bytes(payload)
    assert decode(path.read_bytes()).state["messages"][0] == {"role": "system", "content": "You are helpful."}
    async with await _open(storage) as store:
        assert store.stats()["checkpoint"]["loaded_seq"] == cp.seq
        assert await store.get_messages() == list(state.messages)


async def test_a_refs_checkpoint_is_ignored_where_no_log_can_resolve_it(storage: Path) -> None:
    """A state of refs restored without a pager (a log that cannot read its messages back) is refused with a reason."""
    from context_persistent.storage.checkpoint import CheckpointError, restore

    await _session(storage, 100)
    cp = decode((storage / S / CHECKPOINT_NAME).read_bytes())
    with pytest.raises(CheckpointError, match="place in the log"):
        restore(cp, lambda: "chars/4")
    os.chmod(storage / S / CHECKPOINT_NAME, 0o600)


# -- 5. a based checkpoint refers to the earlier state section (checkpoint.base) -----------------------------
async def _based_by_reference(storage: Path) -> None:
    await _session(storage, 400)
    async with await _open(storage, checkpoint_every=100) as store:
        assert store._state.is_lazy
        for i in range(260):
            await store.add_message({"role": "user", "content": f"later {i}"})
        assert store._state.is_lazy
    assert (storage / S / CHECKPOINT_BASE_NAME).exists()


async def test_a_based_checkpoint_by_reference_reopens_to_the_whole_fold(storage: Path, lazy_fronts: None) -> None:
    await _based_by_reference(storage)
    cp = decode(FileCheckpointStore(storage / S).read_sync() or b"")
    assert cp.state_in is not None and cp.base is not None and cp.state is not None
    assert (storage / S / CHECKPOINT_NAME).stat().st_mode & 0o777 == 0o600
    assert (storage / S / CHECKPOINT_BASE_NAME).stat().st_mode & 0o777 == 0o600
    from context_persistent.operations.repair import verify

    report = verify(storage / S, S)
    assert report.ok and report.checkpoint["status"] == "valid", report.checkpoint
    async with await _open(storage) as store:
        assert store.stats()["checkpoint"]["loaded_seq"] == cp.seq and store._state.is_lazy
        got = [await store.get_messages(), store.stats()["tokens"]]
        assert store._checkpoints.ignored is None
    twin = _eager_copy(storage)
    async with await _open(twin) as eager:
        assert [await eager.get_messages(), eager.stats()["tokens"]] == got


@pytest.mark.parametrize("damage", ["missing", "other", "flipped"])
async def test_a_missing_or_replaced_base_file_makes_the_checkpoint_ignored(storage: Path, damage: str, lazy_fronts: None) -> None:
    """checkpoint.base gone, replaced by another file, or damaged: the checkpoint is ignored (or its state
    section rebuilt from the log) with a reason, and the history is the whole fold all the same."""
    await _based_by_reference(storage)
    base = storage / S / CHECKPOINT_BASE_NAME
    twin = _eager_copy(storage)
    if damage == "missing":
        base.unlink()
    elif damage == "other":
        base.write_bytes(b"x" * base.stat().st_size)
    else:
        data = bytearray(base.read_bytes())
        data[-20] ^= 0x01  # (inside its state section, which ends with a 9-byte CRC line)
        base.write_bytes(bytes(data))
    async with await _open(storage) as store:
        got = await store.get_messages()
        why = store.stats()["checkpoint"]["ignored"]
        assert why is not None and ("checkpoint.base" in why or "checksum" in why), why
    async with await _open(twin) as eager:
        assert await eager.get_messages() == got


async def test_a_checkpoint_with_its_own_state_section_removes_the_base_and_erase_removes_both(storage: Path, lazy_fronts: None) -> None:
    await _based_by_reference(storage)
    async with await _open(storage, checkpoint_every=100) as store:
        await store.get_messages()  # (loads the rest: the next checkpoint writes its own state section)
        for i in range(260):
            await store.add_message({"role": "user", "content": f"more {i}"})
    assert not (storage / S / CHECKPOINT_BASE_NAME).exists()
    await _based_by_reference_again(storage)
    async with await _open(storage) as store:
        receipt = await store.erase(3)
        assert not (storage / S / CHECKPOINT_BASE_NAME).exists() and not (storage / S / CHECKPOINT_NAME).exists()
        assert receipt["checkpoints"] and await store.verify_erasure(receipt) == []


async def _based_by_reference_again(storage: Path) -> None:
    async with await _open(storage, checkpoint_every=100) as store:
        assert store._state.is_lazy
        for i in range(260):
            await store.add_message({"role": "user", "content": f"again {i}"})
    assert (storage / S / CHECKPOINT_BASE_NAME).exists()


# -- 6. refs across log segments ------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [False, True])
async def test_refs_into_sealed_and_compressed_segments(storage: Path, compress: bool) -> None:
    """Refs are global positions: messages in sealed (and compressed) segments, written before and after rolls
    by this store, read back equal to a whole fold, before and after a reopen from the checkpoint."""
    config = dict(segment_bytes=4096, compress_sealed=compress, checkpoint_every=50)
    async with await _open(storage, **config) as store:
        for i in range(150):
            await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " * 40})
            if i == 75:
                assert (await store.get_messages())[3]["content"].startswith("m3 ")  # (read across a roll)
        assert store._log.manifest is not None and len(store._log.manifest.segments) >= 5
        got = await store.get_messages()
        assert [m async for m in store.iter_messages()] == got
        await store.redact(10)
        got = await store.get_messages()
    async with await _open(storage, **config) as store:
        assert store._checkpoints.loaded_seq > 0
        assert await store.get_messages() == got
        assert [m async for m in store.iter_messages(chunk=16)] == got
