"""The viewer on the PostgreSQL backend (``serve --dsn``; skipped without a server, required in CI): the sessions
list, a session's timeline, its views, the request view, time travel, provider usage, live follow of an append
made through another connection, and the read-only guarantee (no writer lock taken, not a row written)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgfixtures import execute, pg_dsn, pg_schema, run_sql  # noqa: F401

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from context_persistent import PersistentContextManager  # noqa: E402
from context_persistent.storage.pg.connection import lock_key  # noqa: E402
from context_persistent.viewer.app import create_app  # noqa: E402
from context_persistent.viewer.source import Source  # noqa: E402
from context_persistent.viewer.timeline import follow_records  # noqa: E402

TOKEN = "p" * 12 + "-postgres-test-token-0123456789"


def _call(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"step {i}",
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]}


async def _build(cfg: dict[str, Any], root: Path, sid: str) -> dict[str, int]:
    """A session with tool calls and results, a pin, usage reports and a compaction, and a fork of it."""
    async with await PersistentContextManager.open(storage_path=root, session_id=sid, **cfg) as store:
        await store.add_message({"role": "system", "content": "You are a careful agent."})
        await store.add_message({"role": "user", "content": "Find the bug, <b>please</b>."})
        for i in range(1, 9):
            await store.add_message(_call(i))
            await store.add_message({"role": "tool", "tool_call_id": f"call_{i}", "content": f"line {i}\n" * 80})
            if i % 3 == 0:
                await store.get_messages_for_request()
                await store.record_usage({"input_tokens": 900 * i, "output_tokens": 20}, provider="openai",
                                         model="gpt-4o", id=f"resp_{i}")
        await store.add_message({"role": "assistant", "content": "Found it: an off-by-one in the loop."})
        pin = store.head_seq
        await store.pin(seq=pin)
        await store.add_message({"role": "user", "content": "Thanks."})
        await store.get_messages_for_request(token_budget=600)
        mid = pin - 4
    async with await PersistentContextManager.open(storage_path=root, session_id=sid, readonly=True, **cfg) as store:
        await store.fork(f"{sid}-fork", at_seq=pin)
        head = store.head_seq
    return {"pin": pin, "mid": mid, "head": head}


async def _rows(dsn: str, schema: str) -> list[Any]:
    """Every table of the schema, as a count and a hash of its rows."""
    out = []
    for table in ("schema_version", "sessions", "events", "checkpoints"):
        out += [(table, *r) for r in await execute(
            dsn, f"SELECT count(*), coalesce(sum(hashtext(t::text)::bigint), 0) FROM {schema}.{table} t")]
    return out


async def _locks(dsn: str, schema: str, sid: str) -> int:
    key = lock_key(schema, sid)
    rows = await execute(dsn, """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
                                 AND classid = $1::bigint::oid AND objid = $2::bigint::oid""",
                         (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)
    return int(rows[0][0])


@pytest.fixture(scope="module")
def pg(pg_dsn: str, pg_schema: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # noqa: F811
    cfg = {"backend": "postgres", "dsn": pg_dsn, "pg_schema": pg_schema}
    root = tmp_path_factory.mktemp("viewer-pg")
    sid = f"v-{uuid.uuid4().hex[:10]}"
    facts = asyncio.run(_build(cfg, root, sid))
    return {"cfg": cfg, "root": root, "sid": sid, **facts}


@pytest.fixture(scope="module")
def client(pg: dict[str, Any]) -> Iterator[TestClient]:
    app = create_app(Source(pg["root"], pg["cfg"]), TOKEN, port=8996)
    with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def _get(client: TestClient, path: str, **params: Any) -> Any:
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_sessions_list_and_a_session_on_postgres(client: TestClient, pg: dict[str, Any]) -> None:
    """The list has the session and its fork with counts and times; the session's facts name the fork."""
    info = _get(client, "/api/info")
    assert info["backend"] == "postgres" and pg["cfg"]["pg_schema"] in info["source"]
    rows = {r["session_id"]: r for r in _get(client, "/api/sessions")["sessions"]}
    row = rows[pg["sid"]]
    assert row["messages"] == 20 and row["events"] == pg["head"] and row["created"] and row["last_activity"]
    assert rows[f"{pg['sid']}-fork"]["parent"] == {"session_id": pg["sid"], "seq": pg["pin"]}
    facts = _get(client, f"/api/sessions/{pg['sid']}")
    assert facts["events"]["usage_reported"] == 2 and facts["pinned"] == 1
    assert facts["forks"] == [{"session_id": f"{pg['sid']}-fork", "seq": pg["pin"]}]


