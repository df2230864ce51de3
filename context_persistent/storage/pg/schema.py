"""The PostgreSQL layout: its tables, its version, and creating it (schema version 1, see docs/postgres.md)."""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedFormatError
from .connection import lock_key

#: Layout version written to ``<schema>.schema_version``; a program refuses a database with a newer one.
SCHEMA_VERSION = 1


def _ddl(s: str) -> str:
    return f"""
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.schema_version (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    version integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.sessions (
    session_id text PRIMARY KEY,
    lock_key bigint NOT NULL,
    last_seq bigint NOT NULL DEFAULT 0 CHECK (last_seq >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.events (
    session_id text NOT NULL REFERENCES {s}.sessions (session_id) ON DELETE CASCADE,
    seq bigint NOT NULL CHECK (seq > 0),
    record bytea NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS {s}.checkpoints (
    session_id text PRIMARY KEY REFERENCES {s}.sessions (session_id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    payload bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""


async def _schema_version(conn: Any, schema: str) -> int | None:
    """The stored layout version, or None when the schema has not been created."""
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{schema}.schema_version")
    if not exists:
        return None
    return await conn.fetchval(f"SELECT version FROM {schema}.schema_version")


def _check_version(version: int | None, schema: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise UnsupportedFormatError(
            f"PostgreSQL schema {schema!r} has layout version {version}, newer than this program's "
            f"{SCHEMA_VERSION}: upgrade context-persistent to use this database"
        )


async def ensure_schema(conn: Any, schema: str) -> int:
    """Create the tables if missing (concurrent callers serialise on a transaction lock); return the version."""
    version = await _schema_version(conn, schema)
    _check_version(version, schema)
    if version == SCHEMA_VERSION:
        return version
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(schema, "\0schema"))
        version = await _schema_version(conn, schema)
        _check_version(version, schema)
        if version is None:
            # IF NOT EXISTS / ON CONFLICT: a concurrent creator's catalog change may not be visible yet.
            await conn.execute(_ddl(schema))
            await conn.execute(f"INSERT INTO {schema}.schema_version (version) VALUES ($1) ON CONFLICT (id) DO NOTHING",
                               SCHEMA_VERSION)
            version = await conn.fetchval(f"SELECT version FROM {schema}.schema_version")
            _check_version(version, schema)
    return version

