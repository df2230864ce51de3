"""The request views alone: a view is cached per budget and extended (not rebuilt) after appends; over the
budget it is compacted, the hooks hear of it, its audit record waits in the writer, the last compaction is
noted and, with export_on_compact, the reasoning view is exported; the front section's hints follow the
largest budget seen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from context_persistent.model import events as ev
from context_persistent.store.ledger import TokenLedger
from context_persistent.store.request_views import RequestViews
from parts import Hooks, started


def turn(i: int) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": '{"p": "f"}'}}
    return [{"role": "user", "content": f"question {i} " + "words " * 30},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "output " * 60},
            {"role": "assistant", "content": f"answer {i} " + "more " * 20}]


async def views_over(storage: Path, turns: int, **config: Any) -> tuple[Any, Any, RequestViews, list[Path]]:
    hooks = Hooks()
    session, writer = await started(storage, tokenizer="chars/4", **config)
    session.hooks = hooks
    for i in range(turns):
        for m in turn(i):
            await writer.commit(ev.MESSAGE_ADDED, {"message": m})
    exported: list[Path] = []

    async def export_reasoning(path: Path) -> None:
        exported.append(path)

    return session, writer, RequestViews(session, TokenLedger(session), writer, export_reasoning), exported


async def test_a_view_is_cached_and_extended_after_an_append(storage: Path, rebuilds: Any) -> None:
    """The second request at the same budget builds nothing; one appended message extends the view; a lower
    budget the view still fits under keeps it, a higher one or one it no longer fits under builds anew."""
    session, writer, views, _ = await views_over(storage, 3)

    async def exact(budget: int) -> Any:
        return await views.view(budget, "explicit", exact=True)
    first = await exact(100_000)
    assert first.messages == session.state.messages and not first.compacted and rebuilds.count == 1
    assert await exact(100_000) is first and rebuilds.count == 1
    await writer.commit(ev.MESSAGE_ADDED, {"message": {"role": "user", "content": "one more"}})
    grown = await exact(100_000)
    assert grown.messages[-1] == {"role": "user", "content": "one more"} and rebuilds.count == 1
    assert await exact(50_000) is grown and rebuilds.count == 1  # (still far under 92%)
    await writer.commit(ev.MESSAGE_ADDED, {"message": {"role": "assistant", "content": "ok"}})
    assert (await exact(50_000)).messages[-1]["content"] == "ok" and rebuilds.count == 1
    await exact(100_000)  # (the budget it was built for: still the cached view)
    assert rebuilds.count == 1
    await exact(150_000)  # a higher budget: built for the room it gives
    assert rebuilds.count == 2
    small = grown.token_count // 2
    assert (await exact(small)).token_count <= small and rebuilds.count == 3
    await session.log.close()


async def test_a_compacted_view_is_reported_audited_and_exported(storage: Path) -> None:
    """Over the budget: pre/post compaction hook events, one deferred ``compacted`` record, last_compaction
    noted at the head, and the reasoning view exported under the session's folder."""
    session, writer, views, exported = await views_over(storage, 20, export_on_compact=True)
    view = await views.view(1000, "explicit")
    assert view.compacted and view.token_count <= 1000
    hooks = session.hooks
    assert hooks.names() == ["context:pre_compact", "context:post_compact", "context:compaction"]
    assert [t for t, _, _ in writer.deferred] == [ev.COMPACTED]
    assert writer.deferred[0][1]["budget"] == 1000 and writer.deferred[0][1]["budget_source"] == "explicit"
    assert session.last_compaction is not None and session.last_compaction["at_seq"] == session.state.head_seq
    assert exported == [storage / "part" / f"compaction-{session.state.head_seq:010d}.jsonl"]
    assert session.state.head_seq == 81  # a view is a read: nothing was written
    await session.log.close()


async def test_should_compact_and_the_front_hints_follow_the_budgets(storage: Path) -> None:
    """should_compact compares with compact_threshold * budget; front_hints cover twice the largest budget."""
    session, _, views, _ = await views_over(storage, 2, max_tokens=5000, compact_threshold=0.5)
    assert views.should_compact(2500) and not views.should_compact(2499)
    assert views.should_compact(100, budget=200) and not views.should_compact(99, budget=200)
    assert views.front_hints() == (session.compaction.keep_head, 2 * 5000)
    await views.view(8000, "explicit")
    assert views.front_hints()[1] == 2 * 8000
    await session.log.close()
