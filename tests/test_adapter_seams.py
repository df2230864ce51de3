"""Adapters under concurrency (#28, items 8 and 10): an Agent Framework storage compaction that runs while the
history changes never drops a turn saved meanwhile nor writes back a message erased or redacted meanwhile; the
openai-agents ``pop_item()`` called concurrently removes and returns a distinct item per call, on files and on
PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from agent_framework import AgentResponse, AgentSession, Message, SessionContext, SlidingWindowStrategy
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import ConcurrencyError, PersistentContextManager
from context_persistent.integrations.agent_framework import PersistentHistoryProvider
from context_persistent.integrations.openai_agents import PersistentSession


class SlowStrategy:
    """A compaction strategy that excludes every message but the newest two, after ``during()`` has run (the
    turn saved, the message erased, while a real strategy would wait on a model to summarise)."""

    def __init__(self, during: Any, runs: int = 1) -> None:
        self.during = during
        self.runs = runs  # how many of its runs call ``during`` (later ones only compact)
        self.calls = 0
        self.seen: list[list[str]] = []

    async def __call__(self, messages: list[Message]) -> bool:
        self.calls += 1
        self.seen.append([m.text for m in messages])
        if self.calls <= self.runs:
            await self.during()
        return await SlidingWindowStrategy(keep_last_groups=2)(messages)


def turn(i: int) -> list[Message]:
    return [Message(role="user", contents=[f"question {i}"]), Message(role="assistant", contents=[f"answer {i}"])]


async def texts(store: PersistentContextManager) -> list[str]:
    return [m["content"] for m in await store.get_messages()]


async def raw_log(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


async def test_a_turn_saved_during_a_storage_compaction_stays_in_the_history(tmp_path: Path) -> None:
    """A turn saved while the strategy runs is in the history afterwards (the compaction ran again on the
    history that holds it), and nothing the strategy saw is lost from the log."""
    async with PersistentHistoryProvider(tmp_path) as provider:
        for i in range(3):
            await provider.save_messages("s", turn(i))

        async def save() -> None:
            await provider.save_messages("s", turn(3))

        strategy = SlowStrategy(save)
        assert await provider.compact_storage("s", strategy)
        store = await provider.store("s")
        assert store is not None
        assert "question 3" in await texts(store) and "answer 3" in await texts(store)
        assert strategy.calls == 2 and "question 3" in strategy.seen[1]
        kept = [m.text for m in await provider.get_messages("s") if not m.additional_properties.get("_excluded")]
        assert kept[-2:] == ["question 3", "answer 3"]


async def test_a_message_erased_during_a_storage_compaction_is_not_written_back(tmp_path: Path) -> None:
    """A message erased while the strategy runs is not brought back by the compaction: its bytes are nowhere in
    the session's files afterwards and no view shows it."""
    secret = "my PIN is 4711-secret"
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", [Message(role="user", contents=[secret]),
                                           Message(role="assistant", contents=["noted"])])
        for i in range(3):
            await provider.save_messages("s", turn(i))
        store = await provider.store("s")
        assert store is not None

        async def erase() -> None:
            await store.erase(message_index=0, reason="user asked")

        assert await provider.compact_storage("s", SlowStrategy(erase))
        assert secret not in await texts(store)
        assert secret not in [m.text for m in await provider.get_messages("s")]
    assert secret.encode() not in await raw_log(tmp_path / "s")


async def test_a_message_redacted_during_a_storage_compaction_stays_out(tmp_path: Path) -> None:
    """A message redacted (openai-agents' pop, a host's redact) while the strategy runs stays out of the history."""
    async with PersistentHistoryProvider(tmp_path) as provider:
        for i in range(3):
            await provider.save_messages("s", turn(i))
        store = await provider.store("s")
        assert store is not None

        async def redact() -> None:
            await store.redact(message_index=-1)

        assert await provider.compact_storage("s", SlowStrategy(redact))
        assert "answer 2" not in await texts(store)


async def test_a_history_that_never_settles_is_refused_with_nothing_replaced(tmp_path: Path) -> None:
    """When every run of the strategy is overtaken by a new turn, compact_storage raises ConcurrencyError and
    replaces nothing (every turn stays as it was saved)."""
    async with PersistentHistoryProvider(tmp_path) as provider:
        for i in range(3):
            await provider.save_messages("s", turn(i))
        n = [10]

        async def save() -> None:
            n[0] += 1
            await provider.save_messages("s", turn(n[0]))

        with pytest.raises(ConcurrencyError, match="changed while"):
            await provider.compact_storage("s", SlowStrategy(save, runs=99))
        store = await provider.store("s")
        assert store is not None
        assert not any(m.additional_properties.get("_excluded") for m in await provider.get_messages("s"))
        assert len(await texts(store)) == 6 + 2 * (n[0] - 10)


