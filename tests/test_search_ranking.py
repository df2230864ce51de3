"""Search ranks the matches in the FTS table first and reads only the candidates' documents
(sqlite_index.SqliteIndex._ranked_first): its hits are exactly those of the query joining every match."""

from __future__ import annotations

from pathlib import Path

import pytest

from context_persistent import PersistentContextManager, search
from context_persistent.operations.search.sqlite_index import SqliteIndex


async def _store(root: Path) -> None:
    """The best-ranked matches (short, repeated words) cleared out of the views; weaker ones kept in them."""
    async with await PersistentContextManager.open(storage_path=root, session_id="s", fsync="never") as store:
        for i in range(300):
            await store.add_message({"role": "user", "content": f"needle needle needle {i}"})
        await store.clear()
        for i in range(30):
            filler = " ".join(f"word{j}" for j in range(40))
            await store.add_message({"role": "assistant", "content": f"needle {filler} {i}"})


@pytest.mark.parametrize("limit", [1, 3, 20, 29, 30, 31, 400])
@pytest.mark.parametrize("all_messages", [False, True])
async def test_ranked_candidates_give_the_joined_querys_hits(tmp_path: Path, limit: int,
                                                             all_messages: bool) -> None:
    """With the best matches out of the views (so the candidates run out and the joined query is run) or in
    them, the hits have the joined query's scores, in order, and only shown messages unless all_messages."""
    await _store(tmp_path)
    await search(tmp_path, "warmup")  # (catches the index up)
    index = SqliteIndex(tmp_path)
    try:
        got, ranking = await index.search("needle", session_id=None, role=None, since=None,
                                          all_messages=all_messages, limit=limit)
        want = index._joined("needle", [] if all_messages else ["d.in_view = 1"], [], limit)
    finally:
        index.close()
    assert ranking == {"window": None, "ranked": None, "all_ranked": True}
    assert [r["score"] for r in got] == [r["score"] for r in want]
    assert len(got) == min(limit, 330 if all_messages else 30)
    assert all_messages or all(r["in_view"] for r in got)
    assert all(r["snippet"] for r in got)


async def test_search_of_a_cleared_history_shows_only_what_the_views_show(tmp_path: Path) -> None:
    """The public search returns the in-view matches though 300 better-ranked ones were cleared."""
    await _store(tmp_path)
    hits = await search(tmp_path, "needle", limit=5)
    assert len(hits) == 5 and all(h.in_view and h.role == "assistant" for h in hits)
    hits = await search(tmp_path, "needle", limit=5, all_messages=True)
    assert len(hits) == 5 and all(not h.in_view and h.role == "user" for h in hits)
