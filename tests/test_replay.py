"""Amplifier's sub-session resume replays the transcript with add_message: every add_message is written before
it returns, a confirmed replay is folded out of the views by a later event, and nothing is held back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode
from context_persistent.model.replay import normalise

from chained import last_crc

HISTORY = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
]
TRANSCRIPT = HISTORY[1:]  # what the host saved: no system message
NEW = {"role": "user", "content": "new instruction"}
ON = {"recognise_replay": True}  # what the Amplifier mount sets


async def _seed(storage: Path, history: list[dict[str, Any]] = HISTORY) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        for m in history:
            await s.add_message(m)


def _records(storage: Path) -> list[dict[str, Any]]:
    return [decode(x) for x in (storage / "r" / "events.jsonl").read_bytes().rstrip(b"\0").splitlines()]


def _kinds(storage: Path) -> list[str]:
    return [r["type"] for r in _records(storage)]


async def test_confirmed_replay_is_folded_out_of_the_views(storage: Path) -> None:
    """The replayed messages are written as they come; the next add_message confirms the replay and one
    replay_recognised event folds them out of the views (the log keeps them), also after a restart."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        for m in TRANSCRIPT:
            await s.add_message(m)
        assert _kinds(storage)[-3:] == ["message_added"] * 3  # written before each call returned
        await s.add_message(NEW)
        assert await s.get_messages() == [*HISTORY, NEW]
    kinds = _kinds(storage)
    assert kinds[-5:] == ["message_added"] * 3 + ["replay_recognised", "message_added"]
    fold = _records(storage)[-2]["data"]
    assert fold["count"] == 3 and len(fold["keys"]) == 3
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert await s.get_messages() == [*HISTORY, NEW]


async def test_replay_in_the_cli_normal_form_is_recognised(storage: Path) -> None:
    """The CLI saves transcripts without None fields (e.g. ``"visibility": null`` inside content blocks) and
    without content_blocks: such a replay is still recognised."""
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "a1", "visibility": None}],
                 "tool_calls": None, "content_blocks": [{"type": "text", "text": "a1"}]}
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1", "name": None}, assistant]
    await _seed(storage, history)
    transcript = [normalise(m) for m in history[1:]]
    assert transcript[1] == {"role": "assistant", "content": [{"type": "text", "text": "a1"}]}
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        for m in transcript:
            await s.add_message(m)
        await s.add_message(NEW)
        assert await s.get_messages() == [*history, NEW]
    assert "replay_recognised" in _kinds(storage)


async def test_matching_prefix_then_new_message_keeps_everything(storage: Path) -> None:
    """A new message that happens to equal the first loaded one is kept: the next one differs."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        await s.add_message({"role": "user", "content": "q1"})
        await s.add_message({"role": "assistant", "content": "different"})
        assert await s.get_messages() == [*HISTORY, {"role": "user", "content": "q1"},
                                          {"role": "assistant", "content": "different"}]
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert len(await s.get_messages()) == 6
    assert "replay_recognised" not in _kinds(storage)


async def test_same_words_typed_again_after_a_resume_are_a_turn(storage: Path) -> None:
    """History with one non-system message; the user types the same words again: the request for the model that
    follows ends the recognition, so the turn is kept (it used to be dropped as a 'replay')."""
    await _seed(storage, HISTORY[:2])
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        await s.add_message({"role": "user", "content": "q1"})
        view = await s.get_messages_for_request()
        assert [m["content"] for m in view if m["role"] == "user"] == ["q1", "q1"]
        await s.add_message({"role": "assistant", "content": "a"})
        assert await s.get_messages() == [*HISTORY[:2], {"role": "user", "content": "q1"},
                                          {"role": "assistant", "content": "a"}]
    assert "replay_recognised" not in _kinds(storage)


async def test_unconfirmed_replay_stays_written(storage: Path) -> None:
    """A replay that is never confirmed (close, or a request, right after it) stays as written: duplicates are
    preferred to loss."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        for m in TRANSCRIPT:
            await s.add_message(m)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert await s.get_messages() == [*HISTORY, *TRANSCRIPT]


CHILD = """
import asyncio, os, sys
from context_persistent import PersistentContextManager
async def main():
    s = await PersistentContextManager.open(storage_path=sys.argv[1], session_id="r", recognise_replay=True)
    await s.add_message({"role": "user", "content": "q1"})
    os.write(1, b"ACK\\n")
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_acknowledged_message_survives_a_kill(storage: Path, subprocess_env: dict[str, str]) -> None:
    """An add_message that equals the first loaded message returned: SIGKILL the process, and it is in the log."""
    await _seed(storage)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(storage)], env=subprocess_env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == b"ACK\n", child.stderr.read() if child.stderr else b""
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert await s.get_messages() == [*HISTORY, {"role": "user", "content": "q1"}]


async def test_off_for_plain_library_use(storage: Path) -> None:
    """open() without recognise_replay stores every add_message as given (only the Amplifier mount turns it on)."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        for m in TRANSCRIPT:
            await s.add_message(m)
        await s.add_message(NEW)
        assert await s.get_messages() == [*HISTORY, *TRANSCRIPT, NEW]


async def test_pin_unpin_redact_end_recognition(storage: Path) -> None:
    """A pin, unpin or redaction during a replay ends the recognition; indices count the messages written."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        await s.add_message(TRANSCRIPT[0])
        await s.pin(4)  # index 4 is the message just written
        history = await s.get_messages()
        assert history == [*HISTORY, TRANSCRIPT[0]] and s._state.keys[4] in s._state.pinned
        for m in TRANSCRIPT[1:]:
            await s.add_message(m)
        await s.add_message(NEW)
        assert len(await s.get_messages()) == len(HISTORY) + len(TRANSCRIPT) + 1
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", **ON) as s:
        await s.redact(1)  # recognition ends with this write
        await s.add_message(TRANSCRIPT[1])
        assert (await s.get_messages())[-1] == TRANSCRIPT[1]
    assert "replay_recognised" not in _kinds(storage)


async def test_a_fold_that_names_other_messages_is_corruption(storage: Path) -> None:
    """replay_recognised must name the newest messages; anything else is reported, never folded silently."""
    from context_persistent.model import codec
    from context_persistent.errors import LogCorruptedError

    await _seed(storage)
    path = storage / "r" / "events.jsonl"
    head = len(path.read_bytes().splitlines())
    fold = codec.encode(head + 1, "replay_recognised", codec.dumps({"count": 1, "keys": [1 << 20]}),
                        codec.now_iso(), last_crc(path))
    path.write_bytes(path.read_bytes() + fold + codec.encode(head + 2, "message_added", codec.dumps({"message": NEW}),
                                                             codec.now_iso(), codec.crc_of(fold)))
    with pytest.raises(LogCorruptedError, match="newest messages"):
        await PersistentContextManager.open(storage_path=storage, session_id="r")


async def test_an_earlier_versions_replay_recognised_is_an_audit_record(storage: Path) -> None:
    """Written without keys (by a version that held the replayed messages back), it changes no view."""
    from context_persistent.model import codec
    await _seed(storage)
    path = storage / "r" / "events.jsonl"
    head = len(path.read_bytes().splitlines())
    path.write_bytes(path.read_bytes() + codec.encode(head + 1, "replay_recognised",
                                                      codec.dumps({"count": 3, "digest": "sha256:00"}), codec.now_iso(),
                                                      last_crc(path)))
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert await s.get_messages() == HISTORY and s.head_seq == head + 1
