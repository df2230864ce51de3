"""An edited host transcript (docs/resume.md, "An edited transcript"): ignored like any unrecognised one, and
warned about once per session, naming ``context-persistent erase``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode
from context_persistent.model.replay import normalise
from context_persistent.model.resume import transcript_edits

SYSTEM = {"role": "system", "content": "S"}


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": None}


HISTORY = [SYSTEM, u("q1"), a("r1"), u("my password is hunter2"), a("r2"), u("q3"), a("r3")]


def _transcript(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [normalise(m) for m in messages if m["role"] != "system"]


@pytest.mark.parametrize(("offered", "expected"), [
    # a turn removed from the middle: its two messages
    (_transcript(HISTORY[:3] + HISTORY[5:]), {"removed": [3, 4], "changed": []}),
    # a message's text changed in place, the rest as saved
    (_transcript(HISTORY[:3] + [u("my password is ***")] + HISTORY[4:]), {"removed": [], "changed": [3]}),
    # the last message changed while the log is a turn ahead of the transcript
    (_transcript(HISTORY[:4]) + [normalise(a("r2 edited"))], {"removed": [], "changed": [4]}),
])
def test_removed_or_changed_messages_are_an_edit(offered: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Messages of the history left out between shared messages, or replaced in place by a message of the same
    role, are an edit, named by their positions in the history."""
    assert transcript_edits(HISTORY, offered) == expected


@pytest.mark.parametrize("offered", [
    _transcript(HISTORY) + [u("a message the log no longer has")],  # a copy taken before a redaction or erasure
    [u("before a clear"), a("old reply")],  # shares nothing with the history
    _transcript(HISTORY[:3]) + [u("redacted since"), *_transcript(HISTORY[3:])],
    [],
])
def test_extra_or_unrelated_messages_are_no_edit(offered: list[dict[str, Any]]) -> None:
    """A transcript with messages the log lacks (a stale copy) or sharing nothing with it is not an edit."""
    assert transcript_edits(HISTORY, offered) is None


def _records(storage: Path) -> list[dict[str, Any]]:
    return [decode(x) for x in (storage / "s" / "events.jsonl").read_bytes().rstrip(b"\0").splitlines()]


async def test_an_edited_transcript_is_ignored_and_warned_about_once_per_session(
        storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first edited transcript writes one transcript_edited record and one warning naming erase and the
    seqs; the history is unchanged; later ones, after a reopen too, are transcript_ignored without a warning."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        for m in HISTORY:
            await s.add_message(m)
    edited = _transcript(HISTORY[:3] + HISTORY[5:])
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="context_persistent"):
            async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
                await s.set_messages(edited)
                assert await s.get_messages() == HISTORY
                await s.set_messages(edited)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if _ == 0:
            assert len(warnings) == 1, warnings
            assert "context-persistent erase s --seq 5" in warnings[0] and "seq 5, 6" in warnings[0]
        else:
            assert warnings == []
    records = _records(storage)
    edits = [r["data"] for r in records if r["type"] == "transcript_edited"]
    assert len(edits) == 1 and edits[0]["removed_seqs"] == [5, 6] and edits[0]["changed_seqs"] == []
    ignored = [r["data"]["kind"] for r in records if r["type"] == "transcript_ignored"]
    assert ignored == ["edited_transcript"] * 3


async def test_a_filtered_transcript_still_says_nothing(storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The CLI's own transcript, current or a turn behind, is no edit: no warning, no transcript_edited."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        for m in HISTORY:
            await s.add_message(m)
    with caplog.at_level(logging.WARNING, logger="context_persistent"):
        async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
            await s.set_messages(_transcript(HISTORY[:5]))
            await s.set_messages(_transcript(HISTORY))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in _records(storage) if r["type"] == "transcript_edited"]
