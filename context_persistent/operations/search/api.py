"""``search`` and ``list_sessions`` over a storage's index, caught up first; every hit checked against the log.

A hit is returned only after the log was read at the record the index names and found to hold the same message
(its fingerprint): an index that disagrees with its log (a damaged file, a log changed behind its back) is
caught there, the session indexed again and the query run again, so a hit never shows what the log no longer
holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ...model import codec
from ...model.events import ROLES
from ...model.projection import split_key
from .fold import slots
from .indexer import Outcome, catch_up_session, catch_up_storage
from .opening import with_index
from .text import MARK_CLOSE, MARK_OPEN, QueryError, fingerprint, translate, unsegment

logger = logging.getLogger("context_persistent")
DEFAULT_LIMIT = 20
MAX_LIMIT = 10_000
#: Matches ranked by default: the newest this many (docs/search.md, "Ranking"); ``exhaustive`` ranks all.
RANK_WINDOW = 10_000
MAX_WINDOW = 1 << 40
_RELATIVE = re.compile(r"^(\d+)([dhm])$")
#: OperationalErrors of the database, not of the query (any other one is FTS5 refusing the query).
_STORAGE_ERROR = re.compile(r"locked|busy|disk|I/O|unable to open|no such table|malformed|readonly")


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One message that matched: where it is (session, seq and, for a list record, index), its role and time,
    a snippet with the match marked, the rank (lower is better: FTS5's bm25) and whether the views show it."""

    session_id: str
    seq: int
    index: int
    role: str
    ts: str
    snippet: str
    score: float
    in_view: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_since(since: str | datetime | None) -> str | None:
    """An ISO timestamp for ``since``: a datetime, an ISO date or date-time, or ``N`` + ``d``/``h``/``m`` ago."""
    if since is None:
        return None
    if isinstance(since, datetime):
        dt = since
    else:
        m = _RELATIVE.match(str(since).strip())
        if m:
            n, unit = int(m.group(1)), m.group(2)
            dt = datetime.now(timezone.utc) - timedelta(**{{"d": "days", "h": "hours", "m": "minutes"}[unit]: n})
        else:
            try:
                dt = datetime.fromisoformat(str(since).strip().replace("Z", "+00:00"))
            except ValueError:
                raise ValueError(f"since must be a date (2025-01-31), a date and time (2025-01-31T09:30) or an age "
                                 f"(7d, 12h, 30m), got {since!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


class SearchResults(list[SearchHit]):
    """The hits of a search, best first (a list), and ``ranking``: how they were ranked. ``window``: the newest
    this many matches were ranked (None: every match, ``exhaustive``); ``ranked``: how many matches were
    ranked (None when every one was, uncounted); ``all_ranked``: no match was left unranked (False: older
    matches exist that ``exhaustive=True`` would also rank)."""

    def __init__(self, hits: list[SearchHit], ranking: dict[str, Any]) -> None:
        super().__init__(hits)
        self.ranking = ranking


def _check(role: str | None, limit: int, window: int) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not limit <= window <= MAX_WINDOW:
        raise ValueError(f"window must be an integer from the limit ({limit}) to {MAX_WINDOW}, got {window!r}")


async def search(storage: str | os.PathLike[str] | None, query: str, *, session_id: str | None = None,
                 role: str | None = None, since: str | datetime | None = None, limit: int = DEFAULT_LIMIT,
                 all_messages: bool = False, catch_up: bool = True, dsn: str | None = None,
                 pg_schema: str | None = None, index_path: str | os.PathLike[str] | None = None,
                 read_only: bool = False, window: int = RANK_WINDOW, exhaustive: bool = False) -> SearchResults:
    """Full-text search over every session of a file storage, or with ``dsn`` of a PostgreSQL schema
    (``pg_schema``; ``storage`` is then not used). docs/search.md has the query language.

    ``all_messages``: also messages the views no longer show (before a ``clear``, replaced) that the log still
    holds. ``index_path``: a private index file of a file storage to use (and catch up) instead of the storage's
    own, so that nothing is written to the storage (the viewer's). ``read_only``: write no index at all (no
    catch-up; a hit its log disagrees with is left out rather than indexed again). QueryError (a ValueError) for
    a query that is not valid; ValueError for a bad filter.

    Ranking (docs/search.md, "Ranking"): the newest ``window`` matching messages (10,000 by default) are ranked
    and the best ``limit`` of them returned; ``exhaustive=True`` ranks every match (slower when a word is in a
    large part of the storage). The result is a list of ``SearchHit`` with ``.ranking`` saying which was done
    (``SearchResults``).
    """
    compiled: Any
    if dsn is not None:
        from .pg_text import compile_query

        compiled = compile_query(query)
    else:
        compiled = translate(query)
    _check(role, limit, window)
    since_iso = parse_since(since)

    async def work(index: Any) -> SearchResults:
        if catch_up and not read_only:
            if session_id is not None:
                await catch_up_session(index, session_id)
            else:
                await catch_up_storage(index)
        for attempt in range(3):
            try:
                rows, ranking = await index.search(compiled, session_id=session_id, role=role, since=since_iso,
                                                   all_messages=all_messages, limit=limit,
                                                   window=None if exhaustive else window)
            except Exception as e:
                if type(e).__name__ == "OperationalError" and not _STORAGE_ERROR.search(str(e)):
                    raise QueryError(f"bad query {query!r}: {str(e).removeprefix('fts5: ')} "
                                     "(docs/search.md, 'Query language')") from None
                raise
            stale = await index.stale(rows) if hasattr(index, "stale") else _stale_sessions(index.storage, rows)
            if not stale or attempt == 2 or read_only:
                return SearchResults([_hit(r) for r in rows if r["session_id"] not in stale], ranking)
            for sid in stale:
                logger.warning("search index: session %s disagrees with its log: indexing it again", sid)
                await catch_up_session(index, sid, force=True)
        raise AssertionError("unreachable")

    return await with_index(storage, work, dsn=dsn, pg_schema=pg_schema, own_index=index_path)


def _hit(r: dict[str, Any]) -> SearchHit:
    seq, idx = split_key(r["key"])
    snippet = unsegment(r["snippet"] or "").replace(MARK_OPEN, "[").replace(MARK_CLOSE, "]")
    return SearchHit(r["session_id"], seq, idx, r["role"], r["ts"], " ".join(snippet.split()), r["score"],
                     bool(r["in_view"]))


def _stale_sessions(root: Path, rows: list[dict[str, Any]]) -> set[str]:
    """The sessions of hits whose message the log does not hold where the index says (read and verified)."""
    from ...storage.segments import LogReader

    stale: set[str] = set()
    readers: dict[str, Any] = {}
    try:
        for r in rows:
            sid = r["session_id"]
            if sid in stale:
                continue
            try:
                reader = readers.get(sid)
                if reader is None:
                    reader = readers[sid] = LogReader(root / sid, sid)
                rec = codec.decode(reader.read_line_at(r["pos"]))
                held = {key: m for key, _, m in slots(rec)} if rec["seq"] == r["rec_seq"] else {}
                if r["key"] not in held or fingerprint(held[r["key"]]) != r["fp"]:
                    stale.add(sid)
            except Exception:
                stale.add(sid)
    finally:
        for reader in readers.values():
            with contextlib.suppress(Exception):
                reader.close()
    return stale


async def list_sessions(storage: str | os.PathLike[str] | None, *, catch_up: bool = True, dsn: str | None = None,
                        pg_schema: str | None = None) -> list[dict[str, Any]]:
    """Every session of a file storage (or with ``dsn`` of a PostgreSQL schema) from its index, caught up
    first: ``session_id``, ``messages`` (in the views), ``events`` (the last seq), ``bytes`` (of its log),
    ``first_ts``, ``last_ts`` and ``title`` (the first user message, shortened)."""

    async def work(index: Any) -> list[dict[str, Any]]:
        skipped: list[Outcome] = []
        found = await index.session_rows()
        if catch_up:
            outcomes = await catch_up_storage(index, known={r[0]: (r[7], r[8]) for r in found})
            skipped = [o for o in outcomes if o.skipped]
            if outcomes:
                found = await index.session_rows()
        skipped_ids = {o.session_id for o in skipped}
        names = ("session_id", "messages", "events", "bytes", "first_ts", "last_ts", "title")
        rows = [dict(zip(names, r)) for r in found if r[0] not in skipped_ids]
        if skipped:
            rows += [{"session_id": o.session_id, "error": o.skipped} for o in skipped]
            rows.sort(key=lambda r: r["session_id"])
        return rows

    return await with_index(storage, work, dsn=dsn, pg_schema=pg_schema)


async def rebuild_index(storage: str | os.PathLike[str] | None, *, dsn: str | None = None,
                        pg_schema: str | None = None) -> list[Outcome]:
    """``context-persistent index rebuild``: the index built again from the logs alone."""
    from .indexer import rebuild

    if dsn is not None:
        from .indexer import rebuild_pg

        return await rebuild_pg(dsn, pg_schema)
    if storage is None:
        raise ValueError("give the storage folder (or dsn= for the PostgreSQL backend)")
    return await rebuild(Path(storage))
