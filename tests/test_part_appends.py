"""Messages coming in, on their own (Appends and SystemPrompt over a Session and a Writer): an invalid message
stores nothing; the stored message is the store's own copy; at session start on a resume a re-added system
prompt replaces the leading ones; a host replaying the loaded history is recognised and folded out; the
factory's prompt is written only when it changes. And, through the whole store in every write mode: a
message is serialised once on its way to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.model import events as ev
from context_persistent.store.appends import Appends
from context_persistent.store.system_prompt import SystemPrompt
from parts import records, started


async def appends_over(storage: Path, **config: Any) -> tuple[Any, Appends, SystemPrompt]:
    session, writer = await started(storage, tokenizer="chars/4", **config)
    prompt = SystemPrompt(session, writer)
    return session, Appends(session, writer, prompt), prompt


async def test_an_invalid_message_stores_nothing_and_a_valid_one_is_copied(storage: Path) -> None:
    """ValueError names the problem and nothing is written; the caller's later change does not reach the
    stored message."""
    session, appends, _ = await appends_over(storage)
    with pytest.raises(ValueError, match="unknown role"):
        await appends.add_message({"role": "nobody", "content": "x"})
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        await appends.add_messages([{"role": "user", "content": "a"}, {"content": "b"}])
    assert len(records(storage)) == 1
    message: dict[str, Any] = {"role": "user", "content": "hi", "metadata": {"tags": ["a"]}}
    await appends.add_message(message)
    message["metadata"]["tags"].append("changed")
    assert session.state.messages == [{"role": "user", "content": "hi", "metadata": {"tags": ["a"]}}]
    await appends.add_messages([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    assert [r["type"] for r in records(storage)] == [ev.SESSION_STARTED] + [ev.MESSAGE_ADDED] * 3
    await session.log.close()


async def test_a_system_prompt_re_added_at_session_start_replaces_the_leading_ones(storage: Path) -> None:
    """After begin_resume, system messages added first become one system_prompt_set; the first other
    message ends the session start (a later system message is conversation content)."""
    session, appends, _ = await appends_over(storage)
    await appends.add_messages([{"role": "system", "content": "old"}, {"role": "user", "content": "q"}])
    appends.begin_resume(session.state)
    await appends.add_message({"role": "system", "content": "new"})
    assert session.state.messages == [{"role": "system", "content": "new"}, {"role": "user", "content": "q"}]
    await appends.add_message({"role": "user", "content": "next"})
    await appends.add_message({"role": "system", "content": "a note"})
    assert [m["content"] for m in session.state.messages] == ["new", "q", "next", "a note"]
    assert [r["type"] for r in records(storage)][-3:] == [ev.SYSTEM_PROMPT_SET, ev.MESSAGE_ADDED, ev.MESSAGE_ADDED]
    await session.log.close()


async def test_a_replay_of_the_loaded_history_is_recognised_and_folded_out(storage: Path) -> None:
    """With recognise_replay, repeating the loaded history then adding a new message writes a
    replay_recognised event naming the repeated messages, which leave the views."""
    session, appends, _ = await appends_over(storage, recognise_replay=True)
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    await appends.add_messages(history)
    appends.begin_resume(session.state)
    assert appends.replay is not None
    for m in history:
        await appends.add_message(dict(m))
    await appends.add_message({"role": "user", "content": "new"})
    assert [r["type"] for r in records(storage)][-2:] == [ev.REPLAY_RECOGNISED, ev.MESSAGE_ADDED]
    assert session.state.messages == [*history, {"role": "user", "content": "new"}]
    await session.log.close()


async def test_the_factory_prompt_is_written_only_when_it_changes(storage: Path) -> None:
    """refresh() writes one system_prompt_set for a new text and nothing while it stays the same; a factory
    that returns no str raises ValueError."""
    session, appends, prompt = await appends_over(storage)
    await appends.add_message({"role": "user", "content": "q"})
    text = ["be brief"]

    async def factory() -> Any:
        return text[0]

    prompt.set_factory(factory)
    await prompt.refresh()
    await prompt.refresh()
    text[0] = "be exact"
    await prompt.refresh()
    assert [r["type"] for r in records(storage)].count(ev.SYSTEM_PROMPT_SET) == 2
    assert session.state.messages[0] == {"role": "system", "content": "be exact"}
    text[0] = 42  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="expected a str"):
        await prompt.refresh()
    with pytest.raises(ValueError, match="callable"):
        prompt.set_factory("not callable")  # type: ignore[arg-type]
    await session.log.close()


NEEDLE = "needle-7f3a"


def count_serialisations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the orjson.dumps calls whose output holds the needle (the message, or anything holding it)."""
    calls: list[int] = []
    real = orjson.dumps

    def counting(value: Any, *args: Any, **kwargs: Any) -> bytes:
        out = real(value, *args, **kwargs)
        if NEEDLE.encode() in out:
            calls.append(1)
        return out

    monkeypatch.setattr(orjson, "dumps", counting)
    return calls


@pytest.mark.parametrize("config", [{"fsync": "always"}, {"fsync": "never"}, {"fsync": "batch"},
                                    {"fsync": "always", "reserve_tail": True}])
async def test_a_message_is_serialised_once_on_its_way_to_disk(storage: Path, monkeypatch: pytest.MonkeyPatch,
                                                               config: dict[str, Any]) -> None:
    """add_message and add_messages encode each message once: the record embeds those bytes (a second
    encoding for the record line, the projection or the token count would be counted here)."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="once", tokenizer="chars/4",
                                                **config)
    calls = count_serialisations(monkeypatch)
    await store.add_message({"role": "user", "content": NEEDLE})
    assert len(calls) == 1
    await store.add_messages([{"role": "user", "content": NEEDLE + "-a"}, {"role": "user", "content": NEEDLE + "-b"}])
    assert len(calls) == 3
    await store.get_token_count()
    assert len(calls) == 3
    monkeypatch.undo()
    await store.close()
    assert (storage / "once" / "events.jsonl").read_bytes().count(NEEDLE.encode()) == 3


async def test_a_replayed_message_is_serialised_once_too(storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a replay of the loaded history is recognised, the bytes written are the bytes compared."""
    history = [{"role": "user", "content": NEEDLE}, {"role": "assistant", "content": "answer"}]
    async with await PersistentContextManager.open(storage_path=storage, session_id="r", tokenizer="chars/4") as s:
        await s.add_messages(history)
    store = await PersistentContextManager.open(storage_path=storage, session_id="r", tokenizer="chars/4",
                                                recognise_replay=True)
    calls = count_serialisations(monkeypatch)
    await store.add_message(dict(history[0]))
    assert len(calls) == 1
    monkeypatch.undo()
    await store.add_message(dict(history[1]))
    await store.add_message({"role": "user", "content": "new"})
    assert await store.get_messages() == [*history, {"role": "user", "content": "new"}]
    await store.close()
