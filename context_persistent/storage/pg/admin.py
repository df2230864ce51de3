"""Administration of a PostgreSQL store: the ``db`` commands (init, status) and what ``ls``/``stats`` ask.

Each function opens its own short connection, takes no session lock and writes nothing but the schema.
"""

from __future__ import annotations

from typing import Any

from .connection import connect, translated
from .dsn import redact_dsn, resolve_dsn, resolve_schema
from .schema import SCHEMA_VERSION, _check_version, _schema_version, ensure_schema


async def init_schema(dsn: str | None = None, schema: str | None = None) -> dict[str, Any]:
    """``context-persistent db init``: create the schema if missing; report what is there."""
    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    conn = await connect(dsn)
    try:
        with translated(f"creating schema {schema!r} at {redact_dsn(dsn)}"):
            before = await _schema_version(conn, schema)
            version = await ensure_schema(conn, schema)
    finally:
        await conn.close()
    return {"dsn": redact_dsn(dsn), "schema": schema, "version": version, "created": before is None}


async def status(dsn: str | None = None, schema: str | None = None) -> dict[str, Any]:
    """``context-persistent db status``: server, layout version, sessions, events, writers holding locks."""
    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    conn = await connect(dsn)
    try:
        with translated(f"reading the status of schema {schema!r} at {redact_dsn(dsn)}"):
            return await _status(conn, dsn, schema)
    finally:
        await conn.close()


async def _status(conn: Any, dsn: str, schema: str) -> dict[str, Any]:
    out: dict[str, Any] = {"dsn": redact_dsn(dsn), "schema": schema,
                           "server_version": await conn.fetchval("SHOW server_version"),
                           "version": await _schema_version(conn, schema), "program_version": SCHEMA_VERSION}
    if out["version"] is None:
        return {**out, "sessions": 0, "events": 0, "checkpoints": 0, "writers": []}
    _check_version(out["version"], schema)
    out["sessions"] = await conn.fetchval(f"SELECT count(*) FROM {schema}.sessions")
    out["events"] = await conn.fetchval(f"SELECT count(*) FROM {schema}.events")
    out["checkpoints"] = await conn.fetchval(f"SELECT count(*) FROM {schema}.checkpoints")
    rows = await conn.fetch(
        f"""SELECT s.session_id, s.last_seq, a.pid, a.application_name, host(a.client_addr) AS client_addr
            FROM {schema}.sessions s
            JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND l.classid = ((s.lock_key >> 32) & 4294967295)::bigint::oid
                 AND l.objid = (s.lock_key & 4294967295)::bigint::oid
            LEFT JOIN pg_stat_activity a ON a.pid = l.pid
            ORDER BY s.session_id""")
    out["writers"] = [dict(r) for r in rows]
    return out


async def list_sessions(dsn: str | None = None, schema: str | None = None) -> list[dict[str, Any]]:
    """Every session in the schema: id, last_seq, created_at, updated_at (empty when there is no schema)."""
    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    conn = await connect(dsn)
    try:
        with translated(f"listing the sessions of schema {schema!r} at {redact_dsn(dsn)}"):
            version = await _schema_version(conn, schema)
            _check_version(version, schema)
            if version is None:
                return []
            rows = await conn.fetch(f"SELECT session_id, last_seq, created_at, updated_at FROM {schema}.sessions "
                                    "ORDER BY session_id")
        return [dict(r) for r in rows]
    finally:
        await conn.close()


async def session_bytes(dsn: str | None, schema: str | None, session_id: str) -> int:
    """The bytes of a session's records in the events table (what its log would be as a file)."""
    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    conn = await connect(dsn)
    try:
        with translated(f"measuring session {session_id!r} in schema {schema!r} at {redact_dsn(dsn)}"):
            value = await conn.fetchval(f"SELECT coalesce(sum(octet_length(record) + 1), 0) FROM {schema}.events "
                                        "WHERE session_id = $1", session_id)
        return int(value)
    finally:
        await conn.close()

