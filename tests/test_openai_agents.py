"""PersistentSession: openai-agents' session protocol on the event log (context_persistent.integrations)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, SessionLockedError, StoreClosedError
from context_persistent.integrations.openai_agents import ITEM_KEY, PersistentSession, message_from_item

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "openai_agents_child.py"

#: Responses input items of every shape a run produces, and a few it might.
ITEMS: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"content": "what is 2+2? ünïcödé ✓ \u2028 \"quoted\"", "role": "user"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and this image"},
                                                    {"type": "input_image", "image_url": "data:,x", "detail": "auto"}]},
    {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "add them"}],
     "encrypted_content": "gAAAA=="},
    {"arguments": "{\"a\":2,\"b\":2}", "call_id": "call_1", "name": "add", "type": "function_call", "id": "fc_1",
     "status": "completed"},
    {"call_id": "call_1", "output": "4", "type": "function_call_output"},
    {"call_id": "call_2", "output": [{"type": "input_text", "text": "a list output"}],
     "type": "function_call_output"},
    {"id": "msg_1", "content": [{"annotations": [], "text": "4", "type": "output_text", "logprobs": []}],
     "role": "assistant", "status": "completed", "type": "message"},
    {"type": "compaction", "encrypted_content": "enc", "id": "cmp_1"},
    {"type": "item_reference", "id": "msg_0"},
    {"type": "custom_tool_call", "call_id": "c3", "name": "patch", "input": "*** Begin Patch"},
    {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
    {"role": "critic", "content": "a role the store does not know"},
    {"role": "user", "content": "holds our key", ITEM_KEY: {"not": "an envelope"}},
    {"numbers": [0, -1, 1.5, 1e300, 2 ** 63 - 1, True, None], "nested": {"z": 1, "a": {"b": []}}, "type": "x"},
]


def events(storage: Path, session_id: str) -> list[dict[str, Any]]:
    lines = (storage / session_id / "events.jsonl").read_bytes().split(b"\n")
    return [orjson.loads(line) for line in lines if line.strip(b"\0 \n")]


@pytest.fixture(autouse=True)
def _no_tracing() -> Any:
    """openai-agents' tracing would try to export to OpenAI: off for the in-process runs."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_items_round_trip_exactly_and_survive_a_reopen(storage: Path, fsync: str) -> None:
    async with PersistentSession("s", storage, fsync=fsync) as session:
        await session.add_items(ITEMS[:5])
        await session.add_items(ITEMS[5:])
        assert await session.get_items() == ITEMS
        assert [list(i) for i in await session.get_items()] == [list(i) for i in ITEMS]  # key order too
    async with PersistentSession("s", storage) as again:
        assert await again.get_items() == ITEMS
    # One message_added event per item; tool calls and outputs in the form the store's views understand.
    added = [e["data"]["message"] for e in events(storage, "s") if e["type"] == "message_added"]
    assert len(added) == len(ITEMS)
    call = added[4]
    assert call["role"] == "assistant" and call["tool_calls"][0]["id"] == "call_1"
    assert call["tool_calls"][0]["function"] == {"name": "add", "arguments": "{\"a\":2,\"b\":2}"}
    assert added[5]["role"] == "tool" and added[5]["tool_call_id"] == "call_1" and added[5]["content"] == "4"
    assert added[1] == ITEMS[1]  # a chat message is stored as it is
    assert added[13][ITEM_KEY] == ITEMS[13]  # ... unless it holds our key: then it is wrapped


@pytest.mark.postgres
async def test_on_the_postgres_backend(storage: Path, sid: str, pg_config: dict[str, Any]) -> None:
    async with PersistentSession(sid, storage, **pg_config) as session:
        await session.add_items(ITEMS[:4])
        await session.add_items(ITEMS[4:])
        assert await session.pop_item() == ITEMS[-1]
    async with PersistentSession(sid, storage, **pg_config) as again:
        assert await again.get_items() == ITEMS[:-1]
        assert await again.get_items(limit=2) == ITEMS[-3:-1]
        second = PersistentSession(sid, storage, **pg_config)  # (the same process: the same store)
        assert await second.get_items() == ITEMS[:-1]
        second.close()
        with pytest.raises(SessionLockedError):  # (any other writer, as another process would be)
            await PersistentContextManager.open(storage_path=storage, session_id=sid, **pg_config)


async def test_several_items_keep_the_reserved_tail(storage: Path) -> None:
    """With the reserved tail on, a call of several items is single-record appends: the zeros reserved ahead
    stay."""
    async with PersistentSession("rt", storage, reserve_tail=True) as session:
        await session.add_items(ITEMS[:1])
        await session.add_items(ITEMS[1:4])
        raw = (storage / "rt" / "events.jsonl").read_bytes()
        assert raw.endswith(b"\0" * 1024), "a multi-record write gave the reservation up"
        assert raw.rstrip(b"\0").count(b"\n") == 5
        assert await session.get_items() == ITEMS[:4]


