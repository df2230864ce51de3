"""``context-persistent demo``: a scripted agent session that is killed mid-session and resumed.

No network and no LLM: the "agent" is a script. Phase 1 runs in a child process that is SIGKILLed after a
few acknowledged messages; phase 2 runs in a second child process that resumes the session, receives a
filtered transcript through ``set_messages`` (ignored: the log is authoritative), continues, builds a
compacted request view, exports a snapshot and prints the views.

Where it writes: without --storage, into a new temporary folder that is deleted when the demo ends (nothing
is left behind); with --storage PATH, the session "demo-session" and its snapshot are written into PATH
(created if needed) and kept, so the commands it suggests can inspect them. A PATH that already holds the
demo session of an earlier run is refused (two runs never mix in one session) unless --fresh is given, which
deletes that session first. The demo never uses $CONTEXT_PERSISTENT_DIR or the default storage folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import UsageError

SESSION = "demo-session"
SNAPSHOT = f"{SESSION}-snapshot.md"
KILL_AFTER = 7  # acknowledged messages before the kill

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Use tools to inspect files before answering."}


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call in the OpenAI chat form (the one form this demo uses)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _turns() -> list[dict[str, Any]]:
    big = "\n".join(f"{i:04d}: def handler_{i}(event): return process(event, retries={i % 5})" for i in range(400))
    return [
        SYSTEM,
        {"role": "user", "content": "Find why the payment webhook retries forever."},
        {"role": "assistant", "content": "Let me read the handler first.",
         "tool_calls": [_call("call_1", "read_file", {"path": "webhooks/pay.py"})]},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": big},
        {"role": "assistant", "content": "The retry loop never checks `max_retries`. Let me grep for its default.",
         "tool_calls": [_call("call_2", "grep", {"pattern": "max_retries"})]},
        {"role": "tool", "tool_call_id": "call_2", "name": "grep", "content": "settings.py:12: max_retries = None"},
        {"role": "assistant", "content": "Found it: `max_retries` defaults to None, so the loop is unbounded. "
                                         "Setting it to 5 fixes the endless retries."},
        # --- the process is killed around here ---
        {"role": "user", "content": "Great. Make the change and add a test — ünïcödé names welcome ✓."},
        {"role": "assistant", "content": "Editing settings.py and adding a regression test.",
         "tool_calls": [_call("call_3", "edit_file",
                              {"path": "settings.py", "old": "max_retries = None", "new": "max_retries = 5"})]},
        {"role": "tool", "tool_call_id": "call_3", "name": "edit_file", "content": "edited 1 line"},
        {"role": "assistant", "content": "Done: `max_retries = 5`, and tests/test_webhook.py covers the bound."},
    ]


async def _agent(storage: str) -> None:
    """Phase 1: write the first turns, printing ACK <n> after each durable add; never exits by itself."""
    from ..store.manager import PersistentContextManager

    store = await PersistentContextManager.open(storage_path=storage, session_id=SESSION)
    for n, message in enumerate(_turns()[:KILL_AFTER + 2], 1):
        await store.add_message(message)
        print(f"ACK {n} seq={store.head_seq}", flush=True)
        await asyncio.sleep(0.05)
    await asyncio.sleep(3600)  # the parent kills us before this ends


async def _resume(storage: str, acked: int) -> None:
    from ..store.manager import PersistentContextManager

    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION) as store:
        history = await store.get_messages()
        print(f"  the log holds {len(history)} messages; {acked} were acknowledged before the kill: "
              f"{'none lost' if len(history) >= acked else 'LOST SOME'}")
        transcript = [m for m in history if m["role"] not in ("system", "developer")]
        await store.set_messages(transcript)  # what the Amplifier CLI does on resume
        after = await store.get_messages()
        print(f"  the host then passed a filtered transcript ({len(transcript)} messages, no system prompt) to "
              f"set_messages: ignored, the history still has {len(after)} messages"
              f"{' and its system prompt' if after[0]['role'] == 'system' else ''}")
        rest = _turns()[len(history):]
        for message in rest:
            await store.add_message(message)
        print(f"  the agent went on: {len(rest)} more messages")

        total = await store.get_token_count()
        budget = max(200, total // 3)
        request = await store.get_messages_for_request(token_budget=budget)
        saved = await store.compact(token_budget=budget)
        n_all = len(await store.get_messages())
        print(f"\n== 3. the request view under a {budget:,}-token budget (compaction is a view: the log keeps "
              "everything)")
        print(f"  {len(request)} of {n_all} messages, {total - saved:,} of {total:,} tokens")
        last = store.stats()["last_compaction"]
        if last:
            print(f"  strategy {last['strategy_used']}: {last['outputs_masked']} tool output(s) masked, "
                  f"{last['groups_dropped']} tool group(s) dropped, {last['truncated']} message(s) truncated")
        for title, view in (("conversation view", await store.get_conversation_view()),
                            ("reasoning view", await store.get_reasoning_view()),
                            ("request view", request)):
            print(f"\n  -- {title} ({len(view)} messages)")
            for m in view:
                print(f"  {_line(m)}")

        out = Path(storage) / SNAPSHOT
        await store.export(out, format="markdown", view="conversation")
        st = store.stats()
        log = Path(store.path)
    lines = log.read_bytes().splitlines()  # closed: what any JSONL tool sees
    print("\n== 4. what is on disk")
    print(f"  the log:      {log} ({log.stat().st_size:,} bytes, {len(lines)} events, one JSON object a line)")
    print(f"  a snapshot:   {out} (the conversation view as Markdown)")
    print(f"  the session:  {st['messages']} messages, {st['tokens']:,} tokens ({st['tokenizer']})")


def _line(m: dict[str, Any], width: int = 100) -> str:
    content = m.get("content")
    text = str(content if content is not None else "")
    if m.get("tool_calls"):
        text += "  → " + ", ".join(c["function"]["name"] for c in m["tool_calls"])
    text = text.replace("\n", " ⏎ ")
    return f"{m['role']:>9}: {text[:width]}{'…' if len(text) > width else ''}"


def _prepare(storage: str, fresh: bool) -> None:
    """Refuse (or with ``fresh`` delete) an earlier run's demo session in ``storage``."""
    folder, snapshot = Path(storage) / SESSION, Path(storage) / SNAPSHOT
    if Path(storage).exists() and not Path(storage).is_dir():
        raise UsageError(f"--storage {storage} is not a folder")
    if not folder.exists() and not snapshot.exists():
        return
    if not fresh:
        raise UsageError(f"{folder} already holds the demo session of an earlier run; a second run would mix "
                         f"with it. Add --fresh to delete it first, or pass another --storage")
    shutil.rmtree(folder, ignore_errors=False) if folder.exists() else None
    snapshot.unlink(missing_ok=True)


