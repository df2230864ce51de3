"""Retention on PostgreSQL: the same policies, ledger records and trash as the file backend (retention.py,
trash.py), over the existing tables, which keep their layout.

Three tables are added, created on first use (docs/postgres.md): ``retention_ledger`` (the ledger: one row
per record, the same chained, CRC-checked lines as the file ledger), ``trash`` (one row per entry: the
session's row as it was) and ``trash_events`` (the entry's records). Trashing a session moves its
``sessions`` and ``events`` rows there and deletes its checkpoint row (a cache), restoring moves them back,
purging deletes them: each in one transaction with its ledger record, so a killed process leaves the state
before or after, never half of it, and there is nothing to reconcile. The mover holds the session's advisory
transaction lock, which a live writer holds for as long as its store is open: a live session is never moved.
One retention command at a time per schema (a session-level advisory lock on the ledger).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from typing import Any

from ...model import codec
from ...errors import LedgerError, SessionLockedError, SessionNotFoundError
from ...model.retention import (ENTRY_SEP, PURGED, RESTORE_CANCELLED, RESTORED, TRASHED, Entry, Expiry, Plan, RetentionPolicy,
                         SessionInfo, find_entry, fold, plan, purge_plan)
from .connection import connect, lock_key, translated
from .dsn import redact_dsn, resolve_dsn, resolve_schema
from .schema import _check_version, _schema_version, ensure_schema

#: The ledger's chain root (the file ledger's too): CRC-32 of ``session:.retention``.
LEDGER_ID = ".retention"


def _ddl(s: str) -> str:
    return f"""
