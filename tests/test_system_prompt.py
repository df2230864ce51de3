"""Exactly one system prompt in every request, however many resumes (docs/resume.md, "The system prompt")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode


def _open(storage: Path, **cfg: Any) -> Any:
    return PersistentContextManager.open(storage_path=storage, session_id="p", **cfg)


def _kinds(storage: Path) -> list[str]:
    return [decode(x)["type"] for x in (storage / "p" / "events.jsonl").read_bytes().rstrip(b"\0").splitlines()]


def _systems(view: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in view if m["role"] == "system"]


def _factory(text: str) -> Any:
    async def factory() -> str:
        return text
    return factory


async def _turn(s: Any, i: int) -> list[dict[str, Any]]:
    await s.add_message({"role": "user", "content": f"q{i}"})
    view = await s.get_messages_for_request()
    await s.add_message({"role": "assistant", "content": f"a{i}"})
    return view


async def test_factory_gives_one_prompt_over_many_resumes(storage: Path) -> None:
    """The host registers the factory on every session start; each request carries its prompt once, first, and
    an unchanged prompt is written once in all."""
    for i in range(5):
        async with await _open(storage) as s:
            await s.set_system_prompt_factory(_factory("You are the bundle."))
            view = await _turn(s, i)
            assert _systems(view) == ["You are the bundle."] and view[0]["role"] == "system"
            assert [m["content"] for m in view if m["role"] == "user"] == [f"q{k}" for k in range(i + 1)]
    assert _kinds(storage).count("system_prompt_set") == 1


async def test_a_changed_prompt_replaces_the_old_one_as_an_event(storage: Path) -> None:
    """A new bundle prompt replaces the old one in the views; the log keeps what the model saw when."""
    async with await _open(storage) as s:
        await s.set_system_prompt_factory(_factory("v1"))
        await _turn(s, 0)
        seq_v1 = s.head_seq
    async with await _open(storage) as s:
        await s.set_system_prompt_factory(_factory("v2"))
        view = await _turn(s, 1)
        assert _systems(view) == ["v2"]
        assert _systems(await s.get_messages()) == ["v2"]
        async with await s.at(seq_v1) as before:
            assert _systems(await before.get_messages()) == ["v1"]
    assert _kinds(storage).count("system_prompt_set") == 2


async def test_fallback_system_message_on_every_resume_does_not_pile_up(storage: Path) -> None:
    """A host without factory support adds the prompt with add_message at every session start: on a resume it
    replaces the leading system message instead of piling up (each such add is in the log)."""
    for i, prompt in enumerate(["S", "S", "S", "S2"]):
        async with await _open(storage) as s:
            await s.add_message({"role": "system", "content": prompt})
            view = await _turn(s, i)
            assert _systems(view) == [prompt]
    async with await _open(storage) as s:
        assert _systems(await s.get_messages()) == ["S2"]
    assert _kinds(storage).count("system_prompt_set") == 3  # the first start's add is an ordinary message


async def test_system_messages_after_the_start_are_conversation(storage: Path) -> None:
    """Only the session start's system messages are the prompt; a system message added later, or a hook's
    injection (metadata.source == "hook"), is kept where it was added."""
    async with await _open(storage) as s:
        await s.add_message({"role": "system", "content": "S"})
        await _turn(s, 0)
    hook = {"role": "system", "content": "hook context", "metadata": {"source": "hook"}}
    async with await _open(storage) as s:
        await s.add_message(hook)
        await s.add_message({"role": "user", "content": "q1"})
        await s.add_message({"role": "system", "content": "note"})
        assert _systems(await s.get_messages()) == ["S", "hook context", "note"]


async def test_hooks_wrap_the_factory(storage: Path) -> None:
    """Hooks compose onto the prompt as they do with context-simple: read ``_system_prompt_factory``, register a
    wrapper; the next request carries the wrapped text once."""
    async with await _open(storage) as s:
        await s.set_system_prompt_factory(_factory("BASE"))
        base = s._system_prompt_factory

        async def wrapped() -> str:
            return await base() + "\n<status/>"

        await s.set_system_prompt_factory(wrapped)
        view = await _turn(s, 0)
        assert _systems(view) == ["BASE\n<status/>"]


async def test_factory_replaces_several_leading_system_messages(storage: Path) -> None:
    """A history that opens with several system messages (e.g. piled up by an older version) gets one."""
    async with await _open(storage) as s:
        for text in ("old1", "old2"):
            await s.add_message({"role": "system", "content": text})
        await s.add_message({"role": "user", "content": "q"})
        await s.pin(2)
        await s.set_system_prompt_factory(_factory("new"))
        view = await s.get_messages_for_request()
        assert _systems(view) == ["new"] and len(await s.get_messages()) == 2
        assert s._state.keys[1] in s._state.pinned  # the user message's pin survives


async def test_bad_factories_are_refused(storage: Path) -> None:
    async with await _open(storage) as s:
        with pytest.raises(ValueError, match="async callable"):
            await s.set_system_prompt_factory("not callable")  # type: ignore[arg-type]

        async def bad() -> Any:
            return 42

        await s.set_system_prompt_factory(bad)
        await s.add_message({"role": "user", "content": "q"})
        with pytest.raises(ValueError, match="returned int, expected a str"):
            await s.get_messages_for_request()
        assert await s.get_messages() == [{"role": "user", "content": "q"}]
