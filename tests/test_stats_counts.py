"""stats() on a history whose token counts are missing (a log replayed without counting) counts them once;
the next checkpoint records them, so stats() after a reopen reads no message from the log."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
from context_persistent.storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME

from checkpoint_files import strip_message_section
from strategies import tool_turns

S = "s"
CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)


async def _open(storage: Path, **config: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=S, **{**CONFIG, **config})


def _drop_checkpoint(storage: Path) -> None:
    (storage / S / CHECKPOINT_NAME).unlink(missing_ok=True)
    (storage / S / CHECKPOINT_BASE_NAME).unlink(missing_ok=True)


async def _uncounted_session(storage: Path, turns: int) -> None:
    """A session whose log is replayed and checkpointed without a single token count."""
    async with await _open(storage, checkpoint_every=1 << 30) as store:
        await store.add_message({"role": "system", "content": "You are helpful."})
        await store.add_messages(tool_turns(turns))
    _drop_checkpoint(storage)
    async with await _open(storage) as store:  # a full replay, nothing counted; its close writes the checkpoint
        assert store._checkpoints.loaded_seq == 0 and store._state.tokens.count(None) == len(store._state.tokens)
    assert (storage / S / CHECKPOINT_NAME).exists()


async def _recount(storage: Path, tmp_path: Path) -> int:
    """The history's tokens counted from scratch: a copy without checkpoints, replayed and counted whole."""
    twin = tmp_path / "twin"
    shutil.copytree(storage, twin)
    _drop_checkpoint(twin)
    async with await _open(twin, readonly=True) as store:
        assert store._state.tokens.count(None) == len(store._state.tokens)
        return sum(store._ledger.counts())


async def test_missing_counts_are_made_once_and_recorded_by_the_next_checkpoint(tmp_path: Path, lazy_fronts: None) -> None:
    storage = tmp_path / "store"
    await _uncounted_session(storage, 600)
    strip_message_section(storage / S / CHECKPOINT_NAME)  # (its messages read from the log, as a layout 4's)
    async with await _open(storage) as store:
        assert store._checkpoints.loaded_seq > 0 and store._checkpoints.loaded_total is None
        pager = store._s.pager
        assert pager is not None
        store._s.full()  # (loading the rest of the lazy history may cache a few messages: not counted here)
        held, read = pager.held_bytes, pager.reads
        first = store.stats()
        # Read in runs, and kept: the whole history fits the cache's memory budget (pages.keep_read).
        assert pager.reads > read and held < pager.held_bytes <= pager.cache_bytes
        read = pager.reads
        second = store.stats()
        assert pager.reads == read and second["tokens"] == first["tokens"]
        messages = first["messages"]
    async with await _open(storage) as store:  # the close above recorded the counts and their total
        assert store._checkpoints.loaded_total == (messages, first["tokens"])
        pager = store._s.pager
        assert pager is not None
        assert store.stats()["tokens"] == first["tokens"]
        assert pager.reads == 0 and store._state.is_lazy
        await store.add_message({"role": "user", "content": "one more " * 40})
        after = store.stats()
        assert pager.reads == 0 and store._state.is_lazy
        assert after["tokens"] > first["tokens"] and after["messages"] == messages + 1
    assert await _recount(storage, tmp_path) == after["tokens"]


async def test_a_reopen_without_counting_keeps_the_recorded_total(tmp_path: Path) -> None:
    storage = tmp_path / "store"
    await _uncounted_session(storage, 300)
    async with await _open(storage) as store:
        total = store.stats()["tokens"]
    for _ in range(2):  # opens that never count (nor change anything) keep the checkpoint and its total
        async with await _open(storage) as store:
            pass
    async with await _open(storage, readonly=True) as store:
        pager = store._s.pager
        assert pager is not None
        assert store.stats()["tokens"] == total and pager.reads == 0
    assert await _recount(storage, tmp_path) == total


async def test_get_token_count_counts_the_missing_off_the_loop_and_survives_appends(tmp_path: Path,
                                                                                    monkeypatch: Any) -> None:
    import asyncio

    from context_persistent.store import ledger
    storage = tmp_path / "store"
    await _uncounted_session(storage, 600)
    runs = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, *args: Any) -> Any:
        runs.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(ledger.asyncio, "to_thread", to_thread)
    monkeypatch.setattr(ledger, "COUNT_RUN", 500)
    async with await _open(storage) as store:
        n = len(store._state.tokens)
        counting = asyncio.ensure_future(store.get_token_count())
        await asyncio.sleep(0)
        await store.add_message({"role": "user", "content": "added while counting " * 20})  # the loop runs
        total = await counting
        assert len(runs) >= n // 500  # (a worker thread per run)
        pager = store._s.pager
        assert pager is not None
        read = pager.reads
        assert store.stats()["tokens"] == await store.get_token_count() and pager.reads == read
        assert None not in store._state.tokens and total <= store.stats()["tokens"]
        final = store.stats()["tokens"]
    async with await _open(storage) as store:
        assert store._checkpoints.loaded_total is not None and store.stats()["tokens"] == final
    assert await _recount(storage, tmp_path) == final


async def _compacted_session(storage: Path) -> None:
    async with await _open(storage) as store:
        await store.add_message({"role": "system", "content": "You are helpful."})
        for budget in (3000, 2000, 1500):  # three compactions, each recorded with the next event written
            await store.add_messages(tool_turns(60))
            await store.get_messages_for_request(token_budget=budget)
        await store.add_messages(tool_turns(5))  # (records after the newest compaction)


def test_cli_stats_finds_the_newest_compaction_record_reading_back_from_the_end(tmp_path: Path,
                                                                                capsys: Any) -> None:
    import asyncio
    import json

    from context_persistent.cli import main
    from context_persistent.storage.log import scan

    storage = tmp_path / "store"
    asyncio.run(_compacted_session(storage))
    records = [r for r, _ in scan(storage / S / "events.jsonl") if r["type"] == "compacted"]
    assert len(records) >= 2
    assert main(["--storage", str(storage), "stats", S, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["recorded_compaction"]
    newest = records[-1]
    assert got == {"at_seq": newest["seq"] - 1, "ts": newest["ts"], "seq": newest["seq"], **newest["data"]}
    # The record came from the backward read, which stops at it (not from the forward read of the whole log).
    from context_persistent.storage.backends import open_log
    from context_persistent.cli.stats import _newest_backwards

    async def backwards() -> Any:
        log = await open_log(storage, S, {**CONFIG, "storage_path": str(storage)}, readonly=True)
        try:
            return _newest_backwards(log, ["compacted"]), _newest_backwards(log, ["no_such_type"])
        finally:
            await log.close()

    found, none = asyncio.run(backwards())
    assert found == newest and none is None