CREATE TABLE IF NOT EXISTS {s}.retention_ledger (
    seq bigint PRIMARY KEY CHECK (seq > 0),
    record bytea NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.trash (
    entry text PRIMARY KEY,
    session_id text NOT NULL,
    lock_key bigint NOT NULL,
    last_seq bigint NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    trashed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS trash_session_id ON {s}.trash (session_id);
CREATE TABLE IF NOT EXISTS {s}.trash_events (
    entry text NOT NULL REFERENCES {s}.trash (entry) ON DELETE CASCADE,
    seq bigint NOT NULL CHECK (seq > 0),
    record bytea NOT NULL,
    PRIMARY KEY (entry, seq)
);
"""


async def trashed_entries(conn: Any, schema: str, session_id: str) -> list[str]:
    """The trash entries of a session (empty when the retention tables do not exist): what open checks when a
    session has no row."""
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{schema}.trash"):
        return []
    rows = await conn.fetch(f"SELECT entry FROM {schema}.trash WHERE session_id = $1 ORDER BY trashed_at",
                            session_id)
    return [r["entry"] for r in rows]


class _Store:
    """One retention command's connection to a schema (holding the ledger lock unless read-only)."""

    def __init__(self, conn: Any, dsn: str, schema: str) -> None:
        self.conn = conn
        self.dsn = dsn
        self.schema = schema
        self.records: list[dict[str, Any]] = []
        self.entries: dict[str, Entry] = {}

    def q(self, sql: str) -> str:
        return sql.replace("{s}", self.schema)

    @property
    def where(self) -> str:
        return f"{redact_dsn(self.dsn)} schema {self.schema!r} table retention_ledger"

    async def load(self) -> None:
        rows = await self.conn.fetch(self.q("SELECT seq, record FROM {s}.retention_ledger ORDER BY seq"))
        links = codec.Links(LEDGER_ID)
        records = []
        for row in rows:
            raw = bytes(row["record"])
            try:
                rec = codec.decode(raw)
            except codec.RecordError as e:
                raise LedgerError(f"{self.where}: row seq {row['seq']} is corrupt ({e}); nothing was changed") from None
            problem = links.check(rec)
            if rec["seq"] != row["seq"] or problem is not None:
                what = problem or f"holds record seq {rec['seq']}"
                raise LedgerError(f"{self.where}: row seq {row['seq']} {what}; nothing was changed")
            records.append(rec)
        self.records = records
        self.entries = fold(records, self.where)

    async def append(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Insert one ledger record (inside the caller's transaction)."""
        seq = (self.records[-1]["seq"] if self.records else 0) + 1
        prev = self.records[-1]["crc"].encode() if self.records else codec.root_crc(LEDGER_ID)
        line = codec.encode_event(seq, kind, data, prev=prev)
        await self.conn.execute(self.q("INSERT INTO {s}.retention_ledger (seq, record) VALUES ($1, $2)"), seq,
                                line.rstrip(b"\n"))
        rec = codec.decode(line)
        self.records.append(rec)
        self.entries = fold(self.records, self.where)
        return rec


async def _open(dsn: str | None, schema: str | None, *, write: bool) -> _Store:
    dsn, schema = resolve_dsn(dsn), resolve_schema(schema)
    conn = await connect(dsn)
    try:
        with translated(f"opening the retention ledger of schema {schema!r} at {redact_dsn(dsn)}"):
            if write:
                await ensure_schema(conn, schema)
                await conn.execute(_ddl(schema))
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", lock_key(schema, "\0retention")):
                    raise SessionLockedError(LEDGER_ID, None, f"(another process is applying retention to schema "
                                             f"{schema!r})")
            else:
                _check_version(await _schema_version(conn, schema), schema)
            store = _Store(conn, dsn, schema)
            if write or await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{schema}.retention_ledger"):
                await store.load()
    except BaseException:
        conn.terminate()
        raise
    return store


async def _sessions(store: _Store, measure: bool = True) -> list[SessionInfo]:
    """Every session of the schema: last activity = its ``updated_at`` (the time of its last append), size =
    its records' bytes (as a file log; reading every record's length, so only when ``measure``, else 0), live =
    a writer holds its advisory lock."""
    if await store.conn.fetchval("SELECT to_regclass($1) IS NULL", f"{store.schema}.sessions"):
        return []
    size = ("coalesce((SELECT sum(octet_length(e.record) + 1) FROM {s}.events e WHERE e.session_id = s.session_id), 0)"
            if measure else "0")
    rows = await store.conn.fetch(store.q(
        """SELECT s.session_id, s.updated_at, {size} AS bytes,
                  EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                          AND l.classid = ((s.lock_key >> 32) & 4294967295)::bigint::oid
                          AND l.objid = (s.lock_key & 4294967295)::bigint::oid) AS live
           FROM {s}.sessions s ORDER BY s.session_id""".replace("{size}", size)))
    return [SessionInfo(r["session_id"], r["updated_at"], int(r["bytes"]), r["live"]) for r in rows]


async def _log_digest(store: _Store, table: str, column: str, key: str) -> tuple[str, int, int | None]:
    """``(sha256, bytes, last seq)`` of a session's records as its file log would hold them (each line + newline)."""
    h = hashlib.sha256()
    n = 0
    last = None
    rows = await store.conn.fetch(store.q(f"SELECT seq, record FROM {{s}}.{table} WHERE {column} = $1 ORDER BY seq"),
                                  key)
    for row in rows:
        raw = bytes(row["record"]) + b"\n"
        h.update(raw)
        n += len(raw)
        last = row["seq"]
    return "sha256:" + h.hexdigest(), n, last


async def _trash_one(store: _Store, expiry: Expiry, policy: RetentionPolicy, now: datetime) -> dict[str, Any]:
    sid = expiry.session_id
    conn = store.conn
    async with conn.transaction():
        if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", lock_key(store.schema, sid)):
            raise SessionLockedError(sid, None, "(PostgreSQL advisory lock: a writer holds it)")
        row = await conn.fetchrow(store.q("SELECT * FROM {s}.sessions WHERE session_id = $1 FOR UPDATE"), sid)
        if row is None:
            raise SessionNotFoundError(f"session {sid!r} is gone since the plan")
        digest, size, last = await _log_digest(store, "events", "session_id", sid)
        name = f"{sid}{ENTRY_SEP}{(store.records[-1]['seq'] if store.records else 0) + 1}"
        data = {"entry": name, "session_id": sid, "rule": expiry.rule, "reason": expiry.reason,
                "policy": policy.as_dict(), "last_activity": expiry.session.last_activity.isoformat(),
                "last_seq": last, "bytes": size, "files": None,
                "log": {"bytes": size, "sha256": digest}, "grace_days": policy.grace_days,
                "purge_after": (now + timedelta(days=policy.grace_days)).isoformat()}
        await store.append(TRASHED, data)
        await conn.execute(store.q("INSERT INTO {s}.trash (entry, session_id, lock_key, last_seq, created_at, "
                                   "updated_at) VALUES ($1, $2, $3, $4, $5, $6)"),
                           name, sid, row["lock_key"], row["last_seq"], row["created_at"], row["updated_at"])
        await conn.execute(store.q("INSERT INTO {s}.trash_events (entry, seq, record) SELECT $1, seq, record "
                                   "FROM {s}.events WHERE session_id = $2"), name, sid)
        await conn.execute(store.q("DELETE FROM {s}.checkpoints WHERE session_id = $1"), sid)
        await conn.execute(store.q("DELETE FROM {s}.sessions WHERE session_id = $1"), sid)  # events cascade
    return data


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(timezone.utc)


async def plan_pg(dsn: str | None, schema: str | None, policy: RetentionPolicy, *, now: datetime | None = None,
                  exclude: frozenset[str] = frozenset()) -> Plan:
    """What ``policy`` would expire in a PostgreSQL schema now (nothing is changed)."""
    store = await _open(dsn, schema, write=False)
    try:
        with translated(f"planning retention in schema {store.schema!r}"):
            return plan(policy, await _sessions(store), _now(now), exclude)
    finally:
        await store.conn.close()


async def _rollback(store: _Store) -> None:
    """After a rolled-back transaction: the ledger as stored (the record it appended in memory is gone)."""
    await store.load()


async def apply_pg(dsn: str | None, schema: str | None, policy: RetentionPolicy, *, now: datetime | None = None,
                   exclude: frozenset[str] = frozenset(), measure: bool = True) -> dict[str, Any]:
    """Apply ``policy`` to a PostgreSQL schema: each expired session that no writer holds moves to the trash
    tables with its ledger record, one transaction each. Returns ``{plan, trashed, skipped, reconciled}``.
    ``measure`` False: sessions' sizes are read only if the policy has ``max_bytes`` (apply on open)."""
    store = await _open(dsn, schema, write=True)
    try:
        with translated(f"applying retention in schema {store.schema!r}"):
            when = _now(now)
            p = plan(policy, await _sessions(store, measure or policy.max_bytes is not None), when, exclude)
            trashed = []
            skipped = [{"session_id": e.session_id, "rule": e.rule, "why": "live: a writer holds it"} for e in p.live]
            for expiry in p.expire:
                try:
                    data = await _trash_one(store, expiry, policy, when)
                except (SessionLockedError, SessionNotFoundError) as e:
                    await _rollback(store)
                    skipped.append({"session_id": expiry.session_id, "rule": expiry.rule, "why": str(e)})
                    continue
                trashed.append({k: data[k] for k in ("entry", "session_id", "rule", "reason", "bytes",
                                                     "purge_after")})
        return {"plan": p.as_dict(), "trashed": trashed, "skipped": skipped, "reconciled": []}
    finally:
        await store.conn.close()


async def list_trash_pg(dsn: str | None, schema: str | None, *, all_entries: bool = False) -> list[dict[str, Any]]:
    """The trash entries of a schema, as :func:`context_persistent.operations.trash.list_trash`."""
    store = await _open(dsn, schema, write=False)
    try:
        with translated(f"listing the trash of schema {store.schema!r}"):
            present = set()
            if await store.conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{store.schema}.trash"):
                present = {r["entry"] for r in await store.conn.fetch(store.q("SELECT entry FROM {s}.trash"))}
        out = []
        for entry in sorted(store.entries.values(), key=lambda e: e.seq):
            if entry.state in (TRASHED, RESTORE_CANCELLED) or all_entries:
                out.append({**entry.as_dict(), "present": entry.name in present})
        return out
    finally:
        await store.conn.close()


def _find(store: _Store, name: str) -> Entry:
    return find_entry(store.entries, name, "context-persistent trash list --dsn ...")


async def restore_pg(dsn: str | None, schema: str | None, name: str) -> dict[str, Any]:
    """Move a trash entry's rows back (its records' SHA-256 checked against the ledger first)."""
    store = await _open(dsn, schema, write=True)
    try:
        entry = _find(store, name)
        conn = store.conn
        with translated(f"restoring {entry.name} in schema {store.schema!r}"):
            async with conn.transaction():
                if await conn.fetchval(store.q("SELECT 1 FROM {s}.sessions WHERE session_id = $1"), entry.session_id):
                    raise ValueError(f"cannot restore {entry.name}: session {entry.session_id!r} exists (a new session "
                                     "under the same id); move or remove that session first")
                row = await conn.fetchrow(store.q("SELECT * FROM {s}.trash WHERE entry = $1 FOR UPDATE"), entry.name)
                if row is None:
                    raise LedgerError(f"trash entry {entry.name} is recorded in the ledger but its row is missing "
                                      "from the trash table; nothing was restored")
                digest, size, _ = await _log_digest(store, "trash_events", "entry", entry.name)
                if digest != entry.data["log"]["sha256"]:
                    raise LedgerError(f"trash entry {entry.name}: its records' SHA-256 is {digest}, the ledger "
                                      f"recorded {entry.data['log']['sha256']}: they changed in the trash; nothing "
                                      "was restored")
                data = {"entry": entry.name, "session_id": entry.session_id, "log": {"bytes": size, "sha256": digest}}
                await store.append(RESTORED, data)
                await conn.execute(store.q("INSERT INTO {s}.sessions (session_id, lock_key, last_seq, created_at, "
                                           "updated_at) VALUES ($1, $2, $3, $4, $5)"), entry.session_id,
                                   row["lock_key"], row["last_seq"], row["created_at"], row["updated_at"])
                await conn.execute(store.q("INSERT INTO {s}.events (session_id, seq, record) SELECT $1, seq, record "
                                           "FROM {s}.trash_events WHERE entry = $2"), entry.session_id, entry.name)
                await conn.execute(store.q("DELETE FROM {s}.trash WHERE entry = $1"), entry.name)
        return data
    finally:
        await store.conn.close()


async def purge_pg(dsn: str | None, schema: str | None, names: list[str] | None = None, *, force: bool = False,
                   now: datetime | None = None, reason: str = "") -> dict[str, Any]:
    """Delete trash entries for good, as :func:`context_persistent.operations.trash.purge` (each with its record, in one
    transaction)."""
    when = _now(now)
    store = await _open(dsn, schema, write=True)
    try:
        todo, refused = purge_plan(store.entries, names, "context-persistent trash list --dsn ...", when, force=force,
                                   reason=reason)
        purged = []
        for entry, record, row in todo:
            with translated(f"purging {entry.name} in schema {store.schema!r}"):
                async with store.conn.transaction():
                    await store.append(PURGED, record)
                    await store.conn.execute(store.q("DELETE FROM {s}.trash WHERE entry = $1"), entry.name)
            purged.append(row)
        return {"purged": purged, "refused": refused}
    finally:
        await store.conn.close()


async def apply_on_open(dsn: str | None, schema: str | None, policy: RetentionPolicy,
                        session_id: str) -> dict[str, Any] | None:
    """``apply_on_open`` on PostgreSQL: the policy over the other sessions; None if another process holds the
    ledger lock."""
    try:
        return await apply_pg(dsn, schema, policy, exclude=frozenset({session_id}), measure=False)
    except SessionLockedError:
        return None


__all__ = ["apply_on_open", "apply_pg", "list_trash_pg", "plan_pg", "purge_pg", "restore_pg", "trashed_entries"]
