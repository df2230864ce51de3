"""Importing other agents' sessions (store/importers, `import --from`): Claude Code, Codex, pi and opencode files from
those projects' published fixtures (fixtures/*/NOTICE.md) and generated large ones, mapped to messages with
tool calls and results paired, provenance kept, re-import idempotent, and a damaged line importing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard

from conftest import ROOT
from context_persistent import MalformedInputError, PersistentContextManager, SessionExistsError
from context_persistent.store.importers import import_agent_sessions
from context_persistent.storage.log import scan

FIX = ROOT / "fixtures"
CLAUDE = FIX / "claude-code" / "representative_messages.jsonl"
CODEX = FIX / "codex" / "rollout-2026-01-02T03-04-05-11111111-1111-4111-8111-111111111111.jsonl"
PI_V1 = FIX / "pi" / "before-compaction-excerpt.jsonl"
PI_V3 = FIX / "pi" / "session-format-v3-example.jsonl"
OPENCODE = FIX / "opencode" / "opencode.db"


async def _messages(storage: Path, sid: str) -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, readonly=True) as s:
        return await s.get_messages()


def _started(storage: Path, sid: str) -> dict[str, Any]:
    return next(iter(scan(storage / sid / "events.jsonl")))[0]["data"]


def _calls_then_results(messages: list[dict[str, Any]]) -> list[str]:
    """Every result's id, checked to follow a call with that id."""
    seen, out = set(), []
    for m in messages:
        seen.update(c["id"] for c in m.get("tool_calls") or ())
        if m["role"] == "tool":
            assert m["tool_call_id"] in seen, m
            out.append(m["tool_call_id"])
    return out


