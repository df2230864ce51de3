"""The search index of the PostgreSQL backend: tables of the session's own schema (docs/search.md, "PostgreSQL").

``search_sessions`` (one row per indexed session: its anchor, the last indexed record's seq and crc, the
``ls`` facts), ``search_docs`` (one row per message: the same columns as the SQLite index's ``docs``, its
``body`` and ``tools`` texts and their ``tsvector``, under a GIN index), ``search_redacted``, ``search_erasing``
and ``search_meta`` (layout and tokenizer). Every table but ``search_meta`` references ``sessions`` with
``ON DELETE CASCADE``: a session moved to the trash (or deleted) leaves the index in the same transaction.

The catch-up is the SQLite index's (indexer.py): this class gives it the same methods over one asyncpg
connection, and the session's log is a read-only ``PostgresEventLog`` on that connection. A session's
signature is its ``sessions`` row (``last_seq`` and ``created_at``); its write transactions are serialised
by a transaction-level advisory lock per session, as ``BEGIN IMMEDIATE`` serialises them in SQLite.

Removing text deletes rows at once: no query finds them. The old row versions stay in the table's files until
VACUUM lets their space be reused (docs/postgres.md, "Search"), as for any UPDATE or DELETE in PostgreSQL.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from ...model import codec
from .fold import APPEND_TYPES, Doc, slots
from .pg_text import snippet, vector
from .sqlite_index import title_of
from .text import fingerprint, unsegment

LAYOUT = "1"
TOKENIZE = "python words v1"  # (pg_text.py: a change of the rule rebuilds the tables)
TABLES = ("search_docs", "search_redacted", "search_erasing", "search_sessions", "search_meta")
SESSION_FIELDS = ("session_id", "last_seq", "last_crc", "position", "signature", "state", "messages", "bytes",
                  "first_ts", "last_ts", "title")


def _ddl(s: str) -> str:
    ref = f"text NOT NULL REFERENCES {s}.sessions (session_id) ON DELETE CASCADE"
    return f"""
