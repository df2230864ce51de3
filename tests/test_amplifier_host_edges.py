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
    one shows in later results and in the request view, which holds the same dicts, but never in the stored
    history or the log. Any other
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
    request = await store.get_messages_for_request()  # (its dicts are get_messages' own: as context-simple's)
    assert [m["content"] for m in request] == ["changed by the caller", "a", "q2"] and request[0] is first[0]
    assert [m["content"] for m in store._s.state.messages] == ["q", "a", "q2"]
    await store.set_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
                             reason="test")
    third = await store.get_messages()
    assert [m["content"] for m in third] == ["q", "b"] and third[0] is not first[0]
    await cleanup()
    assert [m["content"] for m in await _messages(tmp_path)] == ["q", "b"]


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the message dicts copy_json copies from now on (its recursion goes through the module's name)."""
    from context_persistent.model import events

    copied = [0]
    real = events.copy_json

    def counting(value: Any) -> Any:
        if type(value) is dict and "role" in value:
            copied[0] += 1
        return real(value)

    monkeypatch.setattr(events, "copy_json", counting)
    return copied


def _turns(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(n)]


@pytest.mark.parametrize("bounded", [True, False])
async def test_a_host_turn_copies_the_history_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   bounded: bool) -> None:
    """A resumed CLI turn (get_messages three times, the user message, the request, the answer, the transcript's
    get_messages) copies each message once: the request view holds the dicts get_messages hands out, in the
    view made from bounds and in the counted one; a message the build made (a repair) is its own copy."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    store = coordinator.context
    await store.add_messages(_turns(40))
    copied = _count_copies(monkeypatch)
    for _ in range(3):
        handed = await store.get_messages()
    await store.add_message({"role": "user", "content": "next"})
    if not bounded:
        store._views.bounds.view = _no_bound_view  # (count the tokens and build: compaction's own path)
    request = await store.get_messages_for_request()
    assert all(r is h for r, h in zip(request, handed)) and len(request) == 41
    assert store._views.cache[5] is bounded
    await store.add_message({"role": "assistant", "content": "answer"})
    after = await store.get_messages()
    # 40 handed out, "next" once (for the view and get_messages), "answer" once, and add_message's own copy
    # of each of the two it stored (the old code: 40 + 41 for the view + 2 + 2)
    assert after[40] is request[40] and copied[0] == 44
    # a tool call without its result: the view's repair adds a result of its own, copied, the rest shared
    await store.add_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    await store.add_message({"role": "user", "content": "again"})
    handed = await store.get_messages()
    request = await store.get_messages_for_request()
    assert len(request) == len(handed) + 1 and all(r is h for r, h in zip(request[:43], handed))
    assert request[43]["role"] == "tool" and request[43] not in handed
    await cleanup()


async def _no_bound_view(*args: Any) -> None:
    return None


async def test_a_change_to_a_host_request_dict_reaches_no_history_log_or_count(tmp_path: Path) -> None:
    """A caller that changes a dict of the host's request view changes what it was given (and the dicts shared
    with it, as in context-simple), never the stored history, the log, the checkpoint, or the token count
    and compaction of later request views (they count the store's own history)."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    store = coordinator.context
    await store.add_messages(_turns(20))
    await store.get_messages()
    budget = 2000
    request = await store.get_messages_for_request(token_budget=budget)
    tokens = store._views.cache[4].token_count
    request[0]["content"] = "x " * 20_000  # (far over the budget, were it counted)
    request[1]["content"] = "changed"
    await store.add_message({"role": "user", "content": "next"})
    later = await store.get_messages_for_request(token_budget=budget)
    view = store._views.cache[4]
    assert len(later) == 21 and not view.compacted and view.token_count < budget
    assert view.token_count > tokens  # (the new message's tokens added: the change none)
    assert store._s.state.messages[0]["content"] == "message 0"
    assert store._s.state.messages[1]["content"] == "message 1"
    assert await store.compact(token_budget=budget) == 0
    await cleanup()
    assert await _messages(tmp_path) == _turns(20) + [{"role": "user", "content": "next"}]
    # a new store of the same session (from the checkpoint the close wrote): the stored messages, counted so
    reopened = await PersistentContextManager.open(storage_path=tmp_path, session_id="s1")
    try:
        assert (await reopened.get_messages())[:2] == _turns(2)
        assert (await reopened.get_messages_for_request(token_budget=budget))[1]["content"] == "message 1"
    finally:
        await reopened.close()


async def test_a_host_view_of_a_history_beyond_the_page_cache_copies_only_the_view(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paged history beyond the page cache's budget keeps no handed-out copies (each get_messages() copies
    anew): the request view then copies its own messages and makes no copy of the history besides."""
    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path), "page_cache_bytes": 4096})
    store = coordinator.context
    await store.add_messages([{"role": m["role"], "content": m["content"] * 40} for m in _turns(40)])
    assert store._s.pager is not None
    copied = _count_copies(monkeypatch)
    request = await store.get_messages_for_request()
    assert len(request) == 40 and copied[0] == 40 and store._s.handed_out == []
    await cleanup()


async def test_the_lists_a_host_turn_hands_out_never_change_after_later_turns(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An interactive session's turns (get_messages, the prompt, the request, the answer, get_messages): every
    list handed out keeps its length and its dicts whatever later turns and callers do (the store extends its
    own request view and handed-out dicts in place: never a list it gave away), a caller's change to its list
    reaches no later result, and a turn makes one list of the history per get_messages() call, none more."""
    from context_persistent.store.session import Session

    coordinator = _Coordinator()
    cleanup = await mount(coordinator, {"storage_path": str(tmp_path)})
    store = coordinator.context
    await store.add_messages(_turns(40))
    await store.get_messages()
    await store.get_messages_for_request()
    calls = [0]
    real = Session.history_copy

    def counting(self: Session, shared: bool = False) -> list[dict[str, Any]]:
        calls[0] += 1
        return real(self, shared)

    monkeypatch.setattr(Session, "history_copy", counting)
    kept: list[tuple[list[dict[str, Any]], list[int]]] = []
    own = store._views.cache[4].messages
    for turn in range(6):
        before = await store.get_messages()
        await store.add_message({"role": "user", "content": f"prompt {turn}"})
        request = await store.get_messages_for_request()
        assert store._views.cache[4].messages is own  # (extended in place, not rebuilt)
        assert request is not own and request == before + [{"role": "user", "content": f"prompt {turn}"}]
        await store.add_message({"role": "assistant", "content": f"answer {turn}"})
        after = await store.get_messages()
        assert after[:-1] == request and all(a is r for a, r in zip(after, request))
        kept += [(lst, [id(m) for m in lst]) for lst in (before, request, after)]
        request.append({"role": "user", "content": "the caller's own"})  # (the caller's list: the store's never)
        del before[:5]
    assert calls[0] == 2 * 6  # (the request view made none: it shares what get_messages hands out)
    for turn, (lst, ids) in enumerate(kept[::3]):
        assert len(lst) == 40 + 2 * turn - 5 and [id(m) for m in lst] == ids[5:]
    for turn, (lst, ids) in enumerate(kept[1::3]):
        assert len(lst) == 40 + 2 * turn + 2 and [id(m) for m in lst[:-1]] == ids
    for turn, (lst, ids) in enumerate(kept[2::3]):
        assert len(lst) == 40 + 2 * turn + 2 and [id(m) for m in lst] == ids
    final = await store.get_messages_for_request()
    assert final == await store.get_messages() and len(final) == 52
    await cleanup()
