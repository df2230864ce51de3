"""Helper process for the usage crash test (run as a script, never imported by pytest).

``python tests/usage_child.py STORAGE SESSION START``: opens the session and runs turns from number START on,
forever: a user message, a request view, the provider's usage recorded with id ``r<i>``, the assistant's reply.
Prints ``ACK <i>`` once turn i's reply returned (its usage record rode with that write: it is durable).
"""

from __future__ import annotations

import asyncio
import os
import sys

from context_persistent import PersistentContextManager


async def main(storage: str, session: str, start: int) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=session)
    os.write(1, f"OPEN {store.head_seq}\n".encode())
    i = start
    while True:
        await store.add_message({"role": "user", "content": f"question {i} " + "y" * (i % 50)})
        await store.get_messages_for_request(token_budget=50_000)
        await store.record_usage({"input_tokens": 1000 + i, "output_tokens": 10, "cost_usd": 0.5},
                                 provider="anthropic", model="claude-test", id=f"r{i}")
        await store.add_message({"role": "assistant", "content": f"answer {i}"})
        os.write(1, f"ACK {i}\n".encode())
        i += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