CREATE TABLE IF NOT EXISTS {s}.search_meta (name text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS {s}.search_sessions (
    session_id {ref} PRIMARY KEY, last_seq bigint NOT NULL, last_crc text, position bigint, signature text,
    state text NOT NULL, messages integer NOT NULL, bytes bigint NOT NULL, first_ts text, last_ts text, title text);
CREATE TABLE IF NOT EXISTS {s}.search_docs (
    id bigserial PRIMARY KEY, session_id {ref}, key bigint NOT NULL, rec_seq bigint NOT NULL,
    slot integer NOT NULL, pos bigint, role text NOT NULL, ts text NOT NULL, in_view boolean NOT NULL,
    fp bytea NOT NULL, body text NOT NULL, tools text NOT NULL, tsv tsvector NOT NULL, UNIQUE (session_id, key));
CREATE INDEX IF NOT EXISTS search_docs_tsv ON {s}.search_docs USING gin (tsv);
CREATE TABLE IF NOT EXISTS {s}.search_redacted (session_id {ref}, key bigint NOT NULL, fp bytea,
    PRIMARY KEY (session_id, key));
CREATE TABLE IF NOT EXISTS {s}.search_erasing (session_id {ref}, key bigint NOT NULL, pid integer NOT NULL,
    host text NOT NULL, since double precision NOT NULL, PRIMARY KEY (session_id, key));
"""


class PgIndex:
    """One connection (opened on first use) to a schema's search tables. One owner (a task or thread)."""

    backend = "postgres"

    def __init__(self, dsn: str | None, schema: str | None = None, *, timeout: float = 60.0) -> None:
        from ...storage.pg.dsn import resolve_dsn, resolve_schema

        self.dsn, self.schema = resolve_dsn(dsn), resolve_schema(schema)
        self.timeout = timeout
        self._conn: Any = None

    def q(self, sql: str) -> str:
        return sql.replace("{s}", self.schema)

    async def conn(self) -> Any:
        """The connection, with the schema and the search tables created if missing (a layout or tokenizer
        of another version: the tables are dropped and made again, to be filled from the logs)."""
        from ...storage.pg import connect, ensure_schema, lock_key

        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        conn = await connect(self.dsn)
        try:
            await ensure_schema(conn, self.schema)
            if await self._layout(conn) != (LAYOUT, TOKENIZE):
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(self.schema, "\0search-schema"))
                    if await self._layout(conn) != (LAYOUT, TOKENIZE):
                        for table in TABLES:
                            await conn.execute(self.q(f"DROP TABLE IF EXISTS {{s}}.{table} CASCADE"))
                        await conn.execute(_ddl(self.schema))
                        await conn.executemany(self.q("INSERT INTO {s}.search_meta VALUES ($1, $2)"),
                                               [("layout", LAYOUT), ("tokenize", TOKENIZE)])
        except BaseException:
            conn.terminate()
            raise
        self._conn = conn
        return conn

    async def _layout(self, conn: Any) -> tuple[str | None, str | None]:
        """The layout and tokenizer the tables were made for; None when any table is missing (a lost table:
        all are made again and filled from the logs, never a half index trusted)."""
        if not await conn.fetchval("SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest($1::text[]) AS t",
                                   [f"{self.schema}.{table}" for table in TABLES]):
            return None, None
        meta = dict(await conn.fetch(self.q("SELECT name, value FROM {s}.search_meta")))
        return meta.get("layout"), meta.get("tokenize")

    async def exists(self) -> bool:
        """Whether the schema has search tables (without creating them)."""
        from ...storage.pg import connect

        conn = await connect(self.dsn)
        try:
            return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{self.schema}.search_docs"))
        finally:
            await conn.close()

    async def aclose(self) -> None:
        from ...storage.pg.connection import close_quietly

        conn, self._conn = self._conn, None
        await close_quietly(conn)

    async def _fetch(self, sql: str, *args: Any) -> list[Any]:
        return list(await (await self.conn()).fetch(self.q(sql), *args, timeout=self.timeout))

    async def _val(self, sql: str, *args: Any) -> Any:
        return await (await self.conn()).fetchval(self.q(sql), *args, timeout=self.timeout)

    async def _run(self, sql: str, *args: Any) -> int:
        status = await (await self.conn()).execute(self.q(sql), *args, timeout=self.timeout)
        return int(status.split()[-1]) if status.split()[-1].isdigit() else 0

    # -- the logs it projects -------------------------------------------------------------------------
    async def listing(self) -> dict[str, str | None]:
        """Every session of the schema with its signature (``last_seq`` and ``created_at``: an append moves the
        first, a session deleted and made again under the same id the second)."""
        rows = await self._fetch("SELECT session_id, last_seq, created_at FROM {s}.sessions")
        return {r[0]: f"{r[1]}:{r[2].isoformat()}" for r in rows}

    @contextlib.asynccontextmanager
    async def open_log(self, sid: str) -> AsyncIterator[tuple[Any, str | None] | None]:
        """The session's log, read-only, on this index's connection (no connection per session)."""
        from ...storage.pg.log import PostgresEventLog

        row = (await self._fetch("SELECT last_seq, created_at FROM {s}.sessions WHERE session_id = $1", sid) or [None])[0]
        if row is None:
            yield None
            return
        conn = await self.conn()
        log = PostgresEventLog(self.dsn, self.schema, sid, readonly=True, timeout=self.timeout)
        log._conn, log.existed, log.last_seq = conn, True, row[0]
        try:
            yield log, f"{row[0]}:{row[1].isoformat()}"
        finally:
            if log._conn is conn:  # (the connection is ours: the log must not close it)
                log._conn = None
            await log.close()

    async def record_crc(self, sid: str, seq: int) -> str | None:
        """The crc of the session's record at ``seq`` (None if there is none): whether the anchor still holds."""
        line = await self._val("SELECT record FROM {s}.events WHERE session_id = $1 AND seq = $2", sid, seq)
        if line is None:
            return None
        rec = codec.decode(bytes(line))
        return rec["crc"] if rec["seq"] == seq else None

    @contextlib.asynccontextmanager
    async def rebuild_lock(self, exclusive: bool) -> AsyncIterator[None]:
        from ...storage.pg import lock_key

        key = lock_key(self.schema, "\0search-rebuild")
        kind = "" if exclusive else "_shared"
        await self._val(f"SELECT pg_advisory_lock{kind}($1)", key)
        try:
            yield
        finally:
            if self._conn is not None and not self._conn.is_closed():
                await self._val(f"SELECT pg_advisory_unlock{kind}($1)", key)

    @contextlib.asynccontextmanager
    async def writing(self, sid: str | None = None) -> AsyncIterator[Any]:
        """One transaction; with ``sid``, serialised with every other writer of that session's documents."""
        from ...storage.pg import lock_key

        conn = await self.conn()
        async with conn.transaction():
            if sid is not None:
                await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(self.schema, "\0search\0" + sid))
            yield conn

    # -- sessions -------------------------------------------------------------------------------------
    async def session(self, sid: str) -> dict[str, Any] | None:
        rows = await self._fetch(f"SELECT {', '.join(SESSION_FIELDS)} FROM {{s}}.search_sessions "
                                 "WHERE session_id = $1", sid)
        return dict(zip(SESSION_FIELDS, rows[0])) if rows else None

    async def signatures(self) -> dict[str, tuple[str | None, str]]:
        return {r[0]: (r[1], r[2]) for r in await self._fetch("SELECT session_id, signature, state "
                                                                "FROM {s}.search_sessions")}

    async def session_rows(self) -> list[tuple[Any, ...]]:
        """What ``ls`` lists, in session order (the signature and state last)."""
        return [tuple(r) for r in await self._fetch(
            "SELECT session_id, messages, last_seq, bytes, first_ts, last_ts, title, signature, state "
            "FROM {s}.search_sessions ORDER BY session_id")]

    async def save_session(self, row: dict[str, Any]) -> None:
        cols = ", ".join(SESSION_FIELDS)
        sets = ", ".join(f"{f} = EXCLUDED.{f}" for f in SESSION_FIELDS[1:])
        await self._run(f"INSERT INTO {{s}}.search_sessions ({cols}) VALUES "
                        f"({', '.join(f'${i + 1}' for i in range(len(SESSION_FIELDS)))}) "
                        f"ON CONFLICT (session_id) DO UPDATE SET {sets}", *[row.get(f) for f in SESSION_FIELDS])

    async def mark_dirty(self, sid: str) -> None:
        await self._run("UPDATE {s}.search_sessions SET state = 'dirty', title = NULL WHERE session_id = $1", sid)

    async def delete_session(self, sid: str, keep_row: bool = False) -> int:
        n = await self._run("DELETE FROM {s}.search_docs WHERE session_id = $1", sid)
        await self._run("DELETE FROM {s}.search_redacted WHERE session_id = $1", sid)
        if not keep_row:
            await self._run("DELETE FROM {s}.search_sessions WHERE session_id = $1", sid)
        return n

    # -- erasures in progress -------------------------------------------------------------------------
    async def erasing(self, sid: str) -> list[tuple[int, int, str, float]]:
        return [tuple(r) for r in await self._fetch("SELECT key, pid, host, since FROM {s}.search_erasing "
                                                     "WHERE session_id = $1", sid)]  # type: ignore[misc]

    async def add_erasing(self, sid: str, key: int, pid: int, host: str) -> None:
        await self._run("INSERT INTO {s}.search_erasing VALUES ($1, $2, $3, $4, $5) ON CONFLICT (session_id, key) "
                        "DO UPDATE SET pid = $3, host = $4, since = $5", sid, key, pid, host, time.time())

    async def clear_erasing(self, sid: str) -> None:
        await self._run("DELETE FROM {s}.search_erasing WHERE session_id = $1", sid)

    async def delete_copies(self, sid: str, key: int) -> list[tuple[int, int, int, bool]] | None:
        """SqliteIndex.delete_copies: the document of ``key`` and every one with its fingerprint."""
        fp = (await self._val("SELECT fp FROM {s}.search_docs WHERE session_id = $1 AND key = $2", sid, key) or
              await self._val("SELECT fp FROM {s}.search_redacted WHERE session_id = $1 AND key = $2", sid, key))
        if fp is None:
            return None
        return [tuple(r) for r in await self._fetch(  # type: ignore[misc]
            "DELETE FROM {s}.search_docs WHERE session_id = $1 AND (key = $2 OR fp = $3) "
            "RETURNING rec_seq, slot, key, in_view", sid, key, fp)]

    async def held_slots(self, sid: str, slots: list[tuple[int, int]]) -> int:
        return int(await self._val("SELECT count(*) FROM {s}.search_docs d JOIN unnest($2::bigint[], $3::int[]) AS "
                                   "w(seq, slot) ON d.rec_seq = w.seq AND d.slot = w.slot WHERE d.session_id = $1",
                                   sid, [s for s, _ in slots], [i for _, i in slots]))

    async def redacted_rows(self, sid: str) -> list[tuple[int, bytes | None]]:
        return [(r[0], None if r[1] is None else bytes(r[1])) for r in await self._fetch(
            "SELECT key, fp FROM {s}.search_redacted WHERE session_id = $1", sid)]

    async def shift_positions(self, sid: str, after: int, delta: int) -> None:
        await self._run("UPDATE {s}.search_docs SET pos = pos + $3 WHERE session_id = $1 AND pos > $2",
                        sid, after, delta)

    async def holds(self, sid: str, key: int) -> bool:
        return bool(await self._val("SELECT count(*) FROM {s}.search_docs WHERE session_id = $1 AND key = $2",
                                    sid, key))

    async def purge(self) -> None:
        """Nothing to rewrite: deleted rows are in no query at once (VACUUM: the module docstring)."""
        await self._run("INSERT INTO {s}.search_meta VALUES ('purged_at', $1) ON CONFLICT (name) DO UPDATE "
                        "SET value = $1", repr(time.time()))

    async def purged_at(self) -> str | None:
        return await self._val("SELECT value FROM {s}.search_meta WHERE name = 'purged_at'")  # type: ignore[no-any-return]

    # -- documents ------------------------------------------------------------------------------------
    async def insert_docs(self, sid: str, docs: Iterable[tuple[Doc, bool]]) -> int:
        rows = []
        for doc, in_view in docs:
            body, tools = unsegment(doc.body), unsegment(doc.tools)
            rows.append((sid, doc.key, doc.rec_seq, doc.slot, doc.pos, doc.role, doc.ts, in_view, doc.fp, body,
                         tools, vector(body, tools)))
        if rows:
            await (await self.conn()).executemany(self.q(
                "INSERT INTO {s}.search_docs (session_id, key, rec_seq, slot, pos, role, ts, in_view, fp, body, tools, "
                "tsv) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::tsvector)"), rows, timeout=self.timeout)
        return len(rows)

    async def set_view(self, sid: str, keys: set[int]) -> None:
        await self._run("UPDATE {s}.search_docs SET in_view = NOT in_view WHERE session_id = $1 AND "
                        "in_view <> (key = ANY($2::bigint[]))", sid, list(keys))

    async def add_redacted(self, sid: str, keys: Iterable[int], prints: dict[int, bytes] | None = None) -> None:
        for key in keys:
            fp = prints.get(key) if prints is not None else await self._val(
                "SELECT fp FROM {s}.search_docs WHERE session_id = $1 AND key = $2", sid, key)
            await self._run("INSERT INTO {s}.search_redacted VALUES ($1, $2, $3) ON CONFLICT (session_id, key) "
                            "DO UPDATE SET fp = $3", sid, key, fp)

    async def delete_hidden(self, sid: str) -> int:
        return await self._run(
            "DELETE FROM {s}.search_docs WHERE session_id = $1 AND NOT in_view AND (key IN (SELECT key FROM "
            "{s}.search_redacted WHERE session_id = $1) OR fp IN (SELECT fp FROM {s}.search_redacted WHERE "
            "session_id = $1 AND fp IS NOT NULL))", sid)

    async def view_facts(self, sid: str) -> tuple[int, str | None]:
        n = await self._val("SELECT count(*) FROM {s}.search_docs WHERE session_id = $1 AND in_view", sid)
        return int(n), await self.title(sid)

    async def title(self, sid: str) -> str | None:
        body = await self._val("SELECT body FROM {s}.search_docs WHERE session_id = $1 AND in_view AND "
                               "role = 'user' ORDER BY key LIMIT 1", sid)
        return None if body is None else title_of(body)

    # -- reading --------------------------------------------------------------------------------------
    async def size_bytes(self) -> int:
        """The search tables' bytes on disk, their indexes and TOAST included."""
        total = 0
        for table in TABLES:
            total += int(await self._val("SELECT coalesce(pg_total_relation_size(to_regclass($1)), 0)",
                                         f"{self.schema}.{table}"))
        return total

    async def search(self, compiled: tuple[str | None, list[Any]], *, session_id: str | None, role: str | None,
                     since: str | None, all_messages: bool, limit: int,
                     window: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The best ``limit`` matches by ``ts_rank``: of the newest ``window`` matches (by time, then id), or of
        every match (``window`` None); and how many were ranked (sqlite_index.SqliteIndex.search)."""
        tsquery, marks = compiled
        ranking: dict[str, Any] = {"window": window, "ranked": None if window is None else 0, "all_ranked": True}
        if tsquery is None:
            return [], ranking
        where: list[str] = ["d.tsv @@ q.q"]
        params: list[Any] = [tsquery]
        for cond, value in (("d.in_view", None if all_messages else True), ("d.session_id = ${}", session_id),
                            ("d.role = ${}", role), ("d.ts >= ${}", since)):
            if value is True:
                where.append(cond)
            elif value is not None:
                params.append(value)
                where.append(cond.format(len(params)))
        cols = ("d.id, d.session_id, d.key, d.rec_seq, d.slot, d.pos, d.role, d.ts, d.in_view, d.fp, "
                "-ts_rank(d.tsv, q.q) AS score, d.body")
        names = ("id", "session_id", "key", "rec_seq", "slot", "pos", "role", "ts", "in_view", "fp", "score", "body")
        if window is None:
            found = await self._fetch(f"SELECT {cols} FROM {{s}}.search_docs d, CAST($1 AS tsquery) AS q(q) WHERE "
                                      f"{' AND '.join(where)} ORDER BY score, d.id LIMIT ${len(params) + 1}",
                                      *params, limit)
        else:  # the ids of the newest window + 1 (whether older matches exist), then the first window ranked
            newest = [r[0] for r in await self._fetch(
                f"SELECT d.id FROM {{s}}.search_docs d, CAST($1 AS tsquery) AS q(q) WHERE {' AND '.join(where)} "
                f"ORDER BY d.ts DESC, d.id DESC LIMIT ${len(params) + 1}", *params, window + 1)]
            ranking["ranked"], ranking["all_ranked"] = min(len(newest), window), len(newest) <= window
            found = await self._fetch(f"SELECT {cols} FROM {{s}}.search_docs d, CAST($1 AS tsquery) AS q(q) WHERE "
                                      "d.id = ANY($2::bigint[]) ORDER BY score, d.ts DESC, d.id DESC LIMIT $3",
                                      tsquery, newest[:window], limit) if newest else []
        rows = [dict(zip(names, r)) for r in found]
        for r in rows:
            r["snippet"] = snippet(r.pop("body"), marks)
            r["fp"] = bytes(r["fp"])
        return rows, ranking

    async def stale(self, rows: list[dict[str, Any]]) -> set[str]:
        """The sessions of hits whose message the log does not hold where the index says (read and verified)."""
        if not rows:
            return set()
        # (a lateral lookup per hit: the primary key, never a scan of the events)
        got = await self._fetch("SELECT w.sid, w.seq, e.record FROM unnest($1::text[], $2::bigint[]) AS w(sid, seq) "
                                "CROSS JOIN LATERAL (SELECT record FROM {s}.events WHERE session_id = w.sid AND "
                                "seq = w.seq) AS e",
                                [r["session_id"] for r in rows], [r["rec_seq"] for r in rows])
        records = {(sid, seq): bytes(line) for sid, seq, line in got}
        stale = set()
        for r in rows:
            try:
                rec = codec.decode(records[(r["session_id"], r["rec_seq"])])
                held = {key: m for key, _, m in slots(rec)}
                if r["key"] not in held or fingerprint(held[r["key"]]) != r["fp"]:
                    stale.add(r["session_id"])
            except Exception:
                stale.add(r["session_id"])
        return stale | await self._changed_since_indexed({r["session_id"] for r in rows} - stale)

    async def _changed_since_indexed(self, sids: set[str]) -> set[str]:
        """The sessions among ``sids`` whose log holds, after their last indexed record, one that changes what
        the views show other than by appending (a redaction, a clear, an erase...): their hits may show text the
        log no longer shows, until the writer's indexing thread has caught up (a read-only search, the
        viewer's, leaves them out; another search indexes them again)."""
        if not sids:
            return set()
        got = await self._fetch("SELECT e.session_id, e.record FROM {s}.events AS e JOIN {s}.search_sessions AS i "
                                "USING (session_id) WHERE e.session_id = ANY($1::text[]) AND e.seq > i.last_seq",
                                sorted(sids))
        changed = set()
        for sid, line in got:
            if sid not in changed and codec.decode(bytes(line)).get("type") not in APPEND_TYPES:
                changed.add(sid)
        return changed

    async def contents(self) -> dict[str, Any]:
        """Everything the index says (sessions without their signature, documents with their texts)."""
        sessions = {r[0]: dict(zip(SESSION_FIELDS, r)) for r in await self._fetch(
            f"SELECT {', '.join(SESSION_FIELDS)} FROM {{s}}.search_sessions")}
        for row in sessions.values():
            row.pop("signature")
        docs = sorted(tuple(bytes(v) if isinstance(v, (bytes, memoryview)) else v for v in r) for r in await self._fetch(
            "SELECT session_id, key, rec_seq, slot, pos, role, ts, in_view, fp, body, tools, tsv::text "
            "FROM {s}.search_docs"))
        return {"sessions": sessions, "docs": docs}
