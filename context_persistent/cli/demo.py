"""``context-persistent demo``: a scripted agent session that is killed mid-session and resumed.

No network and no LLM: the "agent" is a script. Phase 1 runs in a child process that is SIGKILLed after a
few acknowledged messages; phase 2 runs in a second child process that resumes the session, receives a
filtered transcript through ``set_messages`` (ignored: the log is authoritative), continues, builds a
compacted request view, exports a snapshot and prints the views.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SESSION = "demo-session"
KILL_AFTER = 7  # acknowledged messages before the kill

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Use tools to inspect files before answering."}


def _turns() -> list[dict[str, Any]]:
    big = "\n".join(f"{i:04d}: def handler_{i}(event): return process(event, retries={i % 5})" for i in range(400))
    return [
        SYSTEM,
        {"role": "user", "content": "Find why the payment webhook retries forever."},
        {"role": "assistant", "content": "Let me read the handler first.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "read_file", "arguments": json.dumps({"path": "webhooks/pay.py"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": big},
        {"role": "assistant", "content": "The retry loop never checks `max_retries`. Let me grep for its default.",
         "tool_calls": [{"id": "call_2", "type": "function",
                         "function": {"name": "grep", "arguments": json.dumps({"pattern": "max_retries"})}}]},
        {"role": "tool", "tool_call_id": "call_2", "name": "grep", "content": "settings.py:12: max_retries = None"},
        {"role": "assistant", "content": "Found it: `max_retries` defaults to None, so the loop is unbounded. "
                                         "Setting it to 5 fixes the endless retries."},
        # --- the process is killed around here ---
        {"role": "user", "content": "Great. Make the change and add a test — ünïcödé names welcome ✓."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Editing settings.py and adding a regression test."},
            {"type": "tool_use", "id": "toolu_1", "name": "edit_file",
             "input": {"path": "settings.py", "old": "max_retries = None", "new": "max_retries = 5"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "edited 1 line"}]},
        {"role": "assistant", "content": "Done: `max_retries = 5`, and tests/test_webhook.py covers the bound."},
    ]


async def _agent(storage: str) -> None:
    """Phase 1: write the first turns, printing ACK <n> after each durable add; never exits by itself."""
    from ..manager import PersistentContextManager

    store = await PersistentContextManager.open(storage_path=storage, session_id=SESSION)
    for n, message in enumerate(_turns()[:KILL_AFTER + 2], 1):
        await store.add_message(message)
        print(f"ACK {n} seq={store.head_seq}", flush=True)
        await asyncio.sleep(0.05)
    await asyncio.sleep(3600)  # the parent kills us before this ends


async def _resume(storage: str, acked: int) -> None:
    from ..manager import PersistentContextManager

    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION) as store:
        history = await store.get_messages()
        print(f"resumed: loaded_from_file={store.loaded_from_file}, {len(history)} messages on disk "
              f"({acked} were acknowledged before the kill)")
        transcript = [m for m in history if m["role"] not in ("system", "developer")]
        await store.set_messages(transcript)  # what the Amplifier CLI does on resume
        after = await store.get_messages()
        print(f"set_messages(filtered transcript of {len(transcript)}) ignored: history still has "
              f"{len(after)} messages, system prompt kept: {after[0]['role'] == 'system'}")
        for message in _turns()[len(history):]:
            await store.add_message(message)
        total = await store.get_token_count()
        budget = max(200, total // 3)
        request = await store.get_messages_for_request(token_budget=budget)
        saved = await store.compact(token_budget=budget)
        print(f"\nrequest view at a {budget}-token budget: {len(request)} of {len(await store.get_messages())} "
              f"messages, {total - saved} of {total} tokens (compaction is a view; the log keeps everything)")
        last = store.stats()["last_compaction"]
        if last:
            print(f"compaction ({last['strategy_used']}): {last['outputs_masked']} tool output(s) masked, "
                  f"{last['groups_dropped']} group(s) dropped, {last['truncated']} message(s) truncated")
        export = getattr(store, "export", None)
        if callable(export):
            out = Path(storage) / f"{SESSION}-snapshot.md"
            await export(out, format="markdown", view="conversation")
            print(f"exported the conversation view to {out}")
        for title, view in (("conversation view", await store.get_conversation_view()),
                            ("reasoning view", await store.get_reasoning_view()),
                            ("request view", request)):
            print(f"\n== {title} ({len(view)} messages)")
            for m in view:
                print(f"  {_line(m)}")
        print(f"\nthe log lives at {store.path}")
        print(f"stats: {json.dumps({k: v for k, v in store.stats().items() if k != 'path'})}")


def _line(m: dict[str, Any], width: int = 110) -> str:
    content = m.get("content")
    if isinstance(content, list):
        content = " | ".join(
            b.get("text") or (f"tool_use {b.get('name')}" if b.get("type") == "tool_use" else f"[{b.get('type')}]")
            for b in content if isinstance(b, dict))
    text = str(content if content is not None else "")
    if m.get("tool_calls"):
        text += "  → " + ", ".join(c["function"]["name"] for c in m["tool_calls"])
    text = text.replace("\n", " ⏎ ")
    return f"{m['role']:>9}: {text[:width]}{'…' if len(text) > width else ''}"


def run_demo(args: argparse.Namespace) -> int:
    if args.phase == "agent":
        asyncio.run(_agent(args.storage))
        return 0
    if args.phase == "resume":
        asyncio.run(_resume(args.storage, args.acked))
        return 0
    storage = args.storage or tempfile.mkdtemp(prefix="context-persistent-demo-")
    os.makedirs(storage, mode=0o700, exist_ok=True)
    me = [sys.executable, "-m", "context_persistent", "demo", "--storage", storage]
    print(f"storage: {storage}\n\n== phase 1: an agent writes its session; we SIGKILL it mid-session")
    child = subprocess.Popen(me + ["--phase", "agent"], stdout=subprocess.PIPE, text=True)
    acked = 0
    assert child.stdout is not None
    for line in child.stdout:
        print(f"  child: {line.rstrip()}")
        if line.startswith("ACK"):
            acked += 1
            if acked == KILL_AFTER:
                child.send_signal(signal.SIGKILL)
                break
    child.wait()
    print(f"  killed child pid {child.pid} (exit {child.returncode}) after {acked} acknowledged messages")
    print("\n== phase 2: a new process resumes the session")
    return subprocess.call(me + ["--phase", "resume", "--acked", str(acked)])


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo", parents=[common], help="run the crash-and-resume demo (no network, no LLM)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  context-persistent demo\n  context-persistent demo --storage /tmp/demo-store\n",
    )
    p.add_argument("--phase", choices=("agent", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--acked", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=run_demo)
