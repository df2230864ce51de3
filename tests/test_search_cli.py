"""The search commands on a file storage (docs/search.md, "The command"; with --dsn: test_search_postgres.py):
``search`` (text, --json, filters, exit codes 0/1/2), ``show --around``, ``index rebuild|status`` and ``ls``
from the index."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from context_persistent import PersistentContextManager
from test_cli import cli, env, one_line_error  # noqa: F401


async def _sessions(storage: Path) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="shop", fsync="never") as s:
        for i in range(12):
            await s.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"step {i} of the plan"})
        await s.add_message({"role": "assistant", "content": "raise the connection pool size in postgresql.conf",
                             "tool_calls": [{"id": "c1", "type": "function",
                                             "function": {"name": "bash", "arguments": '{"cmd": "vi pg.conf"}'}}]})
        await s.add_message({"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "edited"})
        for i in range(12, 20):
            await s.add_message({"role": "user", "content": f"step {i} of the plan"})
    async with await PersistentContextManager.open(storage_path=storage, session_id="old", fsync="never") as s:
        await s.add_message({"role": "user", "content": "the pool was too small before"})
        await s.clear()
        await s.add_message({"role": "user", "content": "nothing else"})


@pytest.mark.slow
def test_search_show_around_index_and_ls(env: dict[str, str], storage: Path) -> None:  # noqa: F811
    asyncio.run(_sessions(storage))
    p = cli(env, "search", "connection pool")
    assert p.returncode == 0, p.stderr
    head, snippet = p.stdout.splitlines()
    assert re.match(r"shop  seq 14  assistant \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$", head), head
    assert "[connection] [pool]" in snippet
    doc = json.loads(cli(env, "search", "pool", "--all", "--json").stdout)
    assert set(doc) == {"query", "hits", "ranking"} and doc["query"] == "pool"
    assert {(h["session_id"], h["in_view"]) for h in doc["hits"]} == {("shop", True), ("old", False)}
    assert set(doc["hits"][0]) == {"session_id", "seq", "index", "role", "ts", "snippet", "score", "in_view"}
    assert [h["session_id"] for h in json.loads(cli(env, "search", "pool", "--json").stdout)["hits"]] == ["shop"]
    # filters: the tools column, --role, --session, --limit, --since
    assert json.loads(cli(env, "search", "tools:bash", "--role", "tool", "--json").stdout)["hits"][0]["seq"] == 15
    assert len(json.loads(cli(env, "search", "plan", "--session", "shop", "--limit", "3", "--json").stdout)["hits"]) == 3
    assert cli(env, "search", "plan", "--session", "old").returncode == 1
    assert cli(env, "search", "plan", "--since", "2999-01-01").returncode == 1
    assert cli(env, "search", "plan", "--since", "1d").returncode == 0
    p = cli(env, "search", "nothinghere")
    assert p.returncode == 1 and p.stdout == "" and "no match for 'nothinghere'" in p.stderr
    for bad in ('"unbalanced', "a AND", "{nosuchcolumn}:x"):
        p = cli(env, "search", bad)
        assert p.returncode == 2 and one_line_error(p).startswith("context-persistent search: error: ")
    p = cli(env, "search", "plan", "--since", "yesterday")
    assert p.returncode == 2 and "since must be a date" in one_line_error(p)
    # show --around: the hit in context, > marking it
    lines = [ln for ln in cli(env, "show", "shop", "--around", "14", "-C", "2").stdout.splitlines()
             if re.match(r"[> ] +\d+ +\d+ ", ln)]  # (a message's first line: mark, index, seq)
    assert [ln[0] for ln in lines] == [" ", " ", ">", " ", " "] and "connection pool" in lines[2]
    around = json.loads(cli(env, "show", "shop", "--around", "14", "-C", "1", "--json").stdout)
    assert [m["seq"] for m in around["messages"]] == [13, 14, 15] and around["around"] == 14
    # index rebuild / status, ls from the index
    rebuilt = json.loads(cli(env, "index", "rebuild", "--json").stdout)
    assert rebuilt["sessions"] == 2 and rebuilt["documents"] == 24 and rebuilt["failed"] == []
    status = json.loads(cli(env, "index", "status", "--json").stdout)
    assert status["sessions"] == 2 and status["messages"] == 23 and status["bytes"] > 0
    assert status["index"] == str(storage / ".search" / "index.sqlite3")
    listed = {r["session_id"]: r for r in json.loads(cli(env, "ls", "--json").stdout)["sessions"]}
    assert listed["shop"]["messages"] == 22 and listed["shop"]["title"] == "step 0 of the plan"
    assert listed["old"]["title"] == "nothing else" and listed["old"]["first_ts"] <= listed["old"]["last_ts"]