async def test_claude_code_fixture(storage: Path) -> None:
    """Claude Code: user/assistant text, tool_use as tool_calls, tool_result as a paired tool message; the
    summary line is counted, not imported; provenance names the file, digest and Claude Code's session id."""
    [r] = await import_agent_sessions([CLAUDE], source="claude-code", storage_path=storage)
    assert r["session_id"] == "claude-code:test_session" and r["messages"] == 11
    assert r["ignored"] == {"summary": 1} and r["unanswered"] == r["orphaned"] == 0
    msgs = await _messages(storage, r["session_id"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "tool", "assistant", "user",
                                         "assistant", "tool", "assistant", "user"]
    assert msgs[3]["tool_calls"][0]["function"]["name"] == "Edit"
    assert json.loads(msgs[3]["tool_calls"][0]["function"]["arguments"])["file_path"] == "/tmp/decorator_example.py"
    assert _calls_then_results(msgs) == ["tool_001", msgs[8]["tool_call_id"]]
    assert [m["imported"]["line"] for m in msgs][:5] == [1, 2, 3, 4, 5]
    started = _started(storage, r["session_id"])["imported"]
    assert started["format"] == "claude-code" and started["agent_session_id"] == "test_session"
    assert started["path"] == str(CLAUDE) and started["digest"].startswith("sha256:")
    assert started["ignored"] == {"summary": 1}


async def test_codex_fixture_plain_and_zstd(storage: Path, tmp_path: Path) -> None:
    """Codex: messages, reasoning summaries, function and custom tool calls paired with their outputs; event_msg,
    turn_context and an unknown record counted; a .jsonl.zst rollout gives the same messages."""
    [r] = await import_agent_sessions([CODEX], source="codex", storage_path=storage)
    assert r["ignored"] == {"turn_context": 1, "event_msg": 2, "future_synthetic_record": 1}
    msgs = await _messages(storage, r["session_id"])
    assert msgs[0] == {"role": "user", "content": "List the synthetic files.", "imported": {"line": 4}}
    assert msgs[1]["reasoning_content"] == "I will inspect the synthetic directory."
    assert "SYNTHETIC_ENCRYPTED" not in json.dumps(msgs)
    assert _calls_then_results(msgs) == ["call-structured-001", "call-custom-001", "call-mcp-001"]
    assert msgs[5]["content"] == "Done!" and msgs[-1]["content"].startswith("The synthetic files")
    packed = tmp_path / (CODEX.name + ".zst")
    packed.write_bytes(zstandard.ZstdCompressor().compress(CODEX.read_bytes()))
    [z] = await import_agent_sessions([packed], source="codex", storage_path=storage, session_id="zst")
    assert [m["content"] for m in await _messages(storage, "zst")] == [m["content"] for m in msgs]


async def test_pi_fixtures_v1_and_v3(storage: Path) -> None:
    """pi: a real version-1 excerpt (thinking, a tool call and its result) and the documented version-3 example
    (its tool result answers no call: reported as orphaned; model and thinking changes counted)."""
    [r1, r3] = [(await import_agent_sessions([p], source="pi", storage_path=storage))[0] for p in (PI_V1, PI_V3)]
    msgs = await _messages(storage, r1["session_id"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "user"]
    assert msgs[1]["reasoning_content"] and _calls_then_results(msgs) == [msgs[2]["tool_call_id"]]
    assert r1["session_id"] == "pi:ffae836b-9420-4060-ac13-7745215f90ff"
    assert r3["orphaned"] == 1 and r3["ignored"] == {"model_change": 1, "thinking_level_change": 1}
    assert [m["content"] for m in await _messages(storage, r3["session_id"])] == ["Hello", "Hi!", "output"]


async def test_pi_tree_imports_the_active_branch(storage: Path, tmp_path: Path) -> None:
    """A version-3 file with a branch: the path from the last entry to the root, the other branch counted."""
    entries = [{"type": "session", "version": 3, "id": "s"},
               {"type": "message", "id": "a", "parentId": None, "message": {"role": "user", "content": "q"}},
               {"type": "message", "id": "b", "parentId": "a",
                "message": {"role": "assistant", "content": [{"type": "text", "text": "first try"}]}},
               {"type": "message", "id": "c", "parentId": "a",
                "message": {"role": "assistant", "content": [{"type": "text", "text": "second try"}]}}]
    path = tmp_path / "tree.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    [r] = await import_agent_sessions([path], source="pi", storage_path=storage)
    assert [m["content"] for m in await _messages(storage, r["session_id"])] == ["q", "second try"]
    assert r["ignored"] == {"other_branch": 1}
    entries[3]["parentId"] = "zz"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    with pytest.raises(MalformedInputError, match=r"tree.jsonl: line 4: its parentId 'zz' names no entry"):
        await import_agent_sessions([path], source="pi", storage_path=storage, session_id="bad")


async def test_reimport_is_idempotent_and_a_changed_file_is_refused(storage: Path, tmp_path: Path) -> None:
    """The same file twice (even in one call) is one session; the same agent session with other bytes is
    refused with SessionExistsError and changes nothing."""
    results = await import_agent_sessions([CODEX, CODEX], source="codex", storage_path=storage)
    assert [r["already_imported"] for r in results] == [False, True]
    before = (storage / results[0]["session_id"] / "events.jsonl").read_bytes()
    assert (await import_agent_sessions([CODEX], source="codex", storage_path=storage))[0]["already_imported"]
    grown = tmp_path / CODEX.name
    grown.write_bytes(CODEX.read_bytes() + CODEX.read_bytes().splitlines(keepends=True)[3])
    with pytest.raises(SessionExistsError, match="not imported from these bytes"):
        await import_agent_sessions([grown], source="codex", storage_path=storage)
    assert (storage / results[0]["session_id"] / "events.jsonl").read_bytes() == before
    assert sorted(p.name for p in storage.iterdir()) == [results[0]["session_id"]]


@pytest.mark.parametrize("damage,line,what", [
    (lambda lines: lines[:6] + [lines[6][:40]], 7, "is truncated"),
    (lambda lines: lines[:2] + [b"{nope\n"] + lines[3:], 3, "is not valid JSON"),
    (lambda lines: lines[:3] + [b'{"type": "response_item", "payload": 7}\n'] + lines[4:], 4,
     "a response_item line: 'payload' must be a dict, it is a int"),
])
async def test_a_damaged_line_names_file_and_line_and_nothing_is_imported(storage: Path, tmp_path: Path, damage: Any,
                                                                         line: int, what: str) -> None:
    """With a good file before it in the same call, a damaged one imports nothing at all."""
    bad = tmp_path / "bad-rollout.jsonl"
    bad.write_bytes(b"".join(damage(CODEX.read_bytes().splitlines(keepends=True))))
    with pytest.raises(MalformedInputError, match=f"bad-rollout.jsonl: line {line}: {what}"):
        await import_agent_sessions([CODEX, bad], source="codex", storage_path=storage)
    assert not storage.exists() or list(storage.iterdir()) == []


def _big_claude_code(path: Path, turns: int) -> int:
    """A Claude Code file of ``turns`` turns, each answer split over two lines (text, then tool_use) as Claude
    Code writes them; returns the number of lines."""
    lines = []
    for k in range(turns):
        base = {"sessionId": "big", "timestamp": "2026-01-01T00:00:00Z", "isSidechain": False}
        lines.append({**base, "type": "user", "uuid": f"u{k}", "message": {"role": "user", "content": f"q{k} " * 40}})
        for block in ({"type": "text", "text": f"a{k}"},
                      {"type": "tool_use", "id": f"t{k}", "name": "Read", "input": {"file_path": f"/f{k}"}}):
            lines.append({**base, "type": "assistant", "uuid": f"a{k}-{block['type']}",
                          "message": {"id": f"m{k}", "role": "assistant", "content": [block]}})
        lines.append({**base, "type": "user", "uuid": f"r{k}", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{k}", "content": [{"type": "text", "text": "x" * 200}]}]}})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return len(lines)


async def test_a_large_generated_session_imports_whole_and_paired(storage: Path, tmp_path: Path) -> None:
    """5,000 turns (20,000 lines): each answer's two lines become one message, every call has its result."""
    path = tmp_path / "big.jsonl"
    assert _big_claude_code(path, 5000) == 20_000
    [r] = await import_agent_sessions([path], source="claude-code", storage_path=storage)
    assert r["messages"] == 15_000 and r["unanswered"] == r["orphaned"] == 0
    msgs = await _messages(storage, "claude-code:big")
    assert msgs[1]["content"] == "a0" and msgs[1]["tool_calls"][0]["id"] == "t0"
    assert msgs[1]["imported"]["lines"] == [2, 3] and msgs[-1]["tool_call_id"] == "t4999"


def test_cli_import_from(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """`import --from AGENT PATH...` imports each file, says so, and says so again without writing twice."""
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "context_persistent", "--storage", str(tmp_path / "s"),
                               "import", *args], env=subprocess_env, capture_output=True, text=True, timeout=60)

    p = cli("--from", "pi", str(PI_V1), str(PI_V3))
    assert p.returncode == 0, p.stderr
    assert "imported 5 messages (pi session ffae836b" in p.stdout and "1 orphaned" in p.stdout
    p = cli("--from", "pi", str(PI_V3), "--json")
    assert json.loads(p.stdout)["already_imported"] is True
    p = cli("--from", "codex", str(CODEX), "--session-id", "mine", "--json")
    assert json.loads(p.stdout)["session_id"] == "mine"
    p = cli("--from", "codex", str(CODEX), str(CODEX), "--session-id", "x")
    assert p.returncode == 2 and "--session-id names one session" in p.stderr
    p = cli("--from", "opencode", str(OPENCODE))
    assert p.returncode == 0, p.stderr
    assert "into new session opencode:ses_A1b2C3d4E5f6" in p.stdout and "1 unanswered" in p.stdout
    p = cli("--from", "opencode", str(CODEX))
    assert p.returncode != 0 and "is not a SQLite database" in p.stderr


def _claude_line(uuid: str, parent: str | None, kind: str, content: Any, **extra: Any) -> dict[str, Any]:
    message = {"role": kind, "content": content, **({"id": f"m-{uuid}"} if kind == "assistant" else {})}
    return {"type": kind, "uuid": uuid, "parentUuid": parent, "sessionId": "tree", "isSidechain": False,
            "message": message, **extra}


async def test_claude_code_branches_import_the_active_one(storage: Path, tmp_path: Path) -> None:
    """An edited prompt leaves the first branch in the file: the chain ending at the last line is imported (through
    a compaction boundary's logicalParentUuid), the abandoned lines are counted as other_branch, and a tool
    result parented to a sibling tool_use line (parallel calls) is kept."""
    use = [{"type": "tool_use", "id": f"t{k}", "name": "Read", "input": {"p": k}} for k in (1, 2)]
    lines = [
        _claude_line("u1", None, "user", "first question"),
        _claude_line("a1", "u1", "assistant", [{"type": "text", "text": "first answer"}]),
        _claude_line("u2", "a1", "user", "abandoned prompt"),
        _claude_line("a2", "u2", "assistant", [{"type": "text", "text": "abandoned answer"}]),
        {"type": "system", "subtype": "compact_boundary", "uuid": "c1", "parentUuid": None,
         "logicalParentUuid": "a1", "sessionId": "tree"},
        _claude_line("u3", "c1", "user", "edited prompt"),
        _claude_line("a3", "u3", "assistant", [use[0]]),
        _claude_line("a4", "a3", "assistant", [use[1]]),
        _claude_line("r1", "a3", "user", [{"type": "tool_result", "tool_use_id": "t1", "content": "one"}]),
        _claude_line("r2", "a4", "user", [{"type": "tool_result", "tool_use_id": "t2", "content": "two"}]),
        _claude_line("a5", "r2", "assistant", [{"type": "text", "text": "final"}]),
    ]
    lines[7]["message"]["id"] = lines[6]["message"]["id"]  # (one response written over two lines)
    path = tmp_path / "tree.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    [r] = await import_agent_sessions([path], source="claude-code", storage_path=storage)
    msgs = await _messages(storage, r["session_id"])
    assert [m.get("content") for m in msgs] == ["first question", "first answer", "edited prompt", None, "one",
                                                "two", "final"]
    assert _calls_then_results(msgs) == ["t1", "t2"] and r["unanswered"] == r["orphaned"] == 0
    assert r["ignored"] == {"other_branch": 2, "system": 1}
    # The same file in file order (its lines unlinked) keeps the abandoned branch: the links are what choose.
    for line in lines:
        line["parentUuid"] = None
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    [r] = await import_agent_sessions([path], source="claude-code", storage_path=storage, session_id="flat")
    assert "abandoned prompt" in [m.get("content") for m in await _messages(storage, "flat")]


def _opencode_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_opencode_fixture", FIX / "opencode" / "make_fixture.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_opencode_fixture(storage: Path) -> None:
    """opencode: every session of the database; a user message's text and file parts; an assistant message's
    reasoning, text and tool parts split so that each result follows its call and precedes what came next;
    error results flagged, an interrupted call unanswered, bookkeeping parts, an aborted empty turn and the
    reverted turn counted; provenance names the file, table and row ids and opencode's session."""
    results = await import_agent_sessions([OPENCODE], source="opencode", storage_path=storage)
    main, sub = results
    assert main["session_id"] == "opencode:ses_A1b2C3d4E5f6" and sub["session_id"] == "opencode:ses_Z9y8X7w6V5u4"
    assert main["ignored"] == {"ignored_text": 1, "step-start": 4, "step-finish": 2, "patch": 1,
                               "empty_message": 1, "reverted": 2}
    assert main["unanswered"] == 1 and main["orphaned"] == 0
    msgs = await _messages(storage, main["session_id"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "tool", "user",
                                         "assistant", "tool", "assistant", "user"]
    assert msgs[0]["content"][1] == {"type": "file", "mime": "text/plain", "filename": "test_cart.py",
                                     "url": "file:///home/me/shop/tests/test_cart.py"}
    assert msgs[1]["reasoning_content"] == "Read the test first." and msgs[1]["content"] == "Let me look at the test."
    assert json.loads(msgs[1]["tool_calls"][0]["function"]["arguments"]) == {
        "filePath": "/home/me/shop/tests/test_cart.py"}
    assert msgs[3]["is_error"] is True and msgs[3]["content"] == "pytest: command not found"
    assert _calls_then_results(msgs) == ["toolu_01", "toolu_02", "toolu_03", "toolu_04"]
    assert msgs[9]["tool_calls"][0]["id"] == "toolu_05" and msgs[9]["content"] == "The sub-agent found nothing else."
    assert msgs[1]["opencode"]["tokens"]["input"] == 1200 and "opencode" not in msgs[4]
    assert msgs[2]["imported"] == {"table": "part", "id": "prt_0002_p003", "status": "completed",
                                   "title": "tests/test_cart.py"}
    started = _started(storage, main["session_id"])
    assert started["imported"]["agent_session_id"] == "ses_A1b2C3d4E5f6"
    assert started["imported"]["agent"]["title"] == "Fix the failing test"
    assert _started(storage, sub["session_id"])["imported"]["agent"]["parent_session_id"] == "ses_A1b2C3d4E5f6"
    # Re-import: both already there, nothing written.
    again = await import_agent_sessions([OPENCODE], source="opencode", storage_path=storage)
    assert [r["already_imported"] for r in again] == [True, True]


async def test_opencode_reimport_after_another_session_grew(storage: Path, tmp_path: Path) -> None:
    """A session's digest is that of its own rows: after opencode adds a message to one session, the others
    are still "already imported"; the grown one is refused (SessionExistsError), nothing written."""
    import shutil
    import sqlite3

    db_path = tmp_path / "opencode.db"
    shutil.copy(OPENCODE, db_path)
    await import_agent_sessions([db_path], source="opencode", storage_path=storage)
    mod = _opencode_module()
    db = sqlite3.connect(db_path)
    mod.insert(db, "ses_Z9y8X7w6V5u4", "msg_1003", mod.T0 + 9000, mod.user(mod.T0 + 9000),
               [{"type": "text", "text": "more"}])
    db.commit()
    db.close()
    with pytest.raises(SessionExistsError, match="opencode:ses_Z9y8X7w6V5u4"):
        await import_agent_sessions([db_path], source="opencode", storage_path=storage)
    with pytest.raises(ValueError, match="holds 2: import it without --session-id"):
        await import_agent_sessions([db_path], source="opencode", storage_path=storage, session_id="x")


@pytest.mark.parametrize("table,sql,what", [
    ("part", "UPDATE part SET data = '{\"type\": \"tool\", \"callID\": 7' WHERE id = 'prt_0002_p003'",
     "table part, row prt_0002_p003: its data is not valid JSON"),
    ("part", "UPDATE part SET data = '{\"type\": \"tool\", \"callID\": \"c\", \"tool\": \"x\", "
             "\"state\": {\"status\": \"done\"}}' WHERE id = 'prt_1002_p000'",
     "table part, row prt_1002_p000: a tool part's state has status 'done'"),
    ("message", "UPDATE message SET data = '[1]' WHERE id = 'msg_0003'",
     "table message, row msg_0003: its data is a JSON list, not an object"),
    ("message", "UPDATE message SET data = '{\"role\": \"system\"}' WHERE id = 'msg_1001'",
     "table message, row msg_1001: a message with role 'system'"),
])
async def test_opencode_damaged_row_names_file_table_row_and_imports_nothing(
        storage: Path, tmp_path: Path, table: str, sql: str, what: str) -> None:
    """A damaged row in any session of the database imports no session at all."""
    import shutil
    import sqlite3

    db_path = tmp_path / "damaged.db"
    shutil.copy(OPENCODE, db_path)
    db = sqlite3.connect(db_path)
    db.execute(sql)
    db.commit()
    db.close()
    with pytest.raises(MalformedInputError, match=f"damaged.db: {what}"):
        await import_agent_sessions([db_path], source="opencode", storage_path=storage)
    assert not storage.exists() or list(storage.iterdir()) == []


async def test_opencode_large_generated_database(storage: Path, tmp_path: Path) -> None:
    """A generated database with opencode's schema, 2,000 turns (a user message, an assistant message with a
    step, text and a completed tool part): 6,000 messages, every call paired, in opencode's order."""
    mod = _opencode_module()
    db = mod.create(tmp_path / "big.db")
    mod.session(db, "ses_big", "big")
    for k in range(2000):
        at = mod.T0 + 10 * k
        mod.insert(db, "ses_big", f"msg_{k:05d}u", at, mod.user(at), [{"type": "text", "text": f"q{k} " * 30}])
        mod.insert(db, "ses_big", f"msg_{k:05d}v", at + 1, mod.assistant(at + 1, f"msg_{k:05d}u"), [
            {"type": "step-start"}, {"type": "text", "text": f"a{k}"},
            mod.tool(f"c{k}", "read", "completed", {"k": k}, at, output="x" * 200, title="t", metadata={}),
            {"type": "step-finish", "reason": "stop", "cost": 0, "tokens": mod.TOKENS}])
    db.commit()
    db.close()
    [r] = await import_agent_sessions([tmp_path / "big.db"], source="opencode", storage_path=storage)
    assert r["messages"] == 6000 and r["unanswered"] == r["orphaned"] == 0
    msgs = await _messages(storage, "opencode:ses_big")
    assert msgs[1]["content"] == "a0" and msgs[2]["tool_call_id"] == "c0" and msgs[-1]["tool_call_id"] == "c1999"
