"""A writer process for tests/test_search_processes.py: appends messages with unique words to a session,
printing each word once its append returned (acknowledged), until killed or done."""

from __future__ import annotations

import asyncio
import sys

from context_persistent import PersistentContextManager


async def main(storage: str, sid: str, n: int) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid) as store:
        for i in range(n):
            word = f"{sid}w{i}x"
            await store.add_message({"role": "user" if i % 2 else "assistant", "content": f"note {word} " + "y " * 50})
            if i % 7 == 6:
                await store.replace_messages((await store.get_messages())[-3:])
            print(word, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
