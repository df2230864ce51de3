"""The resume rule (docs/resume.md): once the store loaded its own log, a filtered transcript never replaces the
complete history; the host's repair, an explicit replacement and a set_messages after clear() are accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode
from context_persistent.model.replay import normalise

SYSTEM = {"role": "system", "content": "S"}
DEV = {"role": "developer", "content": "context files"}
CALL = {"role": "assistant", "content": [{"type": "text", "text": "let me look", "visibility": None}],
        "tool_calls": [{"id": "call_1", "tool": "echo", "arguments": {"text": "hi"}}]}
HISTORY = [SYSTEM, DEV, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
           {"role": "user", "content": "q2"}, CALL]
SYNTHETIC_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "echo",
                    "content": '{"error": "unknown_error", "message": "Tool execution was interrupted"}'}
SYNTHETIC_REPLY = {"role": "assistant", "content": [{"type": "text", "text": "The previous tool calls were interrupted."}]}


async def _seed(storage: Path, history: list[dict[str, Any]] = HISTORY) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as s:
        for m in history:
            await s.add_message(m)


def _records(storage: Path) -> list[dict[str, Any]]:
    return [decode(x) for x in (storage / "s" / "events.jsonl").read_bytes().rstrip(b"\0").splitlines()]


def _of(storage: Path, kind: str) -> list[dict[str, Any]]:
    return [r["data"] for r in _records(storage) if r["type"] == kind]


def _transcript(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the CLI's SessionStore saves: no system/developer messages, sanitize_message's normal form."""
    return [normalise(m) for m in messages if m["role"] not in ("system", "developer")]


def _orphans(messages: list[dict[str, Any]]) -> list[str]:
    calls = [c["id"] for m in messages for c in (m.get("tool_calls") or [])]
    answered = {m.get("tool_call_id") for m in messages if m["role"] == "tool"}
    return [c for c in calls if c not in answered]


def _open(storage: Path, **cfg: Any) -> Any:
    return PersistentContextManager.open(storage_path=storage, session_id="s", **cfg)


async def test_filtered_transcript_is_ignored_and_audited(storage: Path) -> None:
    """The CLI's transcript (no system/developer messages, None fields dropped), current or a turn behind, with
    or without a fresh system message prepended, is ignored with one transcript_ignored event each."""
    await _seed(storage)
    async with await _open(storage) as s:
        await s.set_messages(_transcript(HISTORY))
        await s.set_messages(_transcript(HISTORY)[:-2])  # a turn behind
        await s.set_messages([{"role": "system", "content": "fresh"}, *_transcript(HISTORY)])
        assert await s.get_messages() == HISTORY
    ignored = _of(storage, "transcript_ignored")
    assert [i["kind"] for i in ignored] == ["filtered_transcript"] * 3
    assert not _of(storage, "messages_replaced")


async def test_host_repair_is_accepted_once(storage: Path) -> None:
    """After a kill during a tool call the CLI finds the unanswered call in get_messages() and sets the history
    plus a synthetic result: accepted as one messages_replaced (reason host_repair); the next turn's check finds
    nothing to repair, so it does not repeat."""
    await _seed(storage)
    async with await _open(storage) as s:
        for _turn in range(3):  # the CLI's pre-turn check, turn after turn
            current = await s.get_messages()
            if _orphans(current):
                await s.set_messages([*current, SYNTHETIC_RESULT, SYNTHETIC_REPLY])
        assert await s.get_messages() == [*HISTORY, SYNTHETIC_RESULT, SYNTHETIC_REPLY]
    replaced = _of(storage, "messages_replaced")
    assert len(replaced) == 1 and replaced[0]["reason"] == "host_repair"
    assert not _of(storage, "transcript_ignored")
    async with await _open(storage) as s:
        assert not _orphans(await s.get_messages())


