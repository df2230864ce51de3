"""The viewer's web app without a browser (Starlette's TestClient): the token gate, the read-only API over
real sessions (tests/viewer_sessions.py), redactions kept out, clipping, bad session ids, the hooks for search
and usage, and that nothing is written to the storage."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from context_persistent import PersistentContextManager  # noqa: E402
from context_persistent.viewer import Extensions  # noqa: E402
from context_persistent.viewer.app import create_app  # noqa: E402
from context_persistent.viewer.source import Source  # noqa: E402
from tests.viewer_sessions import HOSTILE, HUGE, SECRET, build  # noqa: E402

TOKEN = "t" * 12 + "-test-token-0123456789"
PORT = 8999


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


class _Search:
    async def search(self, query: str, *, limit: int) -> list[dict[str, Any]]:
        return [{"session_id": "agent", "seq": 3, "snippet": f"found {query}"}][:limit]


class _Usage:
    """A usage provider that answers more reports than it was asked for."""

    async def usage(self, session_id: str, *, at_seq: int | None, limit: int) -> list[dict[str, Any]]:
        return [{"seq": 5, "request_seq": 4, "input_tokens": 1000 + i, "estimated_tokens": None, "output_tokens": 40}
                for i in range(2 * limit + 1)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    storage = tmp_path_factory.mktemp("viewer") / "store"
    facts = asyncio.run(build(storage))
    return storage, facts


@pytest.fixture(scope="module")
def client(built: tuple[Path, dict[str, Any]]) -> Iterator[TestClient]:
    storage, _ = built
    app = create_app(Source(storage), TOKEN, port=PORT, extensions=Extensions(search=_Search()))
    with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def _get(client: TestClient, path: str, **params: Any) -> Any:
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


PATHS = ["/", "/static/app.js", "/api/info", "/api/sessions", "/api/sessions/agent",
         "/api/sessions/agent/timeline", "/api/sessions/agent/export", "/api/sessions/agent/follow", "/nowhere"]


@pytest.mark.parametrize("path", PATHS)
def test_every_path_refuses_a_request_without_the_token(client: TestClient, path: str) -> None:
    """Without a token every page, asset and API answers 401; with a wrong one 403; nothing else leaks."""
    bare = client.get(path, headers={"authorization": ""})
    assert bare.status_code == 401 and "access token" in bare.text and "agent" not in bare.text
    wrong = client.get(path, headers={"authorization": "Bearer " + "x" * 40})
    assert wrong.status_code == 403 and "agent" not in wrong.text


def test_the_token_in_the_url_becomes_a_cookie_and_leaves_the_address(client: TestClient) -> None:
    """The printed URL's token is answered by a redirect without it that sets an HttpOnly cookie, which then opens
    every path; a token in the query string of an API call works as well."""
    r = client.get("/", params={"token": TOKEN}, headers={"authorization": ""}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"context_persistent_viewer_{PORT}={TOKEN};") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    with_cookie = client.get("/api/info", headers={"authorization": "", "cookie": f"context_persistent_viewer_{PORT}={TOKEN}"})
    assert with_cookie.status_code == 200 and with_cookie.json()["read_only"] is True
    other_port = client.get("/api/info", headers={"authorization": "", "cookie": f"context_persistent_viewer_1={TOKEN}"})
    assert other_port.status_code == 401
    assert client.get("/api/info", params={"token": TOKEN}, headers={"authorization": ""}).status_code == 200


def test_answers_carry_a_content_security_policy_that_forbids_inline_script(client: TestClient) -> None:
    """Every answer forbids inline scripts, other origins, frames and the referrer."""
    r = client.get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
    assert 'src="/static/app.js"' in r.text and "<script>" not in r.text


def test_the_sessions_list_has_counts_sizes_times_and_the_fork(client: TestClient,
                                                                built: tuple[Path, dict[str, Any]]) -> None:
    """Each session is listed with its messages, events, bytes, first and last times and its parent."""
    _, facts = built
    rows = {r["session_id"]: r for r in _get(client, "/api/sessions")["sessions"]}
    assert set(rows) == {"agent", "agent-try2"}
    agent = rows["agent"]
    assert agent["events"] == facts["head_seq"] and agent["messages"] == 31 and agent["bytes"] > len(HUGE)
    assert agent["created"] <= agent["last_activity"]
    assert rows["agent-try2"]["parent"] == {"session_id": "agent", "seq": facts["fork_at"]}
    summary = _get(client, "/api/sessions/agent")
    assert summary["forks"] == [{"session_id": "agent-try2", "seq": facts["fork_at"]}]
    assert summary["events"]["compacted"] == 1 and summary["pinned"] == 1


def test_the_timeline_pages_through_the_log_by_seq(client: TestClient, built: tuple[Path, dict[str, Any]]) -> None:
    """The last page ends at the head; a page after a seq starts right after it; ``at`` stops the page there."""
    _, facts = built
    last = _get(client, "/api/sessions/agent/timeline", limit=5)
    assert [r["seq"] for r in last["records"]] == list(range(facts["head_seq"] - 4, facts["head_seq"] + 1))
    page = _get(client, "/api/sessions/agent/timeline", after=3, limit=4)
    assert [r["seq"] for r in page["records"]] == [4, 5, 6, 7]
    assert page["records"][0]["messages"][0]["calls"] == ["call_1"]
    assert page["records"][1]["messages"][0]["answers"] == ["call_1"]
    past = _get(client, "/api/sessions/agent/timeline", at=10, limit=3)
    assert [r["seq"] for r in past["records"]] == [8, 9, 10]
    bad = client.get("/api/sessions/agent/timeline", params={"limit": 5000})
    assert bad.status_code == 400 and "limit must be between 1 and 1000" in bad.json()["error"]


def test_a_redacted_message_never_leaves_the_server(client: TestClient) -> None:
    """The redacted message's text is in no timeline page, record, view or export; the timeline marks it."""
    page = client.get("/api/sessions/agent/timeline", params={"limit": 1000})
    assert SECRET not in page.text
    redacted = [m for r in page.json()["records"] for m in r.get("messages", []) if m.get("redacted")]
    assert len(redacted) == 1 and "message" not in redacted[0]
    seq = redacted[0]["key"] >> 20
    assert SECRET not in client.get(f"/api/sessions/agent/record/{seq}").text
    assert SECRET not in client.get("/api/sessions/agent/messages", params={"limit": 1000}).text
    for fmt in ("jsonl", "json", "markdown"):
        assert SECRET not in client.get("/api/sessions/agent/export", params={"format": fmt}).text


