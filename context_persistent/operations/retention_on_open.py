"""Applying a retention policy when a store opens (``retention.apply_on_open``): the other sessions of the
backend first, then the store's own log (docs/operations.md, "Retention")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..storage.backends import open_log
from ..storage.eventlog import EventLog


async def apply_retention(storage_path: Path, session_id: str, cfg: dict[str, Any]) -> None:
    """``retention.apply_on_open``: apply the policy to the other sessions of the backend ``cfg`` selects before
    ``session_id`` opens (docs/operations.md, "Retention"); what moved is logged at INFO."""
    if cfg.get("backend", "file") == "postgres":
        from ..storage.pg.retention import apply_on_open as apply_pg

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


__all__ = ["apply_retention", "open_store_log"]