async def test_incomplete_turn_repair_is_accepted_once(storage: Path) -> None:
    """Killed after the tool result, before the reply: the CLI's check finds an incomplete turn and adds the
    repair's reply after the result; accepted once."""
    result = {"role": "tool", "tool_call_id": "call_1", "content": "hi"}
    await _seed(storage, [*HISTORY, result])
    async with await _open(storage) as s:
        for _turn in range(2):
            current = await s.get_messages()
            if current[-1]["role"] == "tool":
                await s.set_messages([*current, SYNTHETIC_REPLY])
        assert await s.get_messages() == [*HISTORY, result, SYNTHETIC_REPLY]
    assert [r["reason"] for r in _of(storage, "messages_replaced")] == ["host_repair"]


async def test_a_repair_of_the_saved_transcript_is_not_taken(storage: Path) -> None:
    """A repair is recognised on what get_messages() returned; a list built from the saved transcript (no system
    or developer messages, normal form) is not one: ignored (the request view answers the call anyway)."""
    await _seed(storage)
    async with await _open(storage) as s:
        await s.set_messages([*_transcript(HISTORY), SYNTHETIC_RESULT])
        assert await s.get_messages() == HISTORY
    assert [i["kind"] for i in _of(storage, "transcript_ignored")] == ["not_recognised"]


async def test_a_stale_transcript_does_not_undo_a_redacted_tool_result(storage: Path) -> None:
    """The redacted result leaves its call unanswered; the host's transcript saved before the redaction still has
    it, but is not a repair of the history (it has no system messages): ignored, the result stays hidden."""
    secret = {"role": "tool", "tool_call_id": "call_1", "content": "the secret"}
    await _seed(storage, [*HISTORY, secret])
    async with await _open(storage) as s:
        await s.redact(len(HISTORY))
    async with await _open(storage) as s:
        await s.set_messages(_transcript([*HISTORY, secret]))
        assert secret not in await s.get_messages()


async def test_explicit_replacement_is_accepted(storage: Path) -> None:
    """A library user undoing the last turn passes a reason; the same list without one looks like a transcript a
    turn behind and is ignored."""
    await _seed(storage)
    async with await _open(storage) as s:
        undo = (await s.get_messages())[:-2]
        await s.set_messages(undo)
        assert await s.get_messages() == HISTORY
        await s.set_messages(undo, reason="undo last turn")
        assert await s.get_messages() == undo
    assert [r["reason"] for r in _of(storage, "messages_replaced")] == ["undo last turn"]
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        async with await _open(storage) as s:
            await s.set_messages([], reason="  ")


async def test_set_messages_after_clear_in_the_same_process(storage: Path) -> None:
    await _seed(storage)
    async with await _open(storage) as s:
        await s.clear()
        await s.set_messages([{"role": "user", "content": "new start"}])
        assert await s.get_messages() == [{"role": "user", "content": "new start"}]
    assert _of(storage, "messages_replaced")[-1]["reason"] == "after clear() in this process"


async def test_stale_transcripts_do_not_undo_a_clear_or_a_redaction(storage: Path) -> None:
    """In a later process a transcript saved before a clear or a redaction is not recognised: ignored."""
    await _seed(storage)
    async with await _open(storage) as s:
        await s.redact(3)  # the assistant's "a1"
    async with await _open(storage) as s:
        await s.set_messages(_transcript(HISTORY))
        assert {"role": "assistant", "content": "a1"} not in await s.get_messages()
        await s.clear()
    async with await _open(storage) as s:
        await s.set_messages(_transcript(HISTORY))
        assert await s.get_messages() == []
    assert [i["kind"] for i in _of(storage, "transcript_ignored")] == ["not_recognised"] * 2


async def test_strict_rule_ignores_every_set_messages(storage: Path) -> None:
    await _seed(storage)
    async with await _open(storage, resume_rule="strict") as s:
        await s.set_messages([*await s.get_messages(), SYNTHETIC_RESULT])
        await s.set_messages(HISTORY[:2], reason="undo")
        assert await s.get_messages() == HISTORY
        await s.clear()
        await s.set_messages(HISTORY[:2])  # even after a clear in this process
        assert await s.get_messages() == []
    assert [i["kind"] for i in _of(storage, "transcript_ignored")] == ["strict"] * 3
    with pytest.raises(ValueError, match="resume_rule must be one of recognise, strict"):
        await _open(storage, resume_rule="lenient")