async def test_a_compaction_after_a_run_that_never_settles_is_skipped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``compaction_strategy=`` overtaken on every attempt does not fail the run: the run's messages are stored,
    nothing is replaced, and a warning says the compaction was skipped."""
    provider = PersistentHistoryProvider(tmp_path)
    n = [10]

    async def save() -> None:
        n[0] += 1
        await provider.save_messages("s", turn(n[0]))

    provider.compaction_strategy = SlowStrategy(save, runs=99)
    async with provider:
        for i in range(3):
            await provider.save_messages("s", turn(i))
        ctx = SessionContext(session_id="s", input_messages=turn(3)[:1])
        ctx._response = AgentResponse(messages=turn(3)[1:])
        with caplog.at_level("WARNING", logger="context_persistent"):
            await provider.after_run(agent=None, session=AgentSession(session_id="s"), context=ctx, state={})
        assert provider.compaction_strategy.calls == 3, provider.compaction_strategy.calls
        assert "compaction skipped" in caplog.text
        assert [m.text for m in await provider.get_messages("s")][:8] == [t.text for i in range(4) for t in turn(i)]
        assert not any(m.additional_properties.get("_excluded") for m in await provider.get_messages("s"))


async def test_replace_messages_if_version_refuses_a_stale_replacement(tmp_path: Path) -> None:
    """``replace_messages(..., if_version=v)`` stores nothing and raises ConcurrencyError once the history has
    changed since ``history_version`` was ``v`` (an append, or an erase, which appends nothing)."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        v = store.history_version
        await store.add_message({"role": "user", "content": "c"})
        with pytest.raises(ConcurrencyError):
            await store.replace_messages([{"role": "user", "content": "x"}], if_version=v)
        v = store.history_version
        await store.erase(message_index=0)
        assert store.history_version != v
        with pytest.raises(ConcurrencyError):
            await store.replace_messages([{"role": "user", "content": "a"}], if_version=v)
        assert await texts(store) == ["b", "c"]
        await store.replace_messages([{"role": "user", "content": "y"}], if_version=store.history_version)
        assert await texts(store) == ["y"]


# -- openai-agents pop_item -----------------------------------------------------------------------------------
ITEMS = [{"role": "user", "content": f"item {i}"} for i in range(8)]


async def pops_are_distinct(session: PersistentSession) -> None:
    await session.add_items(ITEMS)
    popped = await asyncio.gather(*(session.pop_item() for _ in range(3)))
    assert sorted(p["content"] for p in popped) == ["item 5", "item 6", "item 7"]
    assert await session.get_items() == ITEMS[:5]
    more = await asyncio.gather(*(session.pop_item() for _ in range(7)))
    assert sorted(p["content"] for p in more if p is not None) == [f"item {i}" for i in range(5)]
    assert more.count(None) == 2
    assert await session.get_items() == []


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_concurrent_pops_each_remove_a_distinct_item(tmp_path: Path, fsync: str) -> None:
    """Concurrent pop_item() calls on one session each remove and return a different item (file backend)."""
    async with PersistentSession("s", tmp_path, fsync=fsync) as session:
        await pops_are_distinct(session)
    async with PersistentSession("s", tmp_path) as again:
        assert await again.get_items() == []


@pytest.mark.parametrize("lock", ["open", "call"])
async def test_pops_through_several_objects_on_one_session_each_remove_a_distinct_item(tmp_path: Path,
                                                                                       lock: str) -> None:
    """pop_item() called concurrently through several PersistentSession objects on the same session (one per
    request, as openai-agents' docs make them) removes and returns a different item per call."""
    async with PersistentSession("s", tmp_path, lock=lock, fsync="batch") as first:
        await first.add_items(ITEMS)
        others = [PersistentSession("s", tmp_path, lock=lock, fsync="batch") for _ in range(3)]
        popped = await asyncio.gather(*(o.pop_item() for o in others), first.pop_item())
        assert sorted(p["content"] for p in popped) == [f"item {i}" for i in range(4, 8)]
        assert await first.get_items() == ITEMS[:4]
        for o in others:
            await o.aclose()


@pytest.mark.postgres
async def test_concurrent_pops_each_remove_a_distinct_item_on_postgres(tmp_path: Path, sid: str,
                                                                       pg_config: dict[str, Any]) -> None:
    """Concurrent pop_item() calls on one session each remove and return a different item (PostgreSQL)."""
    async with PersistentSession(sid, tmp_path, **pg_config) as session:
        await pops_are_distinct(session)
    async with PersistentSession(sid, tmp_path, **pg_config) as again:
        assert await again.get_items() == []


async def test_pop_message_returns_the_newest_and_none_when_empty(tmp_path: Path) -> None:
    """The store's ``pop_message()`` removes the newest message (a redacted event) and returns it; None when the
    history is empty."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        assert await store.pop_message() is None
        await store.add_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
        assert await store.pop_message() == {"role": "assistant", "content": "b"}
        assert await texts(store) == ["a"]
