"""PersistentContextManager.replace_messages: the adapters' explicit "the history is now this list"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from context_persistent import PersistentContextManager, ReadOnlyError
async def test_replaces_even_after_a_resume_where_set_messages_is_ignored(tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "a"})
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.set_messages([{"role": "user", "content": "ignored"}])  # the resume rule
        assert await store.get_messages() == [{"role": "user", "content": "a"}]
        head = store.head_seq
        await store.replace_messages([{"role": "system", "content": "new"}, {"role": "user", "content": "b"}])
        # (the ignored transcript's audit record goes out with the next append: the replace's own record follows it)
        assert store.head_seq == head + 2
        kinds = [json.loads(line)["type"] for line in (tmp_path / "s" / "events.jsonl").read_text().splitlines()]
        assert kinds[head:] == ["transcript_ignored", "messages_replaced"]
        assert await store.get_messages() == [{"role": "system", "content": "new"}, {"role": "user", "content": "b"}]
        old = await store.at(head)
        try:
            assert await old.get_messages() == [{"role": "user", "content": "a"}]  # the log keeps the earlier one
        finally:
            await old.close()
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        assert await store.get_messages() == [{"role": "system", "content": "new"}, {"role": "user", "content": "b"}]


async def test_bad_input_changes_nothing(tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "a"})
        head = store.head_seq
        with pytest.raises(ValueError, match=r"messages\[1\] has unknown role 'robot'"):
            await store.replace_messages([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])
        with pytest.raises(ValueError, match="must be a list"):
            await store.replace_messages("nope")  # type: ignore[arg-type]
        assert store.head_seq == head and await store.get_messages() == [{"role": "user", "content": "a"}]
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s", readonly=True) as ro:
        with pytest.raises(ReadOnlyError):
            await ro.replace_messages([])


async def test_ends_a_replay_in_progress(tmp_path: Path) -> None:
    """Messages held as a possible replay of the loaded history are written before the replacement."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "a"})
        await store.add_message({"role": "assistant", "content": "b"})
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "a"})  # held: it may be a replay
        await store.replace_messages([{"role": "user", "content": "c"}])
        assert await store.get_messages() == [{"role": "user", "content": "c"}]
        await store.add_message({"role": "assistant", "content": "b"})  # no replay recognition any more
        assert await store.get_messages() == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "b"}]
