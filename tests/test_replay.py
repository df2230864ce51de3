"""Amplifier's sub-session resume replays the transcript with add_message: recognised, never duplicated,
and nothing a caller really added is lost."""

from __future__ import annotations

from pathlib import Path

from context_persistent import PersistentContextManager
from context_persistent.codec import decode

HISTORY = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
]
TRANSCRIPT = HISTORY[1:]  # what the host saved: no system message


async def _seed(storage: Path) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        for m in HISTORY:
            await s.add_message(m)


def _kinds(storage: Path) -> list[str]:
    return [decode(x)["type"] for x in (storage / "r" / "events.jsonl").read_bytes().splitlines()]


async def test_full_replay_is_recognised(storage: Path) -> None:
    """Replaying the whole transcript stores nothing twice and leaves one replay_recognised audit event."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        for m in TRANSCRIPT:
            await s.add_message(m)
        await s.add_message({"role": "assistant", "content": "a2"})
        assert await s.get_messages() == [*HISTORY, {"role": "assistant", "content": "a2"}]
    assert _kinds(storage)[-2:] == ["replay_recognised", "message_added"]


async def test_matching_prefix_then_new_message_keeps_everything(storage: Path) -> None:
    """A new message that happens to equal the first loaded one is kept once the next one differs."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        await s.add_message({"role": "user", "content": "q1"})  # equals transcript[0]: held
        await s.add_message({"role": "assistant", "content": "different"})
        assert await s.get_messages() == [*HISTORY, {"role": "user", "content": "q1"},
                                          {"role": "assistant", "content": "different"}]
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert len(await s.get_messages()) == 6


async def test_partial_replay_is_written_on_close(storage: Path) -> None:
    """Held messages are written if the store closes before the replay completes (never lost)."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        await s.add_message({"role": "user", "content": "q1"})
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        assert await s.get_messages() == [*HISTORY, {"role": "user", "content": "q1"}]


async def test_other_writes_end_recognition(storage: Path) -> None:
    """clear() after a held message writes the held one first; the log tells the true order."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        await s.add_message({"role": "user", "content": "q1"})
        await s.clear()
        assert await s.get_messages() == []
    assert _kinds(storage)[-2:] == ["message_added", "cleared"]


async def test_can_be_switched_off(storage: Path) -> None:
    """recognise_replay=False stores every add_message as given."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r",
                                                   recognise_replay=False) as s:
        for m in TRANSCRIPT:
            await s.add_message(m)
        assert len(await s.get_messages()) == len(HISTORY) + len(TRANSCRIPT)


async def test_pin_unpin_redact_end_recognition_and_count_held_messages(storage: Path) -> None:
    """A pin, unpin or redaction during a replay writes the held messages first (they were real), so an index
    counts them as get_messages() then shows them; a redaction while nothing is held ends recognition too."""
    await _seed(storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        await s.add_message(TRANSCRIPT[0])  # held: it matches the loaded history so far
        await s.pin(4)  # index 4 is the held message, written first
        history = await s.get_messages()
        assert history == [*HISTORY, TRANSCRIPT[0]] and s._state.keys[4] in s._state.pinned
    async with await PersistentContextManager.open(storage_path=storage, session_id="r") as s:
        await s.redact(1)  # nothing held: recognition ends with this write
        await s.add_message(TRANSCRIPT[1])  # would have matched the old history; now simply stored
        assert (await s.get_messages())[-1] == TRANSCRIPT[1]