def test_long_strings_are_clipped_and_the_whole_record_is_one_request_away(client: TestClient) -> None:
    """A 300,000-character message is sent clipped with the count left out; the record route sends it whole."""
    page = _get(client, "/api/sessions/agent/messages", start=28, limit=3)
    huge = next(i for i in page["items"] if i["message"].get("tool_call_id") == "call_big")
    assert huge["message"]["content"]["more"] == len(HUGE) - 4000
    whole = _get(client, f"/api/sessions/agent/record/{huge['seq']}")
    assert whole["messages"][0]["message"]["content"] == HUGE


def test_hostile_text_is_sent_as_data(client: TestClient) -> None:
    """Script tags, a javascript: link and control characters come back as the JSON string they were."""
    items = _get(client, "/api/sessions/agent/messages", view="conversation", limit=1000)["items"]
    assert any(i["message"]["content"] == HOSTILE for i in items)


def test_the_views_filter_a_page_of_the_history(client: TestClient) -> None:
    """full has every message of the page, reasoning leaves out system ones, conversation keeps text only."""
    full = _get(client, "/api/sessions/agent/messages", view="full", start=0, limit=6)
    assert [i["index"] for i in full["items"]] == [0, 1, 2, 3, 4, 5] and full["total"] == 31
    reasoning = _get(client, "/api/sessions/agent/messages", view="reasoning", start=0, limit=6)
    assert [i["index"] for i in reasoning["items"]] == [1, 2, 3, 4, 5] and reasoning["left_out"] == 1
    conversation = _get(client, "/api/sessions/agent/messages", view="conversation", start=0, limit=6)
    assert all("tool_calls" not in i["message"] for i in conversation["items"])
    assert [i["message"]["role"] for i in conversation["items"]] == ["user", "assistant", "assistant"]
    last = _get(client, "/api/sessions/agent/messages", limit=2)
    assert last["start"] == 29 and [i["index"] for i in last["items"]] == [29, 30]
    assert client.get("/api/sessions/agent/messages", params={"view": "nope"}).status_code == 400


