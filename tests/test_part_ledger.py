"""The token ledger alone: each message is counted once and cached in the projection; after appends only the
new messages are counted; a count of some indices leaves the others alone; long texts are counted in a worker
thread before anything needs them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from context_persistent.model import events as ev
from context_persistent.store.ledger import LARGE_TEXT, TokenLedger
from parts import started


def msg(i: int, size: int = 20) -> dict[str, Any]:
    return {"role": "user", "content": f"message {i} " + "x" * size}


def spy_counts(monkeypatch: pytest.MonkeyPatch, session: Any) -> list[Any]:
    """Each message the session's counter is asked to count (and the thread it was asked on)."""
    counted: list[Any] = []
    real = session.counter.count_message

    def spy(message: dict[str, Any]) -> int:
        counted.append((message["content"][:12], threading.get_ident()))
        return real(message)  # type: ignore[no-any-return]

    monkeypatch.setattr(session.counter, "count_message", spy)
    return counted


async def test_each_message_is_counted_once_and_appends_count_only_the_new_one(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """counts() is a cache: a second call counts nothing, one append counts one message."""
    session, writer = await started(storage, tokenizer="chars/4")
    for i in range(4):
        await writer.commit(ev.MESSAGE_ADDED, {"message": msg(i)})
    ledger = TokenLedger(session)
    counted = spy_counts(monkeypatch, session)
    first = list(ledger.counts())
    assert len(counted) == 4 and all(n > 0 for n in first)
    assert ledger.counts() == first and len(counted) == 4
    await writer.commit(ev.MESSAGE_ADDED, {"message": msg(9)})
    assert ledger.counts()[:4] == first and len(counted) == 5 and counted[-1][0] == "message 9 xx"
    assert ledger.total() == sum(ledger.counts())
    await session.log.close()


async def test_counting_some_indices_leaves_the_others_uncounted(storage: Path) -> None:
    """count_indices fills only the indices asked for; count_one returns the count."""
    session, writer = await started(storage, tokenizer="chars/4")
    for i in range(5):
        await writer.commit(ev.MESSAGE_ADDED, {"message": msg(i)})
    ledger = TokenLedger(session)
    tokens = ledger.count_indices([1, 3])
    assert [t is not None for t in tokens] == [False, True, False, True, False]
    assert ledger.count_one(4) == session.counter.count_message(msg(4))
    await session.log.close()


async def test_a_rebuilt_history_is_counted_from_the_start_after_forget(storage: Path) -> None:
    """After forget() (an erase rebuilt the projection), counts() covers the new history whole."""
    session, writer = await started(storage, tokenizer="chars/4")
    for i in range(3):
        await writer.commit(ev.MESSAGE_ADDED, {"message": msg(i)})
    ledger = TokenLedger(session)
    assert len(ledger.counts()) == 3
    await writer.commit(ev.CLEARED, {})
    await writer.commit(ev.MESSAGE_ADDED, {"message": msg(7, 400)})
    ledger.forget()
    assert ledger.counts() == [session.counter.count_message(msg(7, 400))]
    await session.log.close()


async def test_long_texts_are_counted_in_a_worker_thread_once(storage: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """count_large_off_loop counts only the uncounted long messages, off the event loop's thread; short ones
    are left for counts()."""
    session, writer = await started(storage, tokenizer="chars/4")
    await writer.commit(ev.MESSAGE_ADDED, {"message": msg(0)})
    await writer.commit(ev.MESSAGE_ADDED, {"message": msg(1, LARGE_TEXT)})
    ledger = TokenLedger(session)
    counted = spy_counts(monkeypatch, session)
    await ledger.count_large_off_loop()
    loop_thread = threading.get_ident()
    assert [(c, t != loop_thread) for c, t in counted] == [("message 1 xx", True)]
    assert session.state.tokens[0] is None and session.state.tokens[1] is not None
    await ledger.count_large_off_loop()  # looked at once: nothing new
    assert len(counted) == 1
    ledger.counts()
    assert [c for c, _ in counted] == ["message 1 xx", "message 0 xx"]
    await session.log.close()