async def test_several_items_are_one_append_by_default(storage: Path) -> None:
    """By default (plain appends) a call of several items is one write: the file stays plain JSONL."""
    async with PersistentSession("one", storage) as session:
        await session.add_items(ITEMS[:4])
        raw = (storage / "one" / "events.jsonl").read_bytes()
        assert b"\0" not in raw and raw.count(b"\n") == 5
        assert await session.get_items() == ITEMS[:4]


async def test_the_stores_views_see_the_conversation(storage: Path) -> None:
    async with PersistentSession("v", storage) as session:
        await session.add_items(ITEMS[1:2] + ITEMS[4:6] + ITEMS[7:8])
        conversation = await session.run(lambda store: store.get_conversation_view())
        request = await session.run(lambda store: store.get_messages_for_request(token_budget=4000))
    assert [m["role"] for m in conversation] == ["user", "assistant"]
    assert [m["role"] for m in request] == ["user", "assistant", "tool", "assistant"]


async def test_get_items_limit_follows_sqlite_session(storage: Path) -> None:
    items = [{"role": "user", "content": str(i)} for i in range(6)]
    async with PersistentSession("l", storage) as session:
        await session.add_items(items)
        assert await session.get_items() == items
        assert await session.get_items(limit=2) == items[-2:]
        assert await session.get_items(limit=10) == items
        assert await session.get_items(limit=0) == []
        assert await session.get_items(limit=-1) == items
    async with PersistentSession("l", storage, session_settings={"limit": 3}) as limited:
        assert await limited.get_items() == items[-3:]
        assert await limited.get_items(limit=1) == items[-1:]


async def test_pop_item_is_an_event_and_the_log_keeps_the_item(storage: Path) -> None:
    async with PersistentSession("p", storage) as session:
        assert await session.pop_item() is None
        await session.add_items(ITEMS[4:6])
        assert await session.pop_item() == ITEMS[5]
        assert await session.get_items() == ITEMS[4:5]
    async with PersistentSession("p", storage) as again:
        assert await again.get_items() == ITEMS[4:5]
        assert await again.pop_item() == ITEMS[4]
        assert await again.get_items() == []
    kinds = [e["type"] for e in events(storage, "p")]
    assert kinds.count("redacted") == 2 and kinds.count("message_added") == 2
    raw = (storage / "p" / "events.jsonl").read_text()
    assert "call_1" in raw and '"output":"4"' in raw


async def test_clear_session_is_an_event(storage: Path) -> None:
    async with PersistentSession("c", storage) as session:
        await session.add_items(ITEMS[:3])
        await session.clear_session()
        assert await session.get_items() == []
        await session.add_items(ITEMS[3:4])
    async with PersistentSession("c", storage) as again:
        assert await again.get_items() == ITEMS[3:4]
    assert [e["type"] for e in events(storage, "c")][-2:] == ["cleared", "message_added"]
    assert "be brief" in (storage / "c" / "events.jsonl").read_text()


@pytest.mark.parametrize("bad, error", [
    ("not a dict", r"items\[1\] must be a dict \(a Responses input item\), got str"),
    ({"role": "user", "content": object()}, r"messages\[1\] is not JSON-serialisable"),
    ({"role": "user", 1: "non-string key"}, r"messages\[1\]"),
])
async def test_bad_item_stores_nothing(storage: Path, bad: Any, error: str) -> None:
    async with PersistentSession("b", storage) as session:
        with pytest.raises(ValueError, match=error):
            await session.add_items([ITEMS[1], bad, ITEMS[2]])
        assert await session.get_items() == []
        await session.add_items([ITEMS[1]])  # still usable
        assert await session.get_items() == [ITEMS[1]]
        with pytest.raises(ValueError, match="items must be a list"):
            await session.add_items(ITEMS[1])  # type: ignore[arg-type]
    assert [e["type"] for e in events(storage, "b")] == ["session_started", "message_added"]


def test_bad_arguments_are_refused_at_construction(storage: Path) -> None:
    with pytest.raises(ValueError, match="session_id"):
        PersistentSession("../escape", storage)
    with pytest.raises(ValueError, match="unknown configuration key"):
        PersistentSession("s", storage, fsynk="always")
    with pytest.raises(ValueError, match="recognise_replay"):
        PersistentSession("s", storage, recognise_replay=True)
    assert not storage.exists()  # nothing was created