def _prog() -> str:
    """How to run this command again from here: ``context-persistent`` if that is what runs, else a path."""
    script = Path(sys.argv[0])
    if script.name == "context-persistent":
        found = shutil.which("context-persistent")
        if found and Path(found).resolve() == script.resolve():
            return "context-persistent"
        try:
            return str(script.resolve().relative_to(Path.cwd()))
        except ValueError:
            return str(script.resolve())
    return f"{sys.executable} -m context_persistent"


def _next_steps(storage: str | None) -> str:
    prog = _prog()
    if storage is None:
        where = "./demo-store"
        lines = ["next: keep the session to explore it", f"  {prog} demo --storage {where}"]
    else:
        where = storage
        lines = ["next: explore the session"]
    lines += [f"  {prog} show {SESSION} --storage {where} --view reasoning",
              f"  {prog} show {SESSION} --storage {where} --view request --budget 2000",
              f"  {prog} stats {SESSION} --storage {where}",
              f"  {prog} verify {SESSION} --storage {where}",
              f"  {prog} tail {SESSION} --storage {where}"]
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    if args.phase == "agent":
        asyncio.run(_agent(args.storage))
        return 0
    if args.phase == "resume":
        asyncio.run(_resume(args.storage, args.acked))
        return 0
    if getattr(args, "dsn", None):
        raise UsageError("the demo runs on the file backend only; drop --dsn")
    kept = os.path.abspath(os.path.expanduser(args.storage)) if args.storage else None
    if kept is not None:
        _prepare(kept, args.fresh)
    storage = kept or tempfile.mkdtemp(prefix="context-persistent-demo-")
    try:
        os.makedirs(storage, mode=0o700, exist_ok=True)
        print("context-persistent demo: a scripted agent (no network, no LLM) is killed mid-session and resumed")
        print(f"storage: {storage}" + ("" if kept else " (a temporary folder, deleted at the end)"))
        status = _run_phases(storage)
    finally:
        if kept is None:
            shutil.rmtree(storage, ignore_errors=True)
    if status != 0:
        return status
    print("\nthe temporary folder was deleted." if kept is None else "")
    print(_next_steps(kept))
    return 0


def _run_phases(storage: str) -> int:
    me = [sys.executable, "-m", "context_persistent", "demo", "--storage", storage]
    print(f"\n== 1. an agent process writes its session; it is killed (SIGKILL) after {KILL_AFTER} "
          "acknowledged messages")
    child = subprocess.Popen(me + ["--phase", "agent"], stdout=subprocess.PIPE, text=True)
    acked = 0
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("ACK"):
            acked += 1
            n, seq = line.split()[1], line.split()[2].removeprefix("seq=")
            print(f"  agent: message {n} is on disk (event seq {seq})")
            if acked == KILL_AFTER:
                child.send_signal(signal.SIGKILL)  # (only this child, by its pid)
                break
    child.stdout.close()
    child.wait()
    print(f"  killed the agent (pid {child.pid}, exit {child.returncode}) after {acked} acknowledged messages")
    print("\n== 2. a new process opens the same session")
    sys.stdout.flush()
    return subprocess.call(me + ["--phase", "resume", "--acked", str(acked)])


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo", parents=[common], help="run the crash-and-resume demo (no network, no LLM)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  context-persistent demo                            in a temporary folder, deleted at the end\n"
               "  context-persistent demo --storage ./demo-store     keep the session to explore it\n"
               "  context-persistent demo --storage ./demo-store --fresh   run again, replacing that session\n",
    )
    p.add_argument("--fresh", action="store_true",
                   help="delete the demo session an earlier run left in --storage before starting")
    p.add_argument("--phase", choices=("agent", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--acked", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=run_demo)