def test_the_request_view_marks_what_compaction_kept_masked_and_dropped(client: TestClient) -> None:
    """At a small budget each request message says where it comes from; masked copies are matched to their
    originals, notes are not messages of the history, and the rest of the history is left out."""
    req = _get(client, "/api/sessions/agent/request", budget=1500)
    kinds = {m["kind"] for m in req["messages"]}
    assert {"kept", "note", "masked"} <= kinds
    assert req["stats"]["strategy_used"] == "smart" and req["stats"]["groups_dropped"] >= 1
    changed = {int(k) for k in req["changed"]}
    left_out = set(range(req["history_messages"])) - set(req["kept"]) - changed
    assert 2 in left_out and 0 in req["kept"]
    for m in req["messages"]:
        if m["kind"] == "masked":
            assert "masked by context-persistent" in m["message"]["content"] and m["source"] in changed


def test_the_token_chart_places_the_compaction_and_uses_its_budget(client: TestClient) -> None:
    """Per-message and cumulative tokens, the budget the compaction recorded (1,500 asked for, calibrated by the
    provider's reports), the compaction at the history's end."""
    tokens = _get(client, "/api/sessions/agent/tokens")
    assert tokens["messages"] == 31 and len(tokens["points"]) == 31 and tokens["uncounted"] == 0
    assert tokens["points"][-1]["cumulative"] == tokens["total"] > 0
    recorded = tokens["compactions"][0]["data"]["budget"]
    assert tokens["budget"] == recorded < 1500 and tokens["budget_source"] == "recorded"
    assert [c["at"] for c in tokens["compactions"]] == [31]
    past = _get(client, "/api/sessions/agent/tokens", at=13)
    assert past["messages"] == 11 and past["compactions"] == [] and past["budget"] == recorded


def test_time_travel_shows_the_session_as_it_was(client: TestClient) -> None:
    """``at`` shows the history right after that event; a seq past the head is a 400 naming the range."""
    past = _get(client, "/api/sessions/agent/messages", at=4, start=0, limit=10)
    assert [i["seq"] for i in past["items"]] == [2, 3, 4]
    bad = client.get("/api/sessions/agent/messages", params={"at": 999})
    assert bad.status_code == 400 and "beyond the last event" in bad.json()["error"]


def test_exports_are_snapshots_of_the_view_asked_for(client: TestClient, built: tuple[Path, dict[str, Any]]) -> None:
    """The export route sends the store's own snapshot file, named after the session, view and seq."""
    r = client.get("/api/sessions/agent/export", params={"format": "jsonl", "view": "conversation", "at": 12})
    assert r.status_code == 200 and 'filename="agent-at-12-conversation.jsonl"' in r.headers["content-disposition"]
    header = orjson.loads(r.content.split(b"\n", 1)[0])
    assert header["view"] == "conversation" and header["seq_range"] == [1, 12]
    assert client.get("/api/sessions/agent/export", params={"format": "pdf"}).status_code == 400


@pytest.mark.parametrize("sid", ["..", ".hidden", "a%2Fb", "..%2F..%2Fetc", "%2e%2e", "x%00y", "a" * 300])
def test_a_crafted_session_id_never_reaches_outside_the_storage(client: TestClient, sid: str) -> None:
    """Ids that are not session ids are refused (400, naming the rule) or are no path at all (404)."""
    r = client.get(f"/api/sessions/{sid}/timeline")
    assert r.status_code in (400, 404)
    assert "root:" not in r.text


