"""Ranking a window (docs/search.md, "Ranking"): by default the newest ``window`` matching messages are ranked
and the best ``limit`` of them returned; ``exhaustive`` ranks every match. On both backends the window is
exactly the newest matches by time (across sessions, after the filters, the same after a rebuild), its hits
are those matches ranked by the exhaustive search's own scores, and the result says how many were ranked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, SearchResults
from context_persistent.operations.search.api import RANK_WINDOW
from context_persistent.operations.search.sqlite_index import SqliteIndex, time_id
from pgfixtures import pg_dsn  # noqa: F401
from test_cli import cli, env, one_line_error  # noqa: F401
from test_search import backend  # noqa: F401

N = 40


async def _corpus(backend: Any) -> None:  # noqa: F811
    """N messages holding ``needle`` 1-5 times among 0-16 other words (so their ranks are not their ages),
    alternating between two sessions, a third of them the assistant's; after each, two without it (bm25 gives
    a word in half the messages or more no weight: every score would be about 0)."""
    a, b = await backend.open("a", fsync="never"), await backend.open("b", fsync="never")
    try:
        for i in range(N):
            filler = " ".join(f"w{j}" for j in range((i * 13) % 17))
            await (a if i % 2 == 0 else b).add_message(
                {"role": "assistant" if i % 3 == 0 else "user",
                 "content": f"{' '.join(['needle'] * (1 + (i * 7) % 5))} {filler} n{i}"})
            for _ in range(2):
                await (a if i % 2 == 0 else b).add_message({"role": "user", "content": f"other words {filler}"})
    finally:
        await a.close()
        await b.close()


def _key(h: Any) -> tuple[str, int]:
    return h.session_id, h.seq


async def _expected(backend: Any, window: int, limit: int, **filters: Any) -> tuple[list[Any], int]:  # noqa: F811
    """The window's hits as the exhaustive search defines them: every match (exhaustive, all of them), the
    newest ``window`` by time, ordered by their exhaustive scores (ties: the newer first)."""
    every = await backend.search("needle", exhaustive=True, limit=1000, **filters)
    assert len({h.ts for h in every}) == len(every)  # (distinct times: "newest" is defined)
    newest = sorted(every, key=lambda h: h.ts, reverse=True)[:window]
    order = sorted(newest, key=lambda h: h.ts, reverse=True)
    order.sort(key=lambda h: h.score)
    return order[:limit], len(every)


def _same(got: list[Any], want: list[Any]) -> None:
    assert [_key(h) for h in got] == [_key(h) for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want])


async def test_the_window_ranks_exactly_the_newest_matches(backend: Any) -> None:  # noqa: F811
    await _corpus(backend)
    for window, limit in [(1, 1), (5, 5), (12, 3), (39, 20), (40, 20), (41, 20), (10_000, 40)]:
        got = await backend.search("needle", window=window, limit=limit)
        want, total = await _expected(backend, window, limit)
        _same(got, want)
        assert isinstance(got, SearchResults)
        assert got.ranking == {"window": window, "ranked": min(window, total), "all_ranked": window >= total}
        assert total == N


async def test_the_window_applies_after_the_filters_and_survives_a_rebuild(backend: Any) -> None:  # noqa: F811
    """With a role, a session or a time filter the window is the newest matches that pass it; a rebuild
    (sessions indexed one after the other, not in the order of their messages) gives the same hits."""
    await _corpus(backend)
    every = sorted(await backend.search("needle", exhaustive=True, limit=1000), key=lambda h: h.ts)
    since = every[N // 2].ts
    cases: list[dict[str, Any]] = [{"role": "user"}, {"role": "assistant"}, {"session_id": "b"}, {"since": since},
                                   {"since": since, "role": "user"}]
    before = []
    for filters in cases:
        got = await backend.search("needle", window=7, limit=3, **filters)
        want, total = await _expected(backend, 7, 3, **filters)
        _same(got, want)
        assert got.ranking["ranked"] == min(7, total) and got.ranking["all_ranked"] == (total <= 7)
        before.append([_key(h) for h in got])
    plain = [_key(h) for h in await backend.search("needle", window=9, limit=9)]
    await backend.rebuilt()
    assert [_key(h) for h in await backend.search("needle", window=9, limit=9)] == plain
    assert [[_key(h) for h in await backend.search("needle", window=7, limit=3, **f)] for f in cases] == before


async def test_the_window_of_a_cleared_history_is_of_the_messages_the_search_can_return(
        backend: Any) -> None:  # noqa: F811
    """Matches the views no longer show (cleared) are not in the window unless ``all_messages``: the window
    reaches past them to the newest matches the views show (on the file backend: the FTS table alone while
    the newest matches hold none of them, the documents read when they do)."""
    await _corpus(backend)
    async with await backend.open("a") as store:
        await store.clear()
        for i in range(8):
            await store.add_message({"role": "user", "content": f"needle needle after the clear {'w ' * i}"})
    for window in (3, 12, 25, 1000):  # (12 and 25 reach past the clear, among messages it hid)
        for all_messages in (False, True):
            got = await backend.search("needle", window=window, limit=3, all_messages=all_messages)
            want, total = await _expected(backend, window, 3, all_messages=all_messages)
            _same(got, want)
            assert got.ranking == {"window": window, "ranked": min(window, total), "all_ranked": window >= total}
            assert all_messages or all(h.in_view for h in got)
        assert total == N + 8


async def test_exhaustive_ranks_every_match_and_the_default_window_is_documented(backend: Any) -> None:  # noqa: F811
    await _corpus(backend)
    got = await backend.search("needle", exhaustive=True, limit=5)
    assert got.ranking == {"window": None, "ranked": None, "all_ranked": True}
    best = sorted(await backend.search("needle", exhaustive=True, limit=N), key=lambda h: h.score)[:5]
    assert [h.score for h in got] == pytest.approx([h.score for h in best])
    assert (await backend.search("needle", limit=5)).ranking == {"window": RANK_WINDOW, "ranked": N,
                                                                 "all_ranked": True}
    assert (await backend.search("nothingmatches")).ranking["ranked"] == 0
    docs = (Path(__file__).parent.parent / "docs" / "search.md").read_text()
    assert f"{RANK_WINDOW:,}" in docs.split("## Ranking", 1)[1].split("\n## ", 1)[0]
    with pytest.raises(ValueError, match="window must be an integer from the limit"):
        await backend.search("needle", window=3, limit=5)
    with pytest.raises(ValueError, match="window"):
        await backend.search("needle", window=True)


async def test_store_search_takes_the_window_and_exhaustive(tmp_path: Path) -> None:
    await _corpus(_Files(tmp_path))
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="a") as store:
        mine = await store.search("needle", window=4, limit=2)
        assert mine.ranking == {"window": 4, "ranked": 4, "all_ranked": False}
        assert {h.session_id for h in mine} == {"a"}
        assert (await store.search("needle", all_sessions=True, exhaustive=True)).ranking["window"] is None


class _Files:
    def __init__(self, storage: Path) -> None:
        self.storage = storage

    async def open(self, sid: str, **config: Any) -> PersistentContextManager:
        return await PersistentContextManager.open(storage_path=self.storage, session_id=sid, **config)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "postgres"])
def test_the_cli_flags_and_the_json_ranking(env: dict[str, str], storage: Path, where: str,  # noqa: F811
                                            request: pytest.FixtureRequest) -> None:
    """``--window N`` and ``--exhaustive``; ``--json`` has ``ranking``; the text output says when older
    matches were left unranked (on stderr); a bad window is a one-line error."""
    import asyncio

    args: list[str] = []
    if where == "postgres":
        from search_backends import PgBackend, fresh_schema

        dsn = request.getfixturevalue("pg_dsn")
        pgb = PgBackend(dsn, fresh_schema(), storage)
        asyncio.run(_corpus(pgb))
        args = ["--dsn", dsn, "--pg-schema", pgb.schema]
    else:
        asyncio.run(_corpus(_Files(storage)))
    try:
        p = cli(env, "search", "needle", "--window", "6", "--limit", "2", "--json", *args)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["ranking"] == {"window": 6, "ranked": 6, "all_ranked": False} and len(doc["hits"]) == 2
        p = cli(env, "search", "needle", "--exhaustive", "--json", *args)
        assert json.loads(p.stdout)["ranking"] == {"window": None, "ranked": None, "all_ranked": True}
        p = cli(env, "search", "needle", *args)
        assert p.returncode == 0 and p.stdout.count(" seq ") == 20 and p.stderr == ""  # (all 40 ranked)
        p = cli(env, "search", "needle", "--window", "6", "--limit", "2", *args)
        assert p.returncode == 0 and p.stdout.count(" seq ") == 2
        assert p.stderr.strip() == ("ranked the newest 6 matching messages; older ones match too (--exhaustive "
                                    "ranks them all)")
        p = cli(env, "search", "needle", "--window", "0", *args)  # (argparse: its usage, then the error)
        assert p.returncode == 2 and "--window: expected a number of matches" in p.stderr.splitlines()[-1]
        p = cli(env, "search", "needle", "--window", "3", "--limit", "5", *args)
        assert p.returncode == 2 and "window must be an integer from the limit (5)" in one_line_error(p)
    finally:
        if where == "postgres":
            from pgfixtures import run_sql

            run_sql(dsn, f"DROP SCHEMA IF EXISTS {pgb.schema} CASCADE")


async def test_document_ids_follow_time(tmp_path: Path) -> None:
    """Ids are the message's microsecond x 256, then the next free one: messages of one microsecond (a list
    record) keep their order; a time that is not ISO is the epoch."""
    from context_persistent.operations.search.fold import Doc

    index = SqliteIndex(tmp_path, tmp_path / "i.sqlite3")
    try:
        t0, t1 = "2026-01-02T03:04:05.006000+00:00", "2026-01-02T03:04:05.009000+00:00"
        assert time_id(t1) - time_id(t0) == 3000 * 256 and time_id("2026-01-02T03:04:05.006Z") == time_id(t0)
        assert time_id("not a time") == 0 and time_id("2026-01-02T03:04:05.006") == time_id(t0)
        assert time_id("2026-01-02T04:04:05.006+01:00") == time_id(t0)
        assert 0 < time_id("2999-12-31T23:59:59.999999+00:00") < 1 << 63

        def doc(key: int, ts: str) -> tuple[Doc, bool]:
            return Doc(key, key, 0, 0, "user", ts, f"word{key}", "", b"%d" % key), True

        async with index.writing():
            await index.insert_docs("s", [doc(k, t1) for k in range(5)])
            await index.insert_docs("s", [doc(k, t0) for k in range(5, 2005)])  # (more than 256 ids apart)
        ids = dict(index.db.execute("SELECT key, id FROM docs"))
        assert [ids[k] for k in range(5)] == [time_id(t1) + k for k in range(5)]
        later = [ids[k] for k in range(5, 2005)]
        assert later == sorted(later) and len(set(later)) == 2000 and later[0] == time_id(t0)
        assert set(later).isdisjoint(ids[k] for k in range(5))
        assert index.db.execute("SELECT count(*) FROM fts WHERE rowid IN (SELECT id FROM docs)").fetchone()[0] == 2005
    finally:
        index.close()


async def test_a_long_list_record_is_indexed_with_a_few_statements_a_message(tmp_path: Path) -> None:
    """The messages of one list record (a host's whole transcript in one ``set_messages``) share their record's
    time: each gets the id after the previous one's, in order, with a few SQL statements a message (finding a
    free id again for each message made indexing grow with the square of the list: 8,000 messages took 1.8 s,
    32,000 would take half a minute), and the newest of them is the first of the window."""
    from context_persistent.operations.search.indexer import catch_up_storage

    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="t", search_index=False,
                                                   fsync="never") as store:
        await store.set_messages([{"role": "user", "content": f"common m{i}"} for i in range(3000)])
        await store.add_message({"role": "user", "content": "common later"})
    index = SqliteIndex(tmp_path)
    statements: list[str] = []
    index.db.set_trace_callback(statements.append)
    try:
        await catch_up_storage(index, tmp_path)
        ids = [r[0] for r in index.db.execute("SELECT id FROM docs ORDER BY key")]
    finally:
        index.db.set_trace_callback(None)
        index.close()
    assert len(ids) == 3001 and ids == sorted(ids) and len(set(ids)) == 3001
    # (about 4 a message with FTS5's own; the search for a free id per message added about 12 more at 3,000)
    assert len(statements) < 6 * 3001, len(statements)
    hits = await store_search(tmp_path, "common", window=1, limit=1)
    assert [h.snippet for h in hits] == ["[common] later"]



async def store_search(storage: Path, query: str, **kw: Any) -> Any:
    from context_persistent.operations.search import search

    return await search(storage, query, **kw)
