"""Restarts in fresh processes: what one process wrote, another reads back exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from context_persistent import PersistentContextManager
WRITER = textwrap.dedent("""
    import asyncio, json, sys
    from context_persistent import PersistentContextManager
    async def main(storage, mode):
        async with await PersistentContextManager.open(storage_path=storage, session_id="r", fsync=mode) as s:
            for m in json.loads(sys.stdin.read()):
                if m == "CLEAR":
                    await s.clear()
                else:
                    await s.add_message(m)
            print(json.dumps(await s.get_messages()))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")

MESSAGES = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "first"},
    "CLEAR",
    {"role": "user", "content": [{"type": "text", "text": "ünï ✓"}], "metadata": {"turn": 1}},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "r"},
]


def _write(storage: Path, env: dict, mode: str, messages: list) -> list:
    out = subprocess.run([sys.executable, "-c", WRITER, str(storage), mode], input=json.dumps(messages),
                         capture_output=True, text=True, env=env, timeout=60, check=True)
    return json.loads(out.stdout)


async def test_write_exit_reopen_compare(storage: Path, subprocess_env: dict) -> None:
    """Each durability mode: a child writes and exits; the parent and a second child see the same history."""
    for mode in ("always", "batch", "never"):
        sid_storage = storage / mode
        seen_by_writer = _write(sid_storage, subprocess_env, mode, MESSAGES)
        assert seen_by_writer == MESSAGES[3:]
        async with await PersistentContextManager.open(storage_path=sid_storage, session_id="r") as s:
            assert await s.get_messages() == seen_by_writer
            assert s.loaded_from_file
        # a second child appends to what the first wrote
        again = _write(sid_storage, subprocess_env, mode, [{"role": "user", "content": "more"}])
        assert again == [*seen_by_writer, {"role": "user", "content": "more"}]
