"""The usage ledger of a storage: every session's ``usage_reported`` records folded into totals per session, day
or model (model/usage.py), on files or PostgreSQL. Read-only: it opens each log without its writer lock."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from ..model.usage import Prices, UsageLedger


def load_prices(prices: Any) -> Prices | None:
    """A price table from a file path (JSON, docs/tokens.md "Prices"), a parsed mapping, or None."""
    if prices is None or isinstance(prices, Prices):
        return prices
    if isinstance(prices, (str, os.PathLike)):
        path = Path(prices).expanduser()
        try:
            doc = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as e:
            raise ValueError(f"price file {path} is not JSON: {e}") from None
        return Prices.from_json(doc, f"price file {path}")
    return Prices.from_json(prices)


async def _session_ids(storage_path: Path, cfg: dict[str, Any]) -> list[str]:
    if cfg.get("backend") == "postgres":
        from ..storage.pg import list_sessions

        return [r["session_id"] for r in await list_sessions(cfg.get("dsn"), cfg.get("pg_schema"))]
    from ..storage.segments import has_log

    if not storage_path.is_dir():
        raise FileNotFoundError(f"storage folder {storage_path} does not exist")
    return sorted(d.name for d in storage_path.iterdir() if not d.name.startswith(".") and has_log(d))


async def read_usage(storage_path: str | os.PathLike[str] = ".", session_id: str | None = None, *,
                     since: str | None = None, by: str = "session", prices: Any = None,
                     **config: Any) -> dict[str, Any]:
    """The usage ledger of one session (``session_id``) or of every session of the storage folder
    ``storage_path`` (ignored on PostgreSQL).

    ``since`` (an ISO date or time, UTC) leaves out older reports; ``by`` groups the rows by ``session``,
    ``day`` or ``model``; ``prices`` (a price file's path or its parsed JSON) prices the reports that carry no
    ``cost_usd``; ``config`` selects the backend as for ``PersistentContextManager.open`` (``backend``,
    ``dsn``, ``pg_schema``). Every report is counted once (a report id seen twice, in any session, once).

    Returns ``{"by", "since", "sessions", "rows": [{<by>: ..., reports, input_tokens, output_tokens,
    cache_read_tokens, cache_write_tokens, reasoning_tokens, cost_usd, cost_reported, cost_priced,
    uncosted}], "total": {...}, "duplicates_skipped"}``; ``cost_usd`` is None where no report of the row has a
    cost. Raises ValueError for a bad ``by``, ``since`` or price table, SessionNotFoundError for a session
    that does not exist, LogCorruptedError for a damaged log.
    """
    from ..storage.backends import open_log
    from .config import check_config

    if since is not None:
        from datetime import datetime

        try:
            datetime.fromisoformat(since)
        except (TypeError, ValueError):
            raise ValueError(f"since must be an ISO date or time (e.g. 2025-01-31), got {since!r}") from None
    ledger = UsageLedger(by=by, since=since, prices=load_prices(prices))
    cfg = check_config(config)
    root = Path(storage_path).expanduser()
    ids = [session_id] if session_id is not None else await _session_ids(root, cfg)
    for sid in ids:
        log = await open_log(root, sid, cfg, readonly=True, create=False)
        try:
            async for batch in log.read_batches():
                ledger.apply_all(sid, batch)
        finally:
            await log.close()
    return {"by": by, "since": since, "sessions": len(ids), "sessions_with_usage": len(ledger.sessions),
            "rows": ledger.rows(), "total": ledger.total.as_dict(),
            "duplicates_skipped": ledger.skipped_duplicates}
