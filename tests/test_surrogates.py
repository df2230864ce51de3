"""Strings with lone surrogates (a non-UTF-8 file name, as ``os.fsdecode``/``os.listdir`` give it) are stored and
given back unchanged by the core and every adapter (issue #28, item 13; model/json_lossless.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, import_
from context_persistent.model import codec, json_lossless

NAME = os.fsdecode(b"caf\xe9 \xff.txt")  # 'caf\udce9 \udcff.txt'
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": f"list {NAME} ünï ✓"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"path": NAME}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [NAME, "b.txt"], NAME: {"key": "a key with it"}},
    {"role": "assistant", "content": [{"type": "text", "text": f"found {NAME}"}]},
]

_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()))
_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | _text
                     | st.floats(allow_nan=False, allow_infinity=False),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                     max_leaves=20)


def _has_pair(value: Any) -> bool:
    strings: list[str] = []
    json_lossless._collect(value, strings)
    return any(json_lossless._PAIR.search(s) for s in strings)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_any_json_value_round_trips(value: Any) -> None:
    """Every JSON value (strings with any code points, lone surrogates included) reads back equal; without a
    surrogate the bytes are orjson's own; a surrogate pair held as two code points is refused, not changed."""
    if _has_pair(value):
        with pytest.raises(orjson.JSONEncodeError, match="surrogate pair as two code points"):
            json_lossless.dumps(value)
        return
    data = json_lossless.dumps(value)
    assert json_lossless.loads(data) == value
    data.decode("utf-8")  # (valid UTF-8: no surrogate is written raw)
    try:
        assert data == orjson.dumps(value)
    except orjson.JSONEncodeError as e:
        assert "surrogates" in str(e)


def test_escapes_and_refusals() -> None:
    """Only the surrogates are escaped (other text stays as orjson writes it); reading keeps orjson's rules:
    no NaN, no infinity, no invalid UTF-8."""
    assert json_lossless.dumps({"k": f"ü {NAME}"}) == b'{"k":"\xc3\xbc caf\\udce9 \\udcff.txt"}'
    assert json_lossless.dumps(["\x01" + NAME]) == b'["\\u0001caf\\udce9 \\udcff.txt"]'
    for bad in (b'["\\udce9", NaN]', b'["\\udce9", 1e400]', b'["\\udce9", "\xff"]', b'["\\udce9"'):
        with pytest.raises(orjson.JSONDecodeError):
            json_lossless.loads(bad)
    with pytest.raises(ValueError, match="not JSON-serialisable: .*surrogate pair"):
        codec.dumps({"role": "user", "content": "\ud83d\ude00"})


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_a_record_stays_jsonl_that_jq_reads() -> None:
    """The record of such a message is one line of valid JSON that jq reads (as U+FFFD), and its CRC checks."""
    line = codec.encode_event(2, "message_added", {"message": MESSAGES[0]}, prev=b"00000000")
    assert codec.decode(line)["data"]["message"] == MESSAGES[0]
    out = subprocess.run(["jq", "-r", ".data.message.content"], input=line, capture_output=True, check=True).stdout
    assert out.decode() == "list caf\ufffd \ufffd.txt ünï ✓\n"


async def _filled(storage: Path, session_id: str = "s", **config: Any) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session_id, checkpoint_every=3,
                                                **config)
    await store.add_messages(MESSAGES[:2])
    for m in MESSAGES[2:]:
        await store.add_message(m)
    return store


async def test_core_round_trip_through_checkpoint_export_and_resume(storage: Path, tmp_path: Path) -> None:
    """add_message, a reopen from a checkpoint, the request view and token count, JSONL/JSON export and import,
    Markdown export (the escape as text), fork and a resumed host's set_messages all keep the strings."""
    store = await _filled(storage)
    assert await store.get_messages() == MESSAGES
    assert await store.get_messages_for_request(token_budget=10_000) == MESSAGES
    assert await store.get_token_count() > 0
    for fmt in ("jsonl", "json", "md"):
        await store.export(tmp_path / f"s.{fmt}")
    await store.close()
    assert (storage / "s" / "checkpoint.json").exists()
    again = await PersistentContextManager.open(storage_path=storage, session_id="s")
    assert await again.get_messages() == MESSAGES
    await again.set_messages(MESSAGES)  # (a host resuming with the transcript it kept: recognised)
    assert await again.get_messages() == MESSAGES
    edited = [MESSAGES[0], {"role": "user", "content": NAME + " edited"}] + MESSAGES[1:]
    await again.set_messages(edited)  # (an edited transcript: classified by the resume rule, no error)
    assert await again.get_messages() in (MESSAGES, edited)
    await again.set_messages(MESSAGES + [{"role": "user", "content": NAME}], reason="a host's edit")
    await again.fork("f")
    await again.close()
    for fmt in ("jsonl", "json"):
        await import_(tmp_path / f"s.{fmt}", session_id=f"i{fmt}", storage_path=storage)
        imported = await PersistentContextManager.open(storage_path=storage, session_id=f"i{fmt}", readonly=True)
        assert await imported.get_messages() == MESSAGES
        await imported.close()
    assert "caf\\udce9 \\udcff.txt" in (tmp_path / "s.md").read_text()
    for session_id, expected in (("s", MESSAGES + [{"role": "user", "content": NAME}]),
                                 ("f", MESSAGES + [{"role": "user", "content": NAME}])):
        reader = await PersistentContextManager.open(storage_path=storage, session_id=session_id, readonly=True)
        assert await reader.get_messages() == expected
        await reader.close()