async def test_closed_session_refuses_every_call(storage: Path) -> None:
    session = PersistentSession("x", storage)
    await session.add_items(ITEMS[:1])
    session.close()
    session.close()  # idempotent
    for call in (session.get_items(), session.add_items([]), session.add_items(ITEMS[:1]), session.pop_item(),
                 session.clear_session()):
        with pytest.raises(StoreClosedError, match="'x' is closed"):
            await call
    never_opened = PersistentSession("y", storage)
    await never_opened.aclose()
    with pytest.raises(StoreClosedError):
        await never_opened.add_items([])


async def test_one_writer_per_session(storage: Path) -> None:
    """Session objects of one process share the session; any other writer (another process) is refused while
    it is open, and gets it once the last object is closed."""
    async with PersistentSession("w", storage) as first:
        await first.add_items(ITEMS[:1])
        second = PersistentSession("w", storage)
        assert await second.get_items() == ITEMS[:1]
        second.close()
        with pytest.raises(SessionLockedError):
            await PersistentContextManager.open(storage_path=storage, session_id="w")
        await first.add_items(ITEMS[1:2])  # (the second object's close left the store open for the first)
    store = await PersistentContextManager.open(storage_path=storage, session_id="w")  # released by the last close
    assert len(await store.get_messages()) == 2
    await store.close()


