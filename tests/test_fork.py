"""Fork: a new session holding the history and pins as of a seq, naming its parent; the parent is untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from context_persistent.operations.search.sqlite_index import INDEX_DIR

from context_persistent import PersistentContextManager, SessionExistsError
from context_persistent.storage.log import scan


async def _parent(storage: Path) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id="parent")
    for i in range(6):
        await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} ✓"})
    await store.pin(1)
    await store.redact(2)
    return store


async def test_fork_at_head_copies_history_and_pins_and_names_the_parent(storage: Path) -> None:
    """The child holds the same visible messages and pins; its session_started names parent and seq."""
    async with await _parent(storage) as parent:
        before = parent.path.read_bytes()
        result = await parent.fork("child")
        expected = await parent.get_messages()
        head = parent.head_seq
        assert parent.path.read_bytes() == before  # the parent is only read
    assert result["seq"] == head and result["pinned"] == 1
    records = [rec for rec, _ in scan(storage / "child" / "events.jsonl")]
    assert records[0]["data"]["parent"] == {"session_id": "parent", "seq": head}
    async with await PersistentContextManager.open(storage_path=storage, session_id="child") as child:
        assert await child.get_messages() == expected
        assert "m2 ✓" not in str(expected)  # a redacted message stays hidden in the fork
        pinned = [i for i, k in enumerate(child._state.keys) if k in child._state.pinned]
        assert pinned == [1]
        await child.add_message({"role": "user", "content": "only in the child"})
    async with await PersistentContextManager.open(storage_path=storage, session_id="parent") as parent:
        assert "only in the child" not in str(await parent.get_messages())


async def test_fork_at_an_earlier_seq_takes_the_state_right_after_it(storage: Path) -> None:
    """fork(at_seq=N) holds exactly what the parent held right after event N (pins as of then too)."""
    async with await _parent(storage) as parent:
        await parent.fork("early", at_seq=4)  # session_started + m0, m1, m2 (m2 redacted later: left out)
    async with await PersistentContextManager.open(storage_path=storage, session_id="early", readonly=True) as child:
        assert [m["content"] for m in await child.get_messages()] == ["m0 ✓", "m1 ✓"]
        assert child._state.pinned == set()
        assert child._state.session["parent"] == {"session_id": "parent", "seq": 4}


async def test_fork_refuses_an_existing_target_and_bad_seqs(storage: Path) -> None:
    """Forking onto an existing session (including the parent itself) or past the head raises, writing nothing."""
    async with await _parent(storage) as parent:
        await parent.fork("taken")
        taken = (storage / "taken" / "events.jsonl").read_bytes()
        with pytest.raises(SessionExistsError):
            await parent.fork("taken")
        with pytest.raises(SessionExistsError):
            await parent.fork("parent")
        with pytest.raises(ValueError, match="beyond the last event"):
            await parent.fork("later", at_seq=parent.head_seq + 5)
    assert (storage / "taken" / "events.jsonl").read_bytes() == taken
    assert sorted(p.name for p in storage.iterdir() if p.name != INDEX_DIR) == ["parent", "taken"]  # (and the search index)


async def test_fork_of_a_read_only_store_works_while_a_writer_holds_the_session(storage: Path) -> None:
    """A read-only opener can fork a session whose writer is live (no lock needed)."""
    async with await _parent(storage) as writer:
        async with await PersistentContextManager.open(storage_path=storage, session_id="parent",
                                                       readonly=True) as reader:
            result = await reader.fork("branch")
        await writer.add_message({"role": "user", "content": "writer goes on"})
    assert result["parent"] == "parent" and result["messages"] == 5
