"""The peers we compare against: the reference Amplifier module's read path, and SQLite set up durably.

``ReferenceReRead`` re-implements what microsoft/amplifier-module-context-persistent does on every
``get_messages_for_request`` (HEAD 72678db, see docs/performance.md): read the whole
``context-messages.jsonl`` line by line, ``strip`` and ``json.loads`` each line with the stdlib, then
estimate tokens as ``sum(len(str(m)) // 4)``. Its ephemeral compaction (which runs only over the
threshold) is left out, so this baseline is never slower than the real module: our ratios against it
are conservative.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


class ReferenceReRead:
    """The reference module's append and request path (no fsync, one ``open`` per append, re-read per request)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add_message(self, message: dict[str, Any]) -> None:
        if "timestamp" not in message:
            message = {**message, "timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(message, ensure_ascii=False) + "\n")

    def read_all(self) -> list[dict[str, Any]]:
        messages = []
        with self.path.open("r", encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        messages.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
        return messages

    def get_messages_for_request(self, budget: int = 200_000) -> list[dict[str, Any]]:
        messages = self.read_all()
        tokens = sum(len(str(m)) // 4 for m in messages)
        if budget > 0 and tokens / budget >= 0.92:
            pass  # the reference compacts here; left out (see the module docstring)
        return messages


def durable_sqlite_session_class() -> Any:
    """openai-agents ``SQLiteSession`` with ``PRAGMA synchronous=FULL`` set explicitly on every connection.

    ``SQLiteSession`` enables WAL itself and leaves ``synchronous`` at SQLite's compiled default; setting
    FULL explicitly makes the comparison durable whatever the build's default is.
    """
    from agents.memory import SQLiteSession

    class DurableSQLiteSession(SQLiteSession):
        @staticmethod
        def _configure_connection(conn: sqlite3.Connection) -> None:
            SQLiteSession._configure_connection(conn)
            conn.execute("PRAGMA synchronous=FULL")

    return DurableSQLiteSession


def sqlite_session_pragmas(db_path: Path) -> dict[str, Any]:
    """journal_mode and synchronous of a stock and of our durable SQLiteSession connection (for the docs)."""
    from agents.memory import SQLiteSession

    out = {}
    for label, cls in (("stock", SQLiteSession), ("durable", durable_sqlite_session_class())):
        s = cls(f"probe-{label}", db_path=db_path)
        conn = s._get_connection()
        out[label] = {"journal_mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
                      "synchronous": conn.execute("PRAGMA synchronous").fetchone()[0]}
        s.close()
    return out


def sqlite_wal(path: Path, synchronous: str = "FULL") -> sqlite3.Connection:
    """stdlib sqlite3 in WAL mode with one ``messages`` table (autocommit off: we commit explicitly)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("CREATE TABLE IF NOT EXISTS messages (id INTEGER PRIMARY KEY, session TEXT, data TEXT)")
    return conn