def test_a_session_outside_the_storage_cannot_be_named(client: TestClient, built: tuple[Path, dict[str, Any]]) -> None:
    """A real session in the storage's parent folder is not reachable through ``..``."""
    storage, _ = built
    outside = storage.parent / "outside"
    asyncio.run(_one_session(storage.parent, "outside"))
    assert outside.is_dir()
    for sid in ("..%2Foutside", "%2E%2E%2Foutside"):
        assert client.get(f"/api/sessions/{sid}/messages").status_code in (400, 404)


async def _one_session(storage: Path, sid: str) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid) as store:
        await store.add_message({"role": "user", "content": "outside"})


def test_search_goes_to_the_provider_and_is_absent_without_one(client: TestClient,
                                                                built: tuple[Path, dict[str, Any]]) -> None:
    """With a search provider the route answers its hits; without one it is a 404 saying why."""
    assert _get(client, "/api/search", q="accents")["hits"][0]["snippet"] == "found accents"
    assert _get(client, "/api/info")["features"] == {"search": True, "usage": True}
    storage, _ = built
    with TestClient(create_app(Source(storage), TOKEN, port=PORT),
                    headers={"authorization": f"Bearer {TOKEN}"}) as plain:
        r = plain.get("/api/search", params={"q": "x"})
        assert r.status_code == 404 and "search projection" in r.json()["error"]
        assert plain.get("/api/info").json()["features"] == {"search": False, "usage": True}


def test_the_viewer_writes_nothing_and_takes_no_lock(client: TestClient, built: tuple[Path, dict[str, Any]]) -> None:
    """After every route ran, the storage holds the same files with the same sizes and times, and a writer can
    open a session the viewer has open."""
    storage, _ = built
    before = _tree(storage)
    for path in ("/api/sessions", "/api/sessions/agent", "/api/sessions/agent/timeline",
                 "/api/sessions/agent/messages", "/api/sessions/agent/request?budget=1500",
                 "/api/sessions/agent/tokens?count=1", "/api/sessions/agent/marks", "/api/sessions/agent/record/3",
                 "/api/sessions/agent/export?view=request&budget=1500", "/api/sessions/agent/messages?at=7"):
        assert client.get(path).status_code == 200, path
    assert _tree(storage) == before

    async def write() -> int:
        async with await PersistentContextManager.open(storage_path=storage, session_id="agent-try2") as store:
            return store.head_seq

    assert asyncio.run(write()) > 0


def test_the_served_search_is_the_projection_and_never_writes_to_the_storage(
        tmp_path: Path) -> None:
    """The search `serve` gives the viewer (search.ProjectionSearch) finds a session's words through an index of
    its own: the storage's files are as they were (no `.search` folder made), a redacted message is not found,
    and a bad query is a 400 naming it."""
    from context_persistent.viewer.search import ProjectionSearch

    storage = tmp_path / "store"
    asyncio.run(build(storage))
    before = _tree(storage)
    source = Source(storage)
    searching = ProjectionSearch(source)
    app = create_app(source, TOKEN, port=PORT, extensions=Extensions(search=searching))
    try:
        with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as c:
            assert _get(c, "/api/info")["features"]["search"] is True
            hits = _get(c, "/api/search", q="accented")["hits"]
            assert hits and {h["session_id"] for h in hits} >= {"agent"} and all(h["seq"] >= 1 for h in hits)
            assert "[accented]" in hits[0]["snippet"]
            assert _get(c, "/api/search", q="REDACT")["hits"] == []  # (the redacted message: gone from every view)
            r = c.get("/api/search", params={"q": 'accented AND "'})
            assert r.status_code == 400 and "unbalanced double quote" in r.json()["error"]
        after = _tree(storage)
        assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    finally:
        searching.close()
