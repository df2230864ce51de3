"""Stands in for openai-agents' ``tests/utils/simple_session.py`` (not in the archive): the session its
compaction tests wrap. Copied to ``tests/utils/simple_session.py`` of the test-time copy.

With ``CP_PEER_STORE=ours`` (the default) it is our ``PersistentSession`` in a fresh folder under
``$CP_PEER_TMP``, seeded with ``history``; with ``CP_PEER_STORE=sqlite`` an in-memory list, for checking
the suite itself against the stock package.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from typing import Any

from agents.memory import SessionSettings

if os.environ.get("CP_PEER_STORE", "ours") == "ours":
    from context_persistent.integrations.openai_agents import PersistentSession

    class SimpleListSession(PersistentSession):
        def __init__(self, session_id: str = "test", history: list[Any] | None = None,
                     session_settings: SessionSettings | None = None) -> None:
            folder = tempfile.mkdtemp(prefix="simple-", dir=os.environ["CP_PEER_TMP"])
            super().__init__(session_id, folder, session_settings=session_settings)
            if history:
                # Seeded from a thread with its own loop: the constructor may run inside a running loop.
                errors: list[BaseException] = []

                def seed() -> None:
                    try:
                        asyncio.run(PersistentSession.add_items(self, list(history)))
                    except BaseException as e:  # pragma: no cover - surfaced below
                        errors.append(e)

                t = threading.Thread(target=seed)
                t.start()
                t.join()
                if errors:
                    raise errors[0]
else:
    class SimpleListSession:  # type: ignore[no-redef]
        def __init__(self, session_id: str = "test", history: list[Any] | None = None,
                     session_settings: SessionSettings | None = None) -> None:
            self.session_id = session_id
            self.session_settings = session_settings or SessionSettings()
            self._items = list(history) if history else []

        async def get_items(self, limit: int | None = None) -> list[Any]:
            if limit is None:
                limit = self.session_settings.limit
            if limit is None or limit < 0:
                return list(self._items)
            return self._items[-limit:] if limit else []

        async def add_items(self, items: list[Any]) -> None:
            self._items.extend(items)

        async def pop_item(self) -> Any:
            return self._items.pop() if self._items else None

        async def clear_session(self) -> None:
            self._items.clear()
