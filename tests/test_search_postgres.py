"""The search index on PostgreSQL (docs/search.md, "PostgreSQL"): the store keeps it current, trash, erasure
and redaction take text out of it, ``ls``, ``search`` and ``index`` work with ``--dsn``, hostile queries are
an error or an answer, and scripts without spaces are found. (The random-operations property runs on both
backends in test_search.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from context_persistent import QueryError
from context_persistent.model.retention import RetentionPolicy
from context_persistent.operations.search.pg_index import PgIndex
from context_persistent.operations.search.pg_text import compile_query
from pgfixtures import pg_dsn, run_sql  # noqa: F401
from search_backends import PgBackend, fresh_schema
from test_cli import cli, env  # noqa: F401
from test_search import HOSTILE


@pytest.fixture
def pgb(pg_dsn: str, tmp_path: Path) -> Iterator[PgBackend]:  # noqa: F811
    schema = fresh_schema()
    yield PgBackend(pg_dsn, schema, tmp_path)
    run_sql(pg_dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def _docs(pgb: PgBackend, sql: str = "SELECT body FROM {s}.search_docs") -> list[Any]:
    index = PgIndex(pgb.dsn, pgb.schema)
    try:
        return [r[0] for r in await index._fetch(sql)]
    finally:
        await index.aclose()


async def test_the_writer_indexes_and_text_leaves_with_trash_erasure_and_redaction(pgb: PgBackend) -> None:
    """A closed writer's messages are in the tables without a reader catching up; a redacted and an erased
    message leave them (the erase receipt names the index, verify_erasure checks it), and a trashed session's
    rows go with its sessions row; a restored one is indexed again by the next catch-up."""
    async with await pgb.open("a") as store:
        await store.add_message({"role": "user", "content": "alpha wordredact"})
        await store.add_message({"role": "user", "content": "beta worderase"})
        await store.add_message({"role": "assistant", "content": "gamma keepword"})
    assert sorted(await _docs(pgb)) == ["alpha wordredact", "beta worderase", "gamma keepword"]
    async with await pgb.open("a") as store:
        assert [h.seq for h in await store.search("keepword")] == [4]
        await store.redact(0)
        receipt = await store.erase(0)  # ("beta worderase": the first after the redaction)
        # (the erase first lets the writer's index thread finish the redaction; then only the erased message's
        # document leaves, and nothing is indexed again)
        assert receipt["index"]["action"] == "purged" and receipt["index"]["documents_removed"] == 1
        assert receipt["index"]["documents_indexed_again"] == 0 and not receipt["index"]["session_indexed_again"]
        assert await store.verify_erasure(receipt) == []
    await pgb.caught_up()
    assert await _docs(pgb) == ["gamma keepword"]
    assert await pgb.search("wordredact", all_messages=True) == []
    assert await pgb.search("worderase", all_messages=True) == []
    async with await pgb.open("b") as store:
        await store.add_message({"role": "user", "content": "newer session"})
    await pgb.trash(RetentionPolicy(max_sessions=1))
    assert await _docs(pgb, "SELECT count(*) FROM {s}.search_docs WHERE session_id = 'a'") == [0]
    assert await pgb.search("keepword") == []
    assert await pgb.restore_one()
    assert [h.session_id for h in await pgb.search("keepword")] == ["a"]


async def test_a_read_only_search_never_shows_a_redaction_the_index_has_not_caught_up_with(pgb: PgBackend) -> None:
    """The viewer's search on PostgreSQL writes nothing (``read_only``: no catch-up). A message redacted in the
    log after the index last caught up is not shown (its session's hits are left out until the index catches
    up), where before the redacted text was returned; appends alone after the index leave hits shown; a search
    that may write catches the session up and shows the rest."""
    async with await pgb.open("r", search_index=False) as store:
        await store.add_message({"role": "user", "content": "secretword one"})
        await store.add_message({"role": "assistant", "content": "keepword two"})
    await pgb.caught_up()
    async with await pgb.open("r", search_index=False) as store:  # (the writer does not index: a log ahead)
        await store.add_message({"role": "user", "content": "later words"})
    assert [h.seq for h in await pgb.search("keepword", read_only=True)] == [3]  # (only an append since)
    async with await pgb.open("r", search_index=False) as store:
        await store.redact(0)
    assert await pgb.search("secretword", read_only=True) == []
    assert await pgb.search("keepword", read_only=True) == []  # (the session is left out until caught up)
    assert [h.seq for h in await pgb.search("keepword")] == [3]
    assert await pgb.search("secretword") == []
    assert [h.seq for h in await pgb.search("keepword", read_only=True)] == [3]


async def test_unicode_filters_ls_and_a_huge_output(pgb: PgBackend) -> None:
    """CJK inside sentences, RTL text, diacritics and text around emoji are found; role, session and since
    filter; a 3 MB tool output is indexed up to its first MiB; ls lists counts, sizes, times and the title."""
    huge = "startmarker " + "x " * 1_500_000 + " endmarker"
    async with await pgb.open("u") as store:
        await store.add_message({"role": "user", "content": "我们讨论了数据库连接池的问题"})
        await store.add_message({"role": "assistant", "content": "שלום עולם and 🚀 rocketword résumé"})
        await store.add_message({"role": "tool", "tool_call_id": "1", "name": "bash", "content": huge})
    assert [h.seq for h in await pgb.search("数据库")] == [2]
    assert "[数据库]" in (await pgb.search("数据库"))[0].snippet
    assert [h.seq for h in await pgb.search("עולם")] == [3]
    assert [h.seq for h in await pgb.search("resume")] == [3]
    assert [h.seq for h in await pgb.search("rocketword")] == [3]
    assert [h.seq for h in await pgb.search("startmarker")] == [4]
    assert await pgb.search("endmarker") == []
    assert [h.seq for h in await pgb.search("tools:bash")] == [4]
    assert await pgb.search("rocketword", role="user") == []
    assert await pgb.search("rocketword", session_id="other") == []
    assert await pgb.search("rocketword", since="2999-01-01") == []
    [row] = await pgb.list()
    assert row["messages"] == 3 and row["events"] == 4 and row["title"] == "我们讨论了数据库连接池的问题"
    assert row["first_ts"] <= row["last_ts"] and row["bytes"] > 3_000_000


@pytest.mark.parametrize("query", HOSTILE + ["NEAR(a b)", "tools:", "a NOT", "NOT a", ")", "a)"])
async def test_hostile_queries_are_an_error_or_an_answer(pgb: PgBackend, query: str) -> None:
    """Every hostile query either runs on PostgreSQL or raises QueryError with a one-line message."""
    async with await pgb.open("h") as store:
        await store.add_message({"role": "user", "content": "a b c plain text"})
    try:
        await pgb.search(query)
    except QueryError as e:
        assert "\n" not in str(e) and str(e)


def test_the_query_language_as_tsquery() -> None:
    """Phrases, prefixes, boolean operators (FTS5's precedence), columns and CJK words become tsquery."""
    assert compile_query('"connection refused" AND postgres*')[0] == \
        "(('connection' <-> 'refused') & 'postgres':*)"
    assert compile_query("a NOT b OR c")[0] == "(('a' & !'b') | 'c')"
    assert compile_query("tools:bash")[0] == "'bash':A"
    assert compile_query("数据库")[0] == "('数' <-> '据' <-> '库')"
    assert compile_query("🚀")[0] is None
    assert compile_query("O'Brien")[0] == "('o' <-> 'brien')"
    with pytest.raises(QueryError, match="ends where a word is expected"):
        compile_query("a AND")


def test_search_index_and_ls_commands_with_dsn(pgb: PgBackend, env: dict[str, str]) -> None:
    """``ls --dsn`` lists counts and titles from the index, ``search --dsn`` finds (exit 0, 1 without a hit),
    ``index status`` and ``index rebuild`` work on the schema's tables."""
    import asyncio

    async def write() -> None:
        async with await pgb.open("c1") as store:
            await store.add_message({"role": "user", "content": "deploy the otters"})
    asyncio.run(write())
    flags = ["--dsn", pgb.dsn, "--pg-schema", pgb.schema]
    listed = json.loads(cli(env, "ls", "--json", *flags).stdout)
    [row] = listed["sessions"]
    assert row["session_id"] == "c1" and row["messages"] == 1 and row["title"] == "deploy the otters"
    p = cli(env, "search", "otters", "--json", *flags)
    assert p.returncode == 0 and json.loads(p.stdout)["hits"][0]["snippet"] == "deploy the [otters]"
    assert cli(env, "search", "nothinghere", *flags).returncode == 1
    p = cli(env, "search", "a AND", *flags)
    assert p.returncode == 2 and "bad query" in p.stderr and "Traceback" not in p.stderr
    status = json.loads(cli(env, "index", "status", "--json", *flags).stdout)
    assert status["sessions"] == 1 and status["messages"] == 1 and status["bytes"] > 0
    rebuilt = json.loads(cli(env, "index", "rebuild", "--json", *flags).stdout)
    assert rebuilt["sessions"] == 1 and rebuilt["documents"] == 1 and rebuilt["failed"] == []


async def test_a_lost_or_tampered_search_table_is_rebuilt_never_trusted(pgb: PgBackend) -> None:
    """A row changed behind the log's back (its fingerprint) is never returned: the session is indexed again;
    a search table dropped makes every table be made again and filled from the rows."""
    async with await pgb.open("d") as store:
        await store.add_message({"role": "user", "content": "about otters"})
    expected = await pgb.rebuilt()
    for change in ("UPDATE {s}.search_docs SET fp = '\\x00'::bytea", "DROP TABLE {s}.search_docs CASCADE",
                   "DROP TABLE {s}.search_sessions CASCADE"):
        index = PgIndex(pgb.dsn, pgb.schema)
        try:
            await index._run(change)
        finally:
            await index.aclose()
        assert [h.seq for h in await pgb.search("otters")] == [2]
        assert await pgb.caught_up() == expected
