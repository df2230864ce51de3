"""The Amplifier mount's edges: a write after the host's cleanup closed the store, and a second process."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.errors import SessionLockedError, StoreClosedError
from context_persistent.integrations.amplifier import mount
from context_persistent.integrations.amplifier_host import HostContext, SessionInUseError


class _Coordinator:
    session_id = "s1"
    hooks = None

    def __init__(self) -> None:
        self.context: Any = None

    async def mount(self, point: str, instance: Any) -> None:
        self.context = instance


async def _messages(storage: Path) -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id="s1", readonly=True) as store:
        return await store.get_messages()


async def test_a_message_written_after_the_cleanup_is_appended(tmp_path: Path) -> None:
    """After the mount's cleanup closed the store, add_message opens the log again and appends (no error)."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    store = coordinator.context
    assert isinstance(store, HostContext)
    await store.add_message({"role": "user", "content": "hello"})
    await cleanup()
    await store.add_message({"role": "assistant", "content": "cancelled"})
    assert [m["content"] for m in await _messages(tmp_path)] == ["hello", "cancelled"]


async def test_a_store_closed_by_its_user_still_refuses_writes(tmp_path: Path) -> None:
    """Only the host's cleanup enables late writes: a store closed otherwise raises StoreClosedError."""
    coordinator = _Coordinator()
    await mount(coordinator, {"storage_path": str(tmp_path)})
    await coordinator.context.close()
    with pytest.raises(StoreClosedError):
        await coordinator.context.add_message({"role": "user", "content": "x"})


def _hold(storage: str, ready: Any, done: Any) -> None:
    import asyncio

    async def run() -> None:
        async with await PersistentContextManager.open(storage_path=storage, session_id="s1"):
            ready.set()
            done.wait(30)

    asyncio.run(run())


async def test_late_write_while_another_process_holds_the_session_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A late write that finds another process holding the session logs one warning line, and a second
    mount of that session says, in the CLI's terms, what to do."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    await cleanup()
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        with caplog.at_level(logging.WARNING, logger="context_persistent"):
            await coordinator.context.add_message({"role": "assistant", "content": "cancelled"})
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "was not stored" in warnings[0] and "another amplifier process" in warnings[0]
        with pytest.raises(SessionInUseError) as raised:
            await mount(_Coordinator(), {"storage_path": str(tmp_path)})
        text = str(raised.value)
        assert isinstance(raised.value, SessionLockedError) and "readonly=True" not in text
        assert "Exit that session first" in text and "context-persistent show s1" in text
    finally:
        done.set()
        holder.join(30)
    assert await _messages(tmp_path) == []


async def test_get_messages_in_the_host_follows_context_simples_contract(tmp_path: Path) -> None:
    """The mount's get_messages hands out a new list whose dicts are made once and given again while only
    messages were appended (context-simple's contract: a call costs the new messages); a caller's change to
    one shows in later results but never in the stored history, the request view or the log. Any other
    change of the history (a replacement) makes them afresh."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    store = coordinator.context
    await store.add_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    first = await store.get_messages()
    await store.add_message({"role": "user", "content": "q2"})
    second = await store.get_messages()
    assert second is not first and [m["content"] for m in second] == ["q", "a", "q2"]
    assert second[0] is first[0] and second[1] is first[1]
    first[0]["content"] = "changed by the caller"
    assert (await store.get_messages())[0]["content"] == "changed by the caller"  # (as context-simple's)
    assert [m["content"] for m in await store.get_messages_for_request()] == ["q", "a", "q2"]
    assert [m["content"] for m in store._s.state.messages] == ["q", "a", "q2"]
    await store.set_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
                             reason="test")
    third = await store.get_messages()
    assert [m["content"] for m in third] == ["q", "b"] and third[0] is not first[0]
    await cleanup()
    assert [m["content"] for m in await _messages(tmp_path)] == ["q", "b"]