async def test_usable_from_other_threads_and_event_loops(storage: Path) -> None:
    session = PersistentSession("t", storage)

    def other_thread(i: int) -> None:
        asyncio.run(session.add_items([{"role": "user", "content": f"thread {i}"}]))

    threads = [threading.Thread(target=other_thread, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    await asyncio.gather(*(session.add_items([{"role": "assistant", "content": f"task {i}"}]) for i in range(4)))
    for t in threads:
        t.join()
    items = await session.get_items()
    assert sorted(i["content"] for i in items) == sorted([f"thread {i}" for i in range(4)] +
                                                         [f"task {i}" for i in range(4)])
    await session.aclose()


async def test_cancelled_call_completes_then_propagates(storage: Path) -> None:
    """Cancelled while its write runs: the write stands, then the caller sees CancelledError."""
    session = PersistentSession("k", storage)
    await session.get_items()
    started, allow = threading.Event(), threading.Event()

    async def patch(store: PersistentContextManager) -> None:
        real = store.add_messages

        async def slow(messages: list[dict[str, Any]]) -> None:
            started.set()
            while not allow.is_set():
                await asyncio.sleep(0.005)
            await real(messages)

        store.add_messages = slow  # type: ignore[method-assign]

    await session.run(patch)
    task = asyncio.create_task(session.add_items(ITEMS[:1]))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the write's outcome
    allow.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await session.get_items() == ITEMS[:1]
    await session.aclose()


def test_is_an_openai_agents_session(storage: Path) -> None:
    from agents.memory import Session

    session = PersistentSession("proto", storage, session_settings={"limit": 4})
    assert isinstance(session, Session)
    assert session.session_id == "proto" and session.session_settings is not None
    assert session.session_settings.limit == 4
    session.close()


def test_message_from_item_keeps_the_item_whole() -> None:
    for item in ITEMS:
        message = message_from_item(item)
        assert (message.get(ITEM_KEY, message)) == item


def test_importing_the_package_imports_no_framework(subprocess_env: dict[str, str]) -> None:
    code = ("import sys, context_persistent, context_persistent.integrations; "
            "print(sorted(m for m in sys.modules if m == 'agents' or m.startswith('agents.')))")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


async def test_runner_uses_the_session(storage: Path) -> None:
    from agents import Agent, Runner, function_tool
    from agents.testing import ScriptedModel, assistant_message, function_call

    @function_tool
    def lookup(n: int) -> str:
        """Look a number up."""
        return f"value {n * n}"

    model = ScriptedModel(steps=[[function_call("lookup", {"n": 3}, call_id="call-3")],
                                 [assistant_message("nine")], [assistant_message("still nine")]])
    agent = Agent(name="a", model=model, tools=[lookup])
    async with PersistentSession("r", storage) as session:
        assert (await Runner.run(agent, "square of 3?", session=session)).final_output == "nine"
        first = await session.get_items()
        assert [i.get("type") for i in first] == [None, "function_call", "function_call_output", "message"]
    async with PersistentSession("r", storage) as resumed:
        assert (await Runner.run(agent, "again?", session=resumed)).final_output == "still nine"
        assert model.calls[-1].input[:4] == first  # the new run was given the stored history
        assert len(await resumed.get_items()) == 6


def _start(storage: Path, session_id: str, first: int, last: int, hang: int | None,
           env: dict[str, str]) -> subprocess.Popen[str]:
    args = [sys.executable, str(CHILD), str(storage), session_id, str(first), str(last)]
    if hang is not None:
        args.append(str(hang))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _lines_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"the child ended before {prefix!r}: {seen[-3:]}\n{proc.stderr.read() if proc.stderr else ''}")


def test_agent_run_killed_mid_turn_resumes_with_nothing_acknowledged_lost(storage: Path,
                                                                          subprocess_env: dict[str, str]) -> None:
    env = {**subprocess_env, "OPENAI_AGENTS_DISABLE_TRACING": "1", "OPENAI_API_KEY": "sk-offline-tests"}
    proc = _start(storage, "run", 1, 6, hang=4, env=env)
    try:
        lines = _lines_until(proc, "IN_TOOL 4")  # turns 1-3 acknowledged; turn 4 is inside its tool call
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    acks = [line for line in lines if line.startswith("ACK ")]
    assert [a.split()[1] for a in acks] == ["1", "2", "3"]
    acknowledged = json.loads(acks[-1].split(" ", 2)[2])
    assert len(acknowledged) == 12  # user, function_call, function_call_output, answer per turn

    resumed = _start(storage, "run", 5, 6, hang=None, env=env)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    lines = out.splitlines()
    start = int(lines[0].split()[1])
    assert start >= len(acknowledged)
    first_input = json.loads(next(line for line in lines if line.startswith("FIRST_INPUT")).split(" ", 1)[1])
    assert first_input[:len(acknowledged)] == acknowledged  # the model saw everything acknowledged, exactly
    final = json.loads([line for line in lines if line.startswith("ACK 6")][0].split(" ", 2)[2])
    assert final[:len(acknowledged)] == acknowledged
    # What the killed turn had stored already (its user message, before the tool ran) is kept, then turns 5-6.
    assert final[len(acknowledged)] == {"content": "turn 4: look up 4", "role": "user"}
    assert [i["content"] for i in final if i.get("role") == "user"] == [f"turn {k}: look up {k}"
                                                                        for k in (1, 2, 3, 4, 5, 6)]
    assert [i.get("call_id") for i in final if i.get("type") == "function_call_output"] == [
        "call-1", "call-2", "call-3", "call-5", "call-6"]


def test_the_docs_example_runs(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    doc = (ROOT / "docs" / "integrations.md").read_text()
    section = doc.split("\n## openai-agents\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**subprocess_env, "TMPDIR": str(tmp_path), "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["It is sunny in Paris.", "You asked about Paris."]
    assert lines[2] == ("6 items: ['message', 'function_call', 'function_call_output', 'message', 'message', "
                        "'message']")
    assert lines[3].startswith("4 conversation messages, ") and lines[3].endswith(" tokens")
    assert len(list(tmp_path.rglob("user-42/events.jsonl"))) == 1


def test_the_benchmark_plug_in_runs(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """``make bench`` runs it: a tiny run produces its seven rows (no timing is asserted)."""
    out = tmp_path / "bench.json"
    env = {**subprocess_env, "CP_BENCH_SCRATCH": str(tmp_path)}
    args = [sys.executable, "-m", "benchmarks.run", "--quiet", "--rounds", "1", "--json", str(out), "--only",
            "openai_agents", "--size", "oa_add_turns=5", "--size", "oa_items=40", "--size", "oa_get_calls=1"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"].split(":")[0] for r in rows] == [
        "add_items, 1 item, p50", "add_items, 1 item, p99", "add_items, 3 items, p50",
        "a turn's adds (1 item, then 3), p50", "get_items() of 40 items",
        "get_items(limit=50) of 40", "resume 40 items (new session + get_items)"]
    assert all(r["ours"] > 0 and r["ref"] > 0 for r in rows)


async def test_close_racing_calls_never_leaves_one_hanging(storage: Path) -> None:
    """Every call made while another thread closes the session either completes or raises StoreClosedError."""
    for round_ in range(5):
        session = PersistentSession(f"race{round_}", storage)
        await session.get_items()
        outcomes: list[str] = []

        async def caller(i: int) -> None:
            try:
                await asyncio.wait_for(session.add_items([{"role": "user", "content": str(i)}]), 20)
                outcomes.append("ok")
            except StoreClosedError:
                outcomes.append("closed")

        tasks = [asyncio.create_task(caller(i)) for i in range(50)]
        await asyncio.sleep(0)
        closer = asyncio.create_task(session.aclose())
        await asyncio.gather(*tasks, closer)
        assert len(outcomes) == 50
        async with PersistentSession(f"race{round_}", storage) as again:
            assert len(await again.get_items()) == outcomes.count("ok")


async def test_close_inside_run_is_refused(storage: Path) -> None:
    session = PersistentSession("inside", storage)

    async def close_inside(store: PersistentContextManager) -> None:
        session.close()

    with pytest.raises(RuntimeError, match="inside session.run"):
        await session.run(close_inside)
    await session.aclose()