async def test_a_repair_must_answer_an_unanswered_call(storage: Path) -> None:
    """Added messages that answer no unanswered call (or a user message) are not a repair: ignored."""
    await _seed(storage, HISTORY[:4])
    async with await _open(storage) as s:
        await s.set_messages([*HISTORY[:4], {"role": "assistant", "content": "extra"}])
        await s.set_messages([*HISTORY[:4], {"role": "tool", "tool_call_id": "nope", "content": "x"}])
        await s.set_messages([*HISTORY[:4], {"role": "user", "content": "more"}])
        assert await s.get_messages() == HISTORY[:4]
    assert [i["kind"] for i in _of(storage, "transcript_ignored")] == ["not_recognised"] * 3


def _two_calls() -> list[dict[str, Any]]:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    call2 = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    return [SYSTEM, {"role": "user", "content": "q"}, call, {"role": "tool", "tool_call_id": "c1", "content": "r1"},
            call2, {"role": "tool", "tool_call_id": "c2", "content": "r2"}, {"role": "assistant", "content": "done"}]


async def test_a_history_missing_a_non_final_tool_result_is_not_a_host_repair(storage: Path) -> None:
    """set_messages of the history with a tool result left out (not moved elsewhere) is no repair: ignored, the
    result stays in every view and the request has no "no result recorded" placeholder."""
    history = _two_calls()
    await _seed(storage, history)
    async with await _open(storage) as s:
        await s.set_messages([m for m in history if m.get("tool_call_id") != "c1"])
        assert await s.get_messages() == history
        assert "no result recorded" not in str(await s.get_messages_for_request())
    assert not _of(storage, "messages_replaced")
    # (a transcript missing a message of our log reads as an edited one: ignored, said once, docs/resume.md)
    assert len(_of(storage, "transcript_ignored")) + len(_of(storage, "transcript_edited")) == 1


async def test_a_repair_that_moves_a_tool_result_is_accepted(storage: Path) -> None:
    """A repair that moves a result of the history (every result still there, one at another place) and answers
    an unanswered call is accepted as a host_repair."""
    history = _two_calls()[:-1] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}]
    await _seed(storage, history)
    r1 = history[3]
    moved = [m for m in history if m is not r1]
    moved.insert(moved.index(history[4]) + 1, r1)  # (r1 moved after the second call's block)
    synthetic = {"role": "tool", "tool_call_id": "c3", "content": "interrupted"}
    async with await _open(storage) as s:
        await s.set_messages([*moved, synthetic])
        assert await s.get_messages() == [*moved, synthetic]
    assert [r["reason"] for r in _of(storage, "messages_replaced")] == ["host_repair"]


