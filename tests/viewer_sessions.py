"""Sessions for the viewer's tests and screenshots: a coding agent's session with tool calls and results, a
pin, a redaction, a compaction, hostile content (script tags, a ``javascript:`` link, control characters, a
huge line), and a fork of it. ``python -m tests.viewer_sessions DIR`` writes them into DIR."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager

HOSTILE = ('<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
           '[click me](javascript:window.__pwned=3) \x1b[31mred\x1b[0m \x00\x07 \u202egnp.exe')
SECRET = "the launch code is 0000-REDACT-ME"
HUGE = "x" * 300_000


def _call(i: int, name: str, args: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"Step {i}: let me run {name}.",
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}]}


def _result(i: int, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": text}


async def build(storage: Path, *, steps: int = 12) -> dict[str, Any]:
    """Write the session ``agent`` and its fork ``agent-try2`` into ``storage``; return facts the tests use."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="agent") as store:
        await store.add_message({"role": "system", "content": "You are a careful coding agent. Use tools before answering."})
        await store.add_message({"role": "user", "content": "The checkout test fails on accented names. Please fix it."})
        for i in range(1, steps + 1):
            await store.add_message(_call(i, "read_file", f'{{"path": "shop/module_{i}.py"}}'))
            body = "\n".join(f"{n:4d}  def rule_{n}(tokens): return tokens[{n}:]  # {i}" for n in range(60))
            await store.add_message(_result(i, body))
            if i % 4 == 0:  # a request, and what the provider said it held (a little more than the estimate)
                await store.get_messages_for_request()
                estimate = await store.get_token_count()
                await store.record_usage({"input_tokens": estimate + 40 * i, "output_tokens": 50 + i},
                                         provider="anthropic", model="claude-sonnet-4-5", id=f"msg_{i}")
        await store.add_message({"role": "assistant", "content": "Decision: render() must keep UTF-8; I will drop the encode."})
        pin_seq = store.head_seq  # (a usage report waiting to be written goes out with this append, before it)
        await store.pin(seq=pin_seq)
        await store.add_message({"role": "user", "content": HOSTILE})
        await store.add_message({"role": "user", "content": SECRET})
        await store.redact(seq=store.head_seq)
        await store.add_message({"role": "tool", "tool_call_id": "call_big", "content": HUGE})
        await store.add_message({"role": "user", "content": "Thanks! Now add a regression test."})
        await store.add_message({"role": "assistant", "content": "Added test_receipt_keeps_accents; it passes."})
        await store.get_messages_for_request(token_budget=1500)  # compacts: the audit record goes out at close
        fork_at = pin_seq
    async with await PersistentContextManager.open(storage_path=storage, session_id="agent", readonly=True) as store:
        head = store.head_seq
        await store.fork("agent-try2", at_seq=fork_at)
    async with await PersistentContextManager.open(storage_path=storage, session_id="agent-try2") as fork:
        await fork.add_message({"role": "assistant", "content": "Trying a different fix: normalise names with NFC."})
    return {"head_seq": head, "pin_seq": pin_seq, "fork_at": fork_at}


if __name__ == "__main__":
    print(asyncio.run(build(Path(sys.argv[1]))))
