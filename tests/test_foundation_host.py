"""The host's own functions against the store: amplifier_foundation's transcript repair and its
``sanitize_message`` (the normal form the CLI's SessionStore saves transcripts in).

The interactive CLI, before every turn, runs ``diagnose_transcript(await context.get_messages())`` and, when it
finds the history broken, calls ``context.set_messages(repair_transcript(...))``; it saves each turn's
transcript as ``json.dumps(sanitize_message(m))`` lines without system/developer messages, and gives it back on
resume (``set_messages``, or ``add_message`` per message for a sub-session). The functions are taken from the
foundation source archive in ``../shared/amplifier-host/`` (``$CONTEXT_PERSISTENT_AMPLIFIER_HOST`` overrides the
folder; these modules use only the standard library), loaded into a temporary package. Where the archive is
absent the tests skip with the reason; ``CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST=1`` makes that a failure.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.codec import decode

ROOT = Path(__file__).resolve().parent.parent
FILES = ("amplifier_foundation/session/diagnosis.py", "amplifier_foundation/session/messages.py",
         "amplifier_foundation/serialization.py")


def _host_dir() -> Path:
    return Path(os.environ.get("CONTEXT_PERSISTENT_AMPLIFIER_HOST") or ROOT.parent / "shared" / "amplifier-host")


@pytest.fixture(scope="module")
def foundation(tmp_path_factory: pytest.TempPathFactory) -> Any:
    archives = sorted(_host_dir().glob("amplifier-foundation-*.tar.gz"))
    if len(archives) != 1:
        reason = f"no amplifier-foundation archive in {_host_dir()}"
        if os.environ.get("CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST") == "1":
            pytest.fail(f"the real Amplifier host is required but {reason}", pytrace=False)
        pytest.skip(reason)
    package = tmp_path_factory.mktemp("foundation") / "fdn_session"
    package.mkdir()
    (package / "__init__.py").write_text("")
    with tarfile.open(archives[0]) as tar:
        for member in tar.getmembers():
            for wanted in FILES:
                if member.name.endswith("/" + wanted):
                    source = tar.extractfile(member)
                    assert source is not None
                    (package / Path(wanted).name).write_bytes(source.read())
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "diagnosis.py", "messages.py",
                                                         "serialization.py"]
    sys.path.insert(0, str(package.parent))
    try:
        yield importlib.import_module("fdn_session.diagnosis")
    finally:
        sys.path.remove(str(package.parent))
        for name in [n for n in sys.modules if n == "fdn_session" or n.startswith("fdn_session.")]:
            del sys.modules[name]


CALL = {"role": "assistant", "content": [{"type": "text", "text": "reading", "visibility": None}],
        "tool_calls": [{"id": "call_1", "tool": "echo", "arguments": {"text": "hi"}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "hi"}
BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}]


async def _cli_turns(store: PersistentContextManager, diagnosis: Any, turns: int) -> int:
    """What main.py's _repair_transcript_if_needed does before each turn; returns how many repairs it made."""
    repairs = 0
    for i in range(turns):
        messages = await store.get_messages()
        found = diagnosis.diagnose_transcript(messages)
        if found["status"] == "broken":
            await store.set_messages(diagnosis.repair_transcript(messages, found))
            repairs += 1
        await store.add_message({"role": "user", "content": f"turn {i}"})
        await store.get_messages_for_request()
        await store.add_message({"role": "assistant", "content": f"reply {i}"})
    return repairs


@pytest.mark.parametrize("killed", ["during the tool call", "after the tool result"])
async def test_the_cli_repair_happens_once(storage: Path, foundation: Any, killed: str) -> None:
    """A session killed during a tool call (no result) or after its result (no reply): the first turn's check
    repairs it, the store accepts the repair (one messages_replaced, host_repair), later checks find it healthy."""
    history = [*BASE, CALL] if killed == "during the tool call" else [*BASE, CALL, RESULT]
    async with await PersistentContextManager.open(storage_path=storage, session_id="k") as s:
        for m in history:
            await s.add_message(m)
    async with await PersistentContextManager.open(storage_path=storage, session_id="k") as s:
        assert await _cli_turns(s, foundation, turns=3) == 1
        assert foundation.diagnose_transcript(await s.get_messages())["status"] == "healthy"
        assert (await s.get_messages())[: len(history)] == history
    records = [decode(x) for x in (storage / "k" / "events.jsonl").read_bytes().splitlines()]
    replaced = [r["data"] for r in records if r["type"] == "messages_replaced"]
    assert [r["reason"] for r in replaced] == ["host_repair"]
    assert not [r for r in records if r["type"] == "transcript_ignored"]


@pytest.fixture
def sanitize(foundation: Any) -> Any:
    return importlib.import_module("fdn_session.serialization").sanitize_message


def _saved(messages: list[dict[str, Any]], sanitize: Any) -> list[dict[str, Any]]:
    """The CLI SessionStore's transcript of ``messages``, as written and read back."""
    return [json.loads(json.dumps(sanitize(m), ensure_ascii=False)) for m in messages
            if m.get("role") not in ("system", "developer")]


LOOP_BASIC_REPLY = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": None},
                                                    {"type": "text", "text": "a1", "visibility": None}],
                    "tool_calls": None, "thinking_block": {"text": "hmm", "signature": None},
                    "content_blocks": [{"type": "text", "text": "a1"}], "metadata": {"model": None}}
SUB_HISTORY = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}, LOOP_BASIC_REPLY]


async def test_sub_session_replay_of_the_saved_transcript_is_recognised(storage: Path, sanitize: Any) -> None:
    """A sub-session resumed by replaying its saved transcript (sanitize_message's form: None fields,
    content_blocks and thinking_block gone) is recognised and folded out once the new instruction comes."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="sub") as s:
        for m in SUB_HISTORY:
            await s.add_message(m)
    transcript = _saved(SUB_HISTORY, sanitize)
    assert transcript[1] != LOOP_BASIC_REPLY  # the normal form really differs
    async with await PersistentContextManager.open(storage_path=storage, session_id="sub",
                                                   recognise_replay=True) as s:
        for m in transcript:
            await s.add_message(m)
        await s.add_message({"role": "user", "content": "follow-up"})
        assert await s.get_messages() == [*SUB_HISTORY, {"role": "user", "content": "follow-up"}]


async def test_the_saved_transcript_is_a_filtered_transcript(storage: Path, sanitize: Any) -> None:
    """The CLI's resume hands its saved transcript (a turn behind, too) to set_messages: ignored as a filtered
    transcript, never stored over the history."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="sub") as s:
        for m in [*SUB_HISTORY, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]:
            await s.add_message(m)
    async with await PersistentContextManager.open(storage_path=storage, session_id="sub") as s:
        history = await s.get_messages()
        await s.set_messages(_saved(history, sanitize))
        await s.set_messages(_saved(history[:-2], sanitize))
        assert await s.get_messages() == history
    records = [decode(x) for x in (storage / "sub" / "events.jsonl").read_bytes().splitlines()]
    assert [r["data"]["kind"] for r in records if r["type"] == "transcript_ignored"] == ["filtered_transcript"] * 2
