"""Choosing a session's event log by the configured backend: the file log, or PostgreSQL (docs/postgres.md).

Imported by the manager (which re-exports ``open_log`` and ``BACKENDS``) and by ``snapshot``, which needs a log
but not the manager.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .eventlog import EventLog
from .log import FileEventLog
from .paths import session_dir


#: Storage backends (docs/postgres.md): ``dsn`` falls back to $CONTEXT_PERSISTENT_DSN, ``pg_schema`` to
#: $CONTEXT_PERSISTENT_PG_SCHEMA, then ``context_persistent``.
BACKENDS = ("file", "postgres")


async def open_log(storage_path: str | os.PathLike[str], session_id: str, cfg: dict[str, Any], *,
                   readonly: bool = False, create: bool = True) -> EventLog:
    """The event log of ``cfg["backend"]`` for a session (the one place the backend is chosen)."""
    if cfg.get("backend", "file") == "postgres":
        from .pg import PostgresEventLog

        return await PostgresEventLog.open(cfg.get("dsn"), session_id, schema=cfg.get("pg_schema"),
                                           readonly=readonly, create=create)
    folder = session_dir(storage_path, session_id)
    if not folder.exists():  # a new session, or one a retention policy moved to the trash (SessionTrashedError)
        from .trash_folder import check_not_trashed

        check_not_trashed(Path(storage_path), session_id)
    return FileEventLog(folder, session_id, readonly=readonly,
                        fsync=cfg.get("fsync", "always"), create=create,
                        reserve_tail=cfg.get("reserve_tail", False), segment_bytes=cfg.get("segment_bytes"),
                        compress_sealed=cfg.get("compress_sealed", False))


def pager_for(log: EventLog, cache_bytes: int) -> Any:
    """Where a session's history reads its messages back (docs/architecture.md, "Bounded memory"): a file
    log's records by byte position (pages.MessageReader), a PostgreSQL log's by seq
    (pg/pages.PostgresMessageReader); None for any other log (the history then holds the messages)."""
    if isinstance(log, FileEventLog):
        from .pages import MessageReader

        return MessageReader(log.directory, cache_bytes, log.reader if log.readonly else None)
    if type(log).__name__ == "PostgresEventLog":  # (importing pg here would load it for file stores too)
        from .pg.pages import PostgresMessageReader

        return PostgresMessageReader(log, cache_bytes)  # type: ignore[arg-type]
    return None


__all__ = ["BACKENDS", "open_log", "pager_for"]
