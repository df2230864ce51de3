"""Migration: importing an Amplifier CLI transcript.jsonl and the reference module's context-messages.jsonl
(fixtures/), source detection, provenance, malformed input, and never overwriting or half-writing a session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from context_persistent.operations.search.sqlite_index import INDEX_DIR

from context_persistent import (
    MalformedInputError,
    PersistentContextManager,
    SessionExistsError,
    import_,
)
from context_persistent.storage.log import scan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TRANSCRIPT = FIXTURES / "amplifier-cli" / "transcript.jsonl"
REFERENCE = FIXTURES / "reference" / "context-messages.jsonl"
MALFORMED = FIXTURES / "malformed"


def _expected(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The fixture's messages without their top-level timestamp, and the timestamps (read with stdlib json)."""
    messages, stamps = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = json.loads(line)
        stamps.append(m.pop("timestamp"))
        messages.append(m)
    return messages, stamps


async def _messages(storage: Path, sid: str) -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, readonly=True) as s:
        return await s.get_messages()


@pytest.mark.parametrize("path,kind", [(TRANSCRIPT, "transcript"), (REFERENCE, "reference")])
async def test_fixture_imports_every_message_with_timestamps_kept_as_provenance(storage: Path, path: Path,
                                                                                 kind: str) -> None:
    """Each line becomes one message_added (timestamp moved to source_timestamp); session_started says where from."""
    result = await import_(path, session_id="m", storage_path=storage)
    messages, stamps = _expected(path)
    assert result["source"] == kind and result["messages"] == len(messages)
    assert await _messages(storage, "m") == messages
    records = [rec for rec, _ in scan(storage / "m" / "events.jsonl")]
    assert [r["type"] for r in records] == ["session_started"] + ["message_added"] * len(messages)
    assert [r["data"]["source_timestamp"] for r in records[1:]] == stamps
    imported = records[0]["data"]["imported"]
    assert imported["source"] == kind and imported["path"] == str(path.resolve())
    assert imported["digest"].startswith("sha256:") and imported["messages"] == len(messages)


async def test_reference_fixture_keeps_system_messages_metadata_tool_calls_and_none_content(storage: Path) -> None:
    """The reference file's system/hook messages, metadata, OpenAI tool_calls, Anthropic blocks and None survive."""
    await import_(REFERENCE, session_id="r", storage_path=storage)
    msgs = await _messages(storage, "r")
    assert [m["role"] for m in msgs[:2]] == ["system", "system"]
    assert msgs[1]["metadata"]["source"] == "hook"
    assert any(m.get("content") is None and m.get("tool_calls") for m in msgs)
    blocks = [b["type"] for m in msgs if isinstance(m.get("content"), list) for b in m["content"]]
    assert {"tool_use", "tool_result", "thinking", "text"} <= set(blocks)
    assert any("谢谢" in str(m.get("content")) for m in msgs)


@pytest.mark.parametrize("name,src,kind", [
    ("export.jsonl", TRANSCRIPT, "transcript"),       # no system message → a CLI transcript
    ("export.jsonl", REFERENCE, "reference"),         # system messages → the reference module
    ("transcript.jsonl", REFERENCE, "transcript"),    # the writer's file name decides first
    ("context-messages.jsonl", TRANSCRIPT, "reference"),
])
async def test_auto_detection_rules(storage: Path, tmp_path: Path, name: str, src: Path, kind: str) -> None:
    """auto: the file name when it is the writer's, else a system/developer message means the reference module."""
    target = tmp_path / name
    shutil.copy(src, target)
    assert (await import_(target, session_id="d", storage_path=storage))["source"] == kind


