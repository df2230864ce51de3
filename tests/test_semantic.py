"""Semantic integrity: verify checks tool-call pairing and order (OpenAI, Anthropic, Amplifier's own form) and
reports orphaned calls and results with their seq; repair --semantic records fixes as events, never editing a
record; the fixtures pass the checks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, import_
from context_persistent.model.grouping import placeholder_text
from context_persistent.storage.log import scan
from context_persistent.storage.paths import LOG_NAME
from context_persistent.operations.repair import verify
from context_persistent.operations.semantic import check
from context_persistent.store.semantic_repair import repair_semantic
from conftest import PYTHON

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

U = {"role": "user", "content": "go"}
A = {"role": "assistant", "content": "done"}


def openai_call(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "grep", "arguments": "{}"}} for i in ids]}


def amplifier_call(*ids: str) -> dict[str, Any]:
    """As loop-basic stores it: tool_call blocks and the same calls in tool_calls."""
    return {"role": "assistant", "content": [{"type": "tool_call", "id": i, "name": "echo", "input": {}} for i in ids],
            "tool_calls": [{"id": i, "tool": "echo", "arguments": {}} for i in ids]}


def anthropic_call(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": "looking"}] + [
        {"type": "tool_use", "id": i, "name": "read", "input": {}} for i in ids]}


def tool(i: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": i, "content": "out"}


def blocks(*ids: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "r"} for i in ids]}


def kinds(messages: list[dict[str, Any]], **kw: Any) -> list[tuple[str, int, str, bool]]:
    return [(f.kind, f.index, f.call_id, f.problem) for f in check(messages, **kw)]


@pytest.mark.parametrize("fixture", [FIXTURES / "amplifier-cli" / "transcript.jsonl",
                                     FIXTURES / "reference" / "context-messages.jsonl"])
async def test_the_fixtures_pass_the_semantic_checks(storage: Path, fixture: Path) -> None:
    await import_(fixture, session_id="f", storage_path=storage)
    report = verify(storage / "f", "f")
    assert report.ok and report.semantic == []


def test_valid_histories_in_every_form_have_no_findings() -> None:
    for history in ([U, openai_call("a", "b"), tool("b"), tool("a"), A],
                    [U, amplifier_call("c"), tool("c"), A],
                    [U, anthropic_call("d", "e"), blocks("d", "e"), A],
                    [U, {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}},
                     {"role": "function", "name": "f", "content": "x"}, A]):
        assert check(history) == []


@pytest.mark.parametrize("call,answer", [(openai_call, tool), (amplifier_call, tool), (anthropic_call, blocks)])
def test_unanswered_orphaned_and_late_results_are_found_where_they_are(call: Any, answer: Any) -> None:
    history = [U, call("x"), U, answer("x"), answer("ghost"), call("y"), A]
    assert kinds(history) == [("late_result", 3, "x", False), ("orphan_result", 4, "ghost", True),
                              ("unanswered_call", 5, "y", True)]


def test_a_second_result_for_the_same_call_is_an_orphan_naming_the_first() -> None:
    [f] = check([U, openai_call("a"), tool("a"), tool("a")])
    assert (f.kind, f.index) == ("orphan_result", 3) and "answered already (at seq 2)" in f.detail


def test_a_call_still_running_is_a_note_while_a_writer_is_active() -> None:
    [f] = check([U, openai_call("a")], writer_active=True)
    assert f.kind == "unanswered_call" and not f.problem and "still be running" in f.detail
    [f] = check([U, openai_call("a"), U], writer_active=True)
    assert f.problem  # a message came after it: not running any more


async def _session(storage: Path, messages: list[dict[str, Any]]) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        for m in messages:
            await s.add_message(m)


async def test_verify_reports_orphans_with_their_seq_and_fails(storage: Path) -> None:
    await _session(storage, [U, openai_call("a"), U, tool("ghost"), amplifier_call("b")])
    report = verify(storage / "s", "s")
    assert not report.ok and report.problems == []
    found = [(f.kind, f.seq, f.call_id) for f in report.semantic if f.problem]
    # seq 1 is session_started: message i is seq i + 2
    assert found == [("unanswered_call", 3, "a"), ("orphan_result", 5, "ghost"), ("unanswered_call", 6, "b")]


async def test_repair_semantic_records_fixes_as_events_and_never_edits_a_record(storage: Path) -> None:
    history = [U, openai_call("a"), U, tool("ghost"), A, amplifier_call("b", "c"), tool("b")]
    await _session(storage, history)
    log = storage / "s" / LOG_NAME
    before = log.read_bytes()
    result = await repair_semantic(storage, "s")
    after = log.read_bytes()
    assert after.startswith(before)  # appended events only
    new = [rec for rec, _ in scan(log)][len(before.splitlines()):]
    assert [r["type"] for r in new] == ["redacted", "message_added", "message_added", "semantic_repaired"]
    assert new[0]["data"]["seq"] == 5  # the orphan "ghost" result, hidden by a tombstone
    placeholders = [r["data"]["message"] for r in new[1:3]]
    assert [(m["role"], m["tool_call_id"]) for m in placeholders] == [("tool", "a"), ("tool", "c")]
    assert placeholders[0]["content"] == placeholder_text("grep", "a")
    assert placeholders[0]["metadata"]["context_persistent"]["placeholder"] is True
    audit = new[3]["data"]
    assert [u["call_id"] for u in audit["unanswered"]] == ["a", "c"] and audit["redacted"][0]["call_ids"] == ["ghost"]
    assert result.changed and result.audit_seq == new[3]["seq"]
    report = verify(storage / "s", "s")
    assert report.ok and all(not f.problem for f in report.semantic)  # (placeholder "a" comes late: a note)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        msgs = await s.get_messages()
    assert tool("ghost") not in msgs and len(msgs) == len(history) - 1 + 2
    again = await repair_semantic(storage, "s")
    assert not again.changed and again.audit_seq is None and log.read_bytes() == after


async def test_orphans_next_to_text_are_left_and_listed(storage: Path) -> None:
    mixed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "ghost", "content": "r"},
                                         {"type": "text", "text": "and also this"}]}
    await _session(storage, [U, mixed])
    result = await repair_semantic(storage, "s")
    assert not result.changed and [f.call_id for f in result.left] == ["ghost"]
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        assert (await s.get_messages())[1] == mixed


async def test_the_cli_prints_semantic_findings_and_repairs_with_the_flag(storage: Path,
                                                                         subprocess_env: dict[str, str]) -> None:
    await _session(storage, [U, openai_call("a")])

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "context_persistent", *args, "--storage", str(storage)],
                              capture_output=True, text=True, env=subprocess_env, timeout=60)

    p = cli("verify", "s")
    assert p.returncode == 1 and "PROBLEM unanswered tool call 'a' (tool grep) at seq 3" in p.stdout
    p = cli("repair", "s")
    assert p.returncode == 0 and "placeholder result for" not in p.stdout  # bytes only, without the flag
    assert "`context-persistent repair --semantic s` records the fixes" in p.stdout  # (and it says what would)
    p = cli("repair", "--semantic", "s")
    assert p.returncode == 0 and "placeholder result for a added as seq 4" in p.stdout, p.stdout + p.stderr
    p = cli("verify", "s", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["semantic"] == []