def test_cli_show_json_and_text(storage: Path, subprocess_env: dict[str, str]) -> None:
    """``show --json`` gives the strings back exactly (Python's json reads the escapes), ``tail --json`` prints
    valid records, and the text output writes the escape where the terminal encoding is strict."""
    import asyncio

    async def fill() -> None:
        await (await _filled(storage)).close()

    asyncio.run(fill())
    env = {**subprocess_env, "PYTHONIOENCODING": "utf-8:strict"}
    base = [sys.executable, "-m", "context_persistent", "--storage", str(storage)]

    def run(*args: str) -> str:
        proc = subprocess.run(base + list(args), env=env, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode()
        return proc.stdout.decode()

    shown = json.loads(run("show", "s", "--json"))
    assert shown["messages"] == MESSAGES
    records = [json.loads(line) for line in run("tail", "s", "--json").splitlines()]
    assert [r["data"]["message"] for r in records if r["type"] == "message_added"] == MESSAGES
    assert "list caf\\udce9 \\udcff.txt" in run("show", "s")


@pytest.mark.postgres
async def test_on_the_postgres_backend(storage: Path, sid: str, pg_config: dict[str, Any]) -> None:
    """The PostgreSQL backend (bytea records, checkpoint rows) keeps the strings across a reopen."""
    store = await _filled(storage, sid, **pg_config)
    await store.close()
    again = await PersistentContextManager.open(storage_path=storage, session_id=sid, **pg_config)
    assert await again.get_messages() == MESSAGES
    await again.close()


async def test_openai_agents_runner_with_a_tool_returning_a_non_utf8_name(storage: Path) -> None:
    """A real ``Runner.run`` whose tool returns ``os.fsdecode`` of a non-UTF-8 name stores the turn; the items
    come back unchanged after a reopen, and the next run is given them."""
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.testing import ScriptedModel, assistant_message, function_call

    from context_persistent.integrations.openai_agents import PersistentSession

    @function_tool
    def listdir() -> str:
        """The files here."""
        return NAME

    set_tracing_disabled(True)
    try:
        model = ScriptedModel(steps=[[function_call("listdir", {}, call_id="call-1")],
                                     [assistant_message(f"there is {NAME}")], [assistant_message("ok")]])
        agent = Agent(name="a", model=model, tools=[listdir])
        async with PersistentSession("oa", storage) as session:
            assert (await Runner.run(agent, "ls?", session=session)).final_output == f"there is {NAME}"
            first = await session.get_items()
        assert [i.get("output") for i in first if i.get("type") == "function_call_output"] == [NAME]
        async with PersistentSession("oa", storage) as resumed:
            assert await resumed.get_items() == first
            await Runner.run(agent, "again", session=resumed)
            assert model.calls[-1].input[:len(first)] == first
    finally:
        set_tracing_disabled(False)


async def test_agent_framework_and_autogen_keep_the_strings(tmp_path: Path) -> None:
    """Agent Framework's history provider and AutoGen's model context store such text and give it back after
    a reopen."""
    from agent_framework import Message
    from autogen_core.models import UserMessage

    from context_persistent.integrations.agent_framework import PersistentHistoryProvider
    from context_persistent.integrations.autogen import PersistentChatCompletionContext

    async with PersistentHistoryProvider(tmp_path / "af") as provider:
        await provider.save_messages("s", [Message(role="user", contents=[NAME])])
    async with PersistentHistoryProvider(tmp_path / "af") as provider:
        assert [m.text for m in await provider.get_messages("s")] == [NAME]
    async with PersistentChatCompletionContext(tmp_path / "ag", "s") as ctx:
        await ctx.add_message(UserMessage(content=NAME, source=NAME))
    async with PersistentChatCompletionContext(tmp_path / "ag", "s") as ctx:
        assert await ctx.get_messages() == [UserMessage(content=NAME, source=NAME)]
