"""Importing other agents' sessions (store/importers, `import --from`): Claude Code, Codex and pi files from
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
    p = cli("--from", "opencode", str(CODEX))
    assert p.returncode == 2 and "invalid choice: 'opencode'" in p.stderr
