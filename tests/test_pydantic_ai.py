"""PersistentMessageHistory for Pydantic AI: ModelMessages stored losslessly through ModelMessagesTypeAdapter,
history processors applied on read, a real Agent (TestModel, FunctionModel) continuing after a restart, and one
killed with SIGKILL and resumed with its whole history (tests/pydantic_ai_child.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, RunContext  # noqa: E402
from pydantic_ai.messages import (BinaryContent, ModelMessage, ModelMessagesTypeAdapter, ModelRequest,  # noqa: E402
                                  ModelResponse, SystemPromptPart, TextPart, ThinkingPart,
                                  ToolCallPart, ToolReturnPart, UserPromptPart)
from pydantic_ai.models.test import TestModel  # noqa: E402
from pydantic_ai.usage import RequestUsage  # noqa: E402

from conftest import PYTHON, ROOT  # noqa: E402
from context_persistent import PersistentContextManager  # noqa: E402
from context_persistent.integrations.pydantic_ai import PersistentMessageHistory  # noqa: E402

T0 = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)


def _every_kind() -> list[ModelMessage]:
    return [
        ModelRequest(parts=[SystemPromptPart("Be brief.", timestamp=T0),
                            UserPromptPart(["Describe this", BinaryContent(b"\x89PNG\x00\xff", media_type="image/png")],
                                           timestamp=T0)], instructions="Use tools."),
        ModelResponse(parts=[ThinkingPart("hmm", signature="sig"), TextPart("Looking."),
                             ToolCallPart("lookup", {"q": "x", "n": [1, 2.5, None]}, tool_call_id="c1")],
                      usage=RequestUsage(input_tokens=12, output_tokens=7), model_name="m-1", timestamp=T0,
                      provider_name="p", provider_response_id="r-1"),
        ModelRequest(parts=[ToolReturnPart("lookup", {"answer": "ünïcode ✓"}, tool_call_id="c1", timestamp=T0),
                            ToolReturnPart("other", "bad args", tool_call_id="c2", outcome="retried",
                                           timestamp=T0)]),
        ModelResponse(parts=[TextPart("Done.")], timestamp=T0),
    ]


def _json(messages: list[ModelMessage]) -> bytes:
    return ModelMessagesTypeAdapter.dump_json(messages)


async def test_every_part_kind_comes_back_exactly(tmp_path: Path) -> None:
    """Requests and responses with every part kind, binary content, usage and ids come back after a new open as
    ModelMessagesTypeAdapter reads them."""
    messages = _every_kind()
    async with PersistentMessageHistory(tmp_path, "s") as history:
        await history.append(messages[:2])
        await history.append(messages[2:])
    async with PersistentMessageHistory(tmp_path, "s") as history:
        loaded = await history.load()
    # Exactly what Pydantic AI's own adapter gives for a round trip through JSON (it reads a UTC offset as its
    # TzInfo and image bytes as BinaryImage), byte for byte in its JSON form.
    assert loaded == ModelMessagesTypeAdapter.validate_json(_json(messages))
    assert _json(loaded) == _json(messages)


async def test_history_processors_apply_on_read_and_change_nothing_stored(tmp_path: Path) -> None:
    """Sync and async processors run in order on load(); load(raw=True) and the store keep everything."""
    def keep_last_two(ms: list[ModelMessage]) -> list[ModelMessage]:
        return ms[-2:]

    async def only_responses(ms: list[ModelMessage]) -> list[ModelMessage]:
        return [m for m in ms if isinstance(m, ModelResponse)]

    async with PersistentMessageHistory(tmp_path, "p", history_processors=[keep_last_two, only_responses]) as h:
        await h.append(_every_kind())
        assert [m.parts[0].content for m in await h.load()] == ["Done."]  # type: ignore[union-attr]
        assert len(await h.load(raw=True)) == 4
        assert len(await h.run(lambda store: store.get_messages())) == 4

    def needs_ctx(ctx: RunContext[None], ms: list[ModelMessage]) -> list[ModelMessage]:
        return ms

    with pytest.raises(ValueError, match="takes a RunContext"):
        PersistentMessageHistory(tmp_path, "p", history_processors=[needs_ctx])


async def test_an_agent_continues_after_a_restart(tmp_path: Path) -> None:
    """TestModel: the second run (new history object) is given the first run's messages."""
    agent = Agent(TestModel(custom_output_text="ok"))
    async with PersistentMessageHistory(tmp_path, "chat") as history:
        first = await agent.run("hello", message_history=await history.load())
        await history.append(first.new_messages())
    async with PersistentMessageHistory(tmp_path, "chat") as history:
        second = await agent.run("again", message_history=await history.load())
        await history.append(second.new_messages())
        stored = await history.load()
    assert _json(stored) == _json(second.all_messages())
    prompts = [p.content for m in stored for p in m.parts if isinstance(p, UserPromptPart)]
    assert prompts == ["hello", "again"]