def test_the_timeline_and_the_views_on_postgres(client: TestClient, pg: dict[str, Any]) -> None:
    """The last page, a page after a seq, tool results paired with calls, and the three views."""
    s = f"/api/sessions/{pg['sid']}"
    last = _get(client, s + "/timeline", limit=5)["records"]
    assert [r["seq"] for r in last] == list(range(pg["head"] - 4, pg["head"] + 1))
    page = _get(client, s + "/timeline", after=3, limit=4)["records"]
    assert [r["seq"] for r in page] == [4, 5, 6, 7]
    assert page[0]["messages"][0]["calls"] == ["call_1"]
    full = _get(client, s + "/messages", view="full", start=0, limit=100)
    assert full["total"] == 20 and full["items"][1]["message"]["content"] == "Find the bug, <b>please</b>."
    assert [i["pinned"] for i in full["items"]].count(True) == 1
    conv = _get(client, s + "/messages", view="conversation", start=0, limit=100)
    assert all(i["message"]["role"] in ("user", "assistant") for i in conv["items"]) and conv["left_out"] > 0
    assert _get(client, s + "/record/1")["type"] == "session_started"


def test_the_request_view_time_travel_and_usage_on_postgres(client: TestClient, pg: dict[str, Any]) -> None:
    """The request view at a small budget leaves messages out; the session at a past seq has the messages of
    then; the chart has the provider's reports up to that seq."""
    s = f"/api/sessions/{pg['sid']}"
    req = _get(client, s + "/request", budget=600)
    assert req["budget"] <= 600 and len(req["kept"]) < req["history_messages"] == 20
    past = _get(client, s + "/messages", at=pg["mid"], start=0, limit=100)
    assert past["head_seq"] == pg["mid"] and all(i["seq"] <= pg["mid"] for i in past["items"])
    assert past["total"] == len([i for i in past["items"]]) < 20
    tokens = _get(client, s + "/tokens")
    assert [u["input_tokens"] for u in tokens["usage"]] == [2700, 5400] and tokens["compactions"]
    early = _get(client, s + "/tokens", at=tokens["usage"][0]["seq"])
    assert [u["input_tokens"] for u in early["usage"]] == [2700] and early["messages"] < 20
    assert client.get(s + "/messages", params={"at": pg["head"] + 9}).status_code == 400


def test_live_follow_sees_an_append_made_through_another_connection(pg: dict[str, Any]) -> None:
    """follow yields the record a writer appends on its own connection, and nothing before it."""

    async def run() -> dict[str, Any]:
        source = Source(pg["root"], pg["cfg"])
        async with source.store(f"{pg['sid']}-fork") as store:
            after = store.head_seq
        stream = follow_records(source, source.marks, f"{pg['sid']}-fork", after)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)
        async with await PersistentContextManager.open(storage_path=pg["root"], session_id=f"{pg['sid']}-fork",
                                                       **pg["cfg"]) as writer:
            await writer.add_message({"role": "user", "content": "appended elsewhere"})
        rec = await asyncio.wait_for(first, 20)
        await stream.aclose()
        await source.close()
        return {"after": after, "rec": rec}

    got = asyncio.run(run())
    assert got["rec"]["seq"] == got["after"] + 1
    assert got["rec"]["messages"][0]["message"]["content"] == "appended elsewhere"


def test_the_viewer_takes_no_lock_and_writes_no_row_on_postgres(client: TestClient, pg: dict[str, Any],
                                                               pg_dsn: str, pg_schema: str) -> None:  # noqa: F811
    """Every route leaves every table's rows as they were, no advisory lock of the session is held while the
    viewer has it open, and a writer can open it meanwhile."""
    s = f"/api/sessions/{pg['sid']}"
    before = asyncio.run(_rows(pg_dsn, pg_schema))
    for path in ("/api/sessions", s, s + "/timeline", s + "/messages", s + "/request?budget=600",
                 s + "/tokens?count=1", s + "/marks", s + "/record/2", f"{s}/messages?at={pg['mid']}",
                 f"{s}/request?at={pg['mid']}", f"{s}/export?view=full&at={pg['mid']}"):
        assert client.get(path).status_code == 200, path
    assert asyncio.run(_rows(pg_dsn, pg_schema)) == before
    assert asyncio.run(_locks(pg_dsn, pg_schema, pg["sid"])) == 0

    async def writer_opens() -> int:
        async with await PersistentContextManager.open(storage_path=pg["root"], session_id=pg["sid"],
                                                       **pg["cfg"]) as store:
            return int(store.head_seq)

    assert asyncio.run(writer_opens()) == pg["head"]
    run_sql(pg_dsn, "SELECT 1")
