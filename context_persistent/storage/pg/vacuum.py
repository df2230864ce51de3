"""VACUUM after an erasure (operations/erasure.py): an UPDATE leaves the row's old version, which still holds
the erased message, in the table's pages until VACUUM removes it (docs/operations.md, "Erasure")."""

from __future__ import annotations

from typing import Any

from ...errors import DatabaseError
from .connection import require_asyncpg

#: The tables an erasure changes: the records (updated to tombstones) and the checkpoints (row deleted).
TABLES = ("events", "checkpoints")


async def vacuum_tables(log: Any, full: bool) -> dict[str, Any]:
    """Run ``VACUUM`` (``full``: ``VACUUM FULL``) on the tables an erasure changed, on the writer's connection
    (outside any transaction, as VACUUM requires). Returns what was run, for the receipt. VACUUM FULL rewrites
    each table into a new file and holds an exclusive lock on it meanwhile: every session's appends wait."""
    apg = require_asyncpg()
    tables = [log._q("{s}." + t) for t in TABLES]
    command = "VACUUM (FULL)" if full else "VACUUM"
    async with log._io:
        conn = await log._live_conn()
        try:
            await conn.execute(f"{command} {', '.join(tables)}", timeout=None)
        except apg.PostgresError as e:
            raise DatabaseError(f"{log.path}: the message was erased, but the server refused {command} "
                                f"({type(e).__name__}: {e}); run it as a role that owns the tables",
                                stored=True) from e
    return {"command": command, "tables": tables}