async def test_bad_messages_and_foreign_sessions_are_refused(tmp_path: Path) -> None:
    """A non-ModelMessage stores nothing; a session another host wrote is an error naming the message."""
    async with PersistentMessageHistory(tmp_path, "x") as history:
        with pytest.raises(ValueError, match="must be a pydantic_ai ModelRequest or ModelResponse, got dict"):
            await history.append([_every_kind()[0], {"role": "user"}])  # type: ignore[list-item]
        assert await history.load() == []
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="other") as store:
        await store.add_message({"role": "user", "content": "hi"})
    async with PersistentMessageHistory(tmp_path, "other") as history:
        with pytest.raises(ValueError, match="stored message 0 was not stored by PersistentMessageHistory"):
            await history.load()


def test_pydantic_ai_loads_only_when_used(subprocess_env: dict[str, str]) -> None:
    """Importing the package imports no Pydantic AI; without it the module names the extra to install."""
    code = ("import sys, context_persistent, context_persistent.integrations\n"
            "assert not any(m.split('.')[0] == 'pydantic_ai' for m in sys.modules)\n"
            "sys.modules['pydantic_ai'] = None\n"
            "try:\n    import context_persistent.integrations.pydantic_ai\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'context-persistent[pydantic-ai]'" in out.stdout


@pytest.mark.slow
def test_agent_killed_mid_run_resumes_with_its_whole_history(tmp_path: Path, subprocess_env: dict[str, Any]) -> None:
    """SIGKILL during the turns, twice; the next process's model is shown every acknowledged turn."""
    store, acks = tmp_path / "store", tmp_path / "acks"
    child = str(ROOT / "tests" / "pydantic_ai_child.py")

    def acked() -> list[int]:
        return [int(x) for x in acks.read_text().split()] if acks.exists() else []

    first = 1
    for kill_after in (3, 2):
        before = len(acked())
        proc = subprocess.Popen([PYTHON, child, str(store), "s", str(first), str(first + 500), str(acks)],
                                env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        try:
            while len(acked()) < before + kill_after:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
                assert time.monotonic() < deadline
                time.sleep(0.002)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        first = acked()[-1] + 1
        # A turn whose messages were stored but not yet acknowledged is in the history: start after it.
        import asyncio

        async def last_turn() -> int:
            async with PersistentMessageHistory(store, "s") as h:
                prompts = [p.content for m in await h.load() for p in m.parts if isinstance(p, UserPromptPart)]
            return int(str(prompts[-1]).split()[-1]) if prompts else 0

        first = max(first, asyncio.run(last_turn()) + 1)
    done = subprocess.run([PYTHON, child, str(store), "s", str(first), str(first + 1), str(acks)],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    import asyncio

    async def read() -> list[ModelMessage]:
        async with PersistentMessageHistory(store, "s") as h:
            return await h.load()

    history = asyncio.run(read())
    answers = [p.content for m in history if isinstance(m, ModelResponse) for p in m.parts
               if isinstance(p, TextPart)]
    turns = len(answers)
    assert set(acked()) <= set(range(1, turns + 1)) and len(history) == 4 * turns
    # Every turn whole and in order, and its model call was shown every earlier turn: nothing was lost.
    assert answers == [f"answer {k}: fact-{k} (saw {k} user turns)" for k in range(1, turns + 1)]