async def test_the_histories_own_transcript_is_ignored_without_its_checks(storage: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual resume: the transcript holds the history's conversation messages as they are. It is ignored
    and audited as before (the same record, the digest of the same bytes) without the per-message checks and
    the encode they make (model/events.encode_messages: it is called for nothing else here); a transcript
    that differs (an edit, a system message, a message in another form) still takes them."""
    import orjson

    from context_persistent.model import events as ev

    plain = [m for m in HISTORY if m is not CALL] + [CALL]  # (CALL's None field: offered in its normal form)
    await _seed(storage, plain)
    calls: list[int] = []
    real = ev.encode_messages
    monkeypatch.setattr(ev, "encode_messages", lambda messages: calls.append(len(messages)) or real(messages))
    offered = _transcript(plain)
    assert offered[-1] != CALL  # (the CLI's form of it: no None field)
    async with await _open(storage) as s:
        await s.set_messages(offered)
        await s.set_messages(offered[:2])  # (a turn behind)
        assert calls == []
        assert await s.get_messages() == plain
        await s.set_messages([SYSTEM, *offered])  # (a system message: the whole path)
        edited = [*offered[:1], {"role": "assistant", "content": "a1, edited"}, *offered[2:]]
        await s.set_messages(edited)
        blocks = {**CALL, "content_blocks": [{"n": float("nan")}]}  # (differs in what normalise drops)
        with pytest.raises(ValueError, match="NaN"):  # (the whole path: its checks refuse the NaN)
            await s.set_messages([*offered[:-1], blocks])
        assert calls == [len(offered) + 1, len(offered), len(offered)]
    ignored = _of(storage, "transcript_ignored")
    assert [d["kind"] for d in ignored] == ["filtered_transcript"] * 3
    payload = orjson.dumps(offered)
    assert ignored[0]["digest"] == ev.digest(payload) and ignored[0]["bytes"] == len(payload)
    assert ignored[0]["count"] == len(offered) and ignored[1]["count"] == 2
    assert ignored[0]["reason"] == ignored[2]["reason"]
    assert len(_of(storage, "transcript_edited")) == 1


@pytest.mark.parametrize("thread_bytes", [1, 1 << 40])
async def test_the_digest_of_the_histories_own_transcript_is_the_same_made_on_a_thread_or_not(
        storage: Path, monkeypatch: pytest.MonkeyPatch, thread_bytes: int) -> None:
    """The usual resume's transcript is encoded before it is compared and digested on a thread (large ones) while
    it is: the record holds the digest of its bytes either way, and a transcript that turns out not to be the
    history's (an edit, a NaN the encode let through) is thrown away and takes the whole path."""
    import hashlib

    import orjson

    from context_persistent.store import edits

    monkeypatch.setattr(edits, "THREAD_DIGEST_BYTES", thread_bytes)
    plain = [m for m in HISTORY if m is not CALL] + [CALL]
    await _seed(storage, plain)
    offered = _transcript(plain)
    async with await _open(storage) as s:
        await s.set_messages(offered)
        edited = [*offered[:1], {"role": "assistant", "content": "a1, edited"}, *offered[2:]]
        await s.set_messages(edited)
        with pytest.raises(ValueError, match="NaN"):
            await s.set_messages([*offered[:-1], {**offered[-1], "n": float("nan")}])
        assert await s.get_messages() == plain
    ignored = _of(storage, "transcript_ignored")
    assert [d["kind"] for d in ignored] == ["filtered_transcript"]
    payload = orjson.dumps(offered)
    assert ignored[0]["digest"] == "sha256:" + hashlib.sha256(payload).hexdigest()
    assert ignored[0]["bytes"] == len(payload) and ignored[0]["count"] == len(offered)
    edited_record = _of(storage, "transcript_edited")
    assert len(edited_record) == 1 and edited_record[0]["digest"] == "sha256:" + hashlib.sha256(
        orjson.dumps(edited)).hexdigest()


def test_a_digest_made_on_a_thread_equals_one_made_at_once() -> None:
    from context_persistent.model import events as ev
    from context_persistent.store.edits import THREAD_DIGEST_BYTES, _Digest

    big = b"x" * (THREAD_DIGEST_BYTES + 7)
    on_thread = _Digest(big)
    assert on_thread._thread is not None and on_thread.value() == ev.digest(big) and on_thread._thread is None
    small = _Digest(b"[]")
    assert small._thread is None and small.value() == ev.digest(b"[]")


def test_only_plain_dicts_equal_to_the_history_are_its_own_transcript() -> None:
    """The usual case is decided in C (list equality, then the items' types): an object that answers == with
    True, or a dict subclass (which may), is not taken for the history's message; a system message never is."""
    from context_persistent.model.resume import is_stored_transcript

    class Liar:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = None  # type: ignore[assignment]

    class Dict(dict):  # type: ignore[type-arg]
        pass

    history = [SYSTEM, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert is_stored_transcript(history, [dict(m) for m in history[1:]])
    assert is_stored_transcript(history, [dict(history[1])])  # (a turn behind)
    assert not is_stored_transcript(history, [dict(history[1]), Liar()])
    assert not is_stored_transcript(history, [Dict(history[1]), dict(history[2])])
    assert not is_stored_transcript(history, [dict(m) for m in history])  # (the system message too)
    assert not is_stored_transcript(history, [dict(history[2])])  # (not from the first)
