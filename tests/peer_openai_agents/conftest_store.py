"""Injected as ``tests/memory/conftest.py`` of the test-time copy: the one change to their suite.

Every test module's ``SQLiteSession`` is replaced by a subclass of our ``PersistentSession`` that takes
the same arguments (``CP_PEER_STORE=sqlite`` leaves the stock class in place). A file ``db_path`` becomes
the storage folder ``<db_path>.cp`` (so sessions sharing a database share a folder); ``:memory:`` becomes a
fresh folder under ``$CP_PEER_TMP``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

OURS = os.environ.get("CP_PEER_STORE", "ours") == "ours"


if OURS:
    from context_persistent.integrations.openai_agents import PersistentSession

    class PersistentSQLiteSession(PersistentSession):
        """``SQLiteSession``'s constructor, our session (a class, so their tests can subclass it)."""

        def __init__(self, session_id: str, db_path: str | Path = ":memory:",
                     sessions_table: str = "agent_sessions", messages_table: str = "agent_messages",
                     session_settings: Any = None) -> None:
            if str(db_path) == ":memory:":
                folder = Path(tempfile.mkdtemp(prefix="memory-", dir=os.environ["CP_PEER_TMP"]))
            else:
                folder = Path(f"{db_path}.cp")
            if (sessions_table, messages_table) != ("agent_sessions", "agent_messages"):
                folder = folder / f"{sessions_table}.{messages_table}"
            super().__init__(session_id, folder, session_settings=session_settings)


@pytest.fixture(autouse=True)
def _store_under_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if OURS and hasattr(request.module, "SQLiteSession"):
        monkeypatch.setattr(request.module, "SQLiteSession", PersistentSQLiteSession)