@pytest.mark.parametrize("path,line,what", [
    (MALFORMED / "transcript-bad-json.jsonl", 5, "is not valid JSON"),
    (MALFORMED / "context-messages-truncated.jsonl", 15, "is truncated"),
    (MALFORMED / "transcript-no-role.jsonl", 3, "the message has no 'role'"),
])
async def test_malformed_input_names_file_and_line_and_leaves_no_session(storage: Path, path: Path, line: int,
                                                                         what: str) -> None:
    """A bad line is a MalformedInputError (a ValueError) naming file and line; nothing lands in storage."""
    with pytest.raises(MalformedInputError, match=f"{path.name}: line {line}: {what}") as info:
        await import_(path, session_id="bad", storage_path=storage)
    assert isinstance(info.value, ValueError) and info.value.line == line
    assert not storage.exists() or list(storage.iterdir()) == []


async def test_import_refuses_an_existing_session_and_leaves_it_untouched(storage: Path) -> None:
    """Importing onto an existing session id raises SessionExistsError; its log keeps its bytes."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="taken") as store:
        await store.add_message({"role": "user", "content": "mine"})
    before = (storage / "taken" / "events.jsonl").read_bytes()
    with pytest.raises(SessionExistsError, match="already exists"):
        await import_(TRANSCRIPT, session_id="taken", storage_path=storage)
    assert (storage / "taken" / "events.jsonl").read_bytes() == before
    assert sorted(p.name for p in storage.iterdir() if p.name != INDEX_DIR) == ["taken"]  # (and the search index)


async def test_import_fills_an_empty_leftover_folder_but_not_one_in_use(storage: Path) -> None:
    """An empty session folder (no log) is taken over; a folder holding other files is refused."""
    (storage / "empty").mkdir(parents=True)
    await import_(TRANSCRIPT, session_id="empty", storage_path=storage)
    assert len(await _messages(storage, "empty")) == 13
    (storage / "busy").mkdir()
    (storage / "busy" / "lock").write_text("123")
    with pytest.raises(SessionExistsError):
        await import_(TRANSCRIPT, session_id="busy", storage_path=storage)
    assert sorted(p.name for p in (storage / "busy").iterdir()) == ["lock"]


async def test_imported_session_is_authoritative_on_resume(storage: Path) -> None:
    """After import the session counts as loaded: a later set_messages (CLI resume) is ignored, adds append."""
    await import_(REFERENCE, session_id="res", storage_path=storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="res") as store:
        assert store.loaded_from_file
        await store.set_messages([{"role": "user", "content": "stale"}])
        await store.add_message({"role": "user", "content": "next"})
        msgs = await store.get_messages()
    assert len(msgs) == 16 and msgs[-1]["content"] == "next"


async def test_system_message_option_prepends_one(storage: Path) -> None:
    """system_message puts a system message first (a CLI transcript has none)."""
    await import_(TRANSCRIPT, session_id="sys", storage_path=storage, system_message="You are helpful.")
    msgs = await _messages(storage, "sys")
    assert msgs[0] == {"role": "system", "content": "You are helpful."} and len(msgs) == 14


async def test_empty_or_wrong_kind_inputs_are_refused_clearly(storage: Path, tmp_path: Path) -> None:
    """An empty file cannot be auto-detected; a snapshot read as a transcript says to use source='snapshot'."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n")
    with pytest.raises(MalformedInputError, match="empty"):
        await import_(empty, session_id="e", storage_path=storage)
    assert (await import_(empty, session_id="e", storage_path=storage, source="reference"))["messages"] == 0
    await import_(TRANSCRIPT, session_id="t", storage_path=storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="t", readonly=True) as s:
        await s.export(tmp_path / "snap.jsonl")
    with pytest.raises(MalformedInputError, match="line 1: is a context-persistent snapshot header"):
        await import_(tmp_path / "snap.jsonl", session_id="x", storage_path=storage, source="transcript")
    with pytest.raises(ValueError, match="source must be one of auto, snapshot, transcript, reference"):
        await import_(TRANSCRIPT, session_id="x", storage_path=storage, source="csv")
    with pytest.raises(ValueError, match="must not contain"):
        await import_(TRANSCRIPT, session_id="a/../x", storage_path=storage)
