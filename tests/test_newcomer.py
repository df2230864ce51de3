"""What a newcomer types first works or explains itself (issue #28, "Found by a newcomer")."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from context_persistent import PersistentContextManager


async def test_open_is_an_async_context_manager_without_await(tmp_path: Path) -> None:
    """`async with PersistentContextManager.open(...) as store:` opens the store and closes it on leaving the
    block; `await ...open(...)` and `async with await ...open(...)` still work."""
    async with PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    assert store.closed
    again = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert [m["content"] for m in await again.get_messages()] == ["hi"]
    await again.close()
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as third:
        assert third.head_seq == 2


def test_constructing_the_store_says_how_to_open_it(tmp_path: Path) -> None:
    """`PersistentContextManager(storage_path=..., session_id=...)` is a TypeError naming the spelling that
    works, not Python's "missing 2 required keyword-only arguments"."""
    with pytest.raises(TypeError, match=r"opened, not constructed: use `store = await PersistentContextManager.open"):
        PersistentContextManager(storage_path=tmp_path, session_id="s")  # type: ignore[call-arg]
    assert not (tmp_path / "s").exists()


def test_an_opening_never_awaited_can_be_dropped_quietly(tmp_path: Path) -> None:
    """An opening that is closed without being awaited opens nothing and warns nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opening = PersistentContextManager.open(storage_path=tmp_path, session_id="s")
        opening.close()
    assert not (tmp_path / "s").exists()
