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
        from .trash import check_not_trashed

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


async def apply_retention(storage_path: Path, session_id: str, cfg: dict[str, Any]) -> None:
    """``retention.apply_on_open``: apply the policy to the other sessions of the backend ``cfg`` selects before
    ``session_id`` opens (docs/operations.md, "Retention"); what moved is logged at INFO."""
    import logging

    if cfg.get("backend", "file") == "postgres":
        from .pg.retention import apply_on_open as apply_pg

        report = await apply_pg(cfg.get("dsn"), cfg.get("pg_schema"), cfg["retention"], session_id)
    else:
        from .trash import apply_on_open

        report = await apply_on_open(storage_path, cfg["retention"], session_id)
    logger = logging.getLogger("context_persistent")
    if report is None:
        logger.info("retention on open skipped: another process is applying retention to %s", storage_path)
    elif report["trashed"]:
        logger.info("retention on open moved %d session(s) to the trash: %s", len(report["trashed"]),
                    ", ".join(f"{t['session_id']} ({t['rule']})" for t in report["trashed"]))


async def open_store_log(storage_path: Path, session_id: str, cfg: dict[str, Any], *,
                         readonly: bool = False) -> EventLog:
    """The log a store opens: with ``retention.apply_on_open`` (and a writer), the policy is applied to the
    other sessions first (:func:`apply_retention`); then :func:`open_log`."""
    policy = cfg.get("retention")
    if policy is not None and policy.apply_on_open and not readonly:
        await apply_retention(storage_path, session_id, cfg)
    return await open_log(storage_path, session_id, cfg, readonly=readonly)


__all__ = ["BACKENDS", "apply_retention", "open_log", "open_store_log", "pager_for"]
