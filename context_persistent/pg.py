"""The PostgreSQL event log: the same records as the file log, in a table (I/O only; it decides no policy).

Needs the optional extra ``context-persistent[postgres]`` (asyncpg). Layout (schema version 1, see
docs/postgres.md): ``<schema>.events(session_id, seq, record)`` holds each record exactly as the file
format encodes it (same envelope, same checksum, verified with ``codec.decode`` on every read);
``<schema>.sessions`` holds one row per session whose ``last_seq`` is the append guard;
``<schema>.checkpoints`` holds the checkpoint payload; ``<schema>.schema_version`` the layout version.

Writer exclusivity: the writer holds a session-level advisory lock on its own connection for as long as
the log is open, and appends on that same connection, so it can only write while it holds the lock. The
server drops the lock when the connection ends (process death, or TCP keepalive on a vanished machine).
An append is one statement (one transaction): it moves ``sessions.last_seq`` from ``first_seq - 1`` to the
new head, inserts the records and notifies followers; if ``last_seq`` moved, nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from . import codec
from .errors import (
    ConcurrencyError,
    DatabaseError,
    ReadOnlyError,
    RecordCorruptedError,
    SessionLockedError,
    SessionNotFoundError,
    StoreClosedError,
    UnsupportedFormatError,
)
from .paths import validate_session_id

#: Layout version written to ``<schema>.schema_version``; a program refuses a database with a newer one.
SCHEMA_VERSION = 1
DEFAULT_SCHEMA = "context_persistent"
ENV_DSN = "CONTEXT_PERSISTENT_DSN"
ENV_SCHEMA = "CONTEXT_PERSISTENT_PG_SCHEMA"
INSTALL_HINT = "pip install asyncpg (the 'postgres' extra of context-persistent; README, \"Install\")"

#: Server-side TCP keepalive for the writer's connection: a writer whose machine vanishes (no FIN/RST) is
#: noticed by the server after about idle + count × interval = 25 s, which frees its advisory lock.
WRITER_KEEPALIVE = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "25000",
}
#: Seconds an append or a read may take before it is abandoned (and, for an append, reconciled).
DEFAULT_TIMEOUT = 30.0
#: Seconds spent reconnecting after a lost connection before giving up.
RECONNECT_WINDOW = 5.0

logger = logging.getLogger("context_persistent.pg")
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def require_asyncpg() -> Any:
    """The asyncpg module, or DatabaseError with the install hint."""
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError:
        raise DatabaseError(f"the postgres backend needs asyncpg, which is not installed: {INSTALL_HINT}") from None
    return asyncpg


def resolve_dsn(dsn: str | None) -> str:
    """``dsn`` if given, else ``$CONTEXT_PERSISTENT_DSN``; ValueError when neither is set."""
    value = dsn or os.environ.get(ENV_DSN)
    if not value:
        raise ValueError(f"the postgres backend needs a dsn (config 'dsn', --dsn, or ${ENV_DSN}), "
                         "e.g. postgresql://user@host:5432/dbname")
    if not isinstance(value, str) or not value.startswith(("postgresql://", "postgres://")):
        shown = redact_dsn(value) if isinstance(value, str) else value
        raise ValueError(f"dsn must be a postgresql:// or postgres:// URL, got {shown!r}")
    return value


def resolve_schema(schema: str | None) -> str:
    """``schema`` if given, else ``$CONTEXT_PERSISTENT_PG_SCHEMA``, else ``context_persistent``; validated."""
    value = schema or os.environ.get(ENV_SCHEMA) or DEFAULT_SCHEMA
    if not isinstance(value, str) or not _SCHEMA_RE.match(value):
        raise ValueError(f"pg_schema must be a lower-case SQL identifier (letters, digits, _; at most 63), "
                         f"got {value!r}")
    return value


#: Query parameters of a DSN that hold secrets (libpq's names): masked wherever a DSN is shown.
_SECRET_PARAMS = frozenset({"password", "sslpassword"})


def redact_dsn(dsn: str) -> str:
    """The DSN without its passwords (the userinfo part and ``?password=``/``?sslpassword=``), for messages."""
    try:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, host = netloc.rsplit("@", 1)
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
        query = parts.query
        if query:
            pairs = [p.split("=", 1) for p in query.split("&")]
            query = "&".join(f"{p[0]}=***" if len(p) == 2 and unquote(p[0]).lower() in _SECRET_PARAMS
                             else "=".join(p) for p in pairs)
        out = f"{parts.scheme}://{netloc}{parts.path}"  # (not urlunsplit: it drops the // of an empty host)
        return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:  # not a URL we can take apart (a bad port, brackets): show no userinfo or query at all
        return re.sub(r"\?.*$", "?***", re.sub(r"//[^/@]*@", "//***@", dsn))


def _secrets(dsn: str) -> list[str]:
    """The password strings in a DSN (as written and decoded), longest first, to scrub from foreign text."""
    found: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urlsplit(dsn)
        if parts.password:
            found.update((parts.password, unquote(parts.password)))
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k.lower() in _SECRET_PARAMS and v:
                found.add(v)
        for p in parts.query.split("&"):
            k, _, v = p.partition("=")
            if unquote(k).lower() in _SECRET_PARAMS and v:
                found.add(v)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, dsn: str) -> str:
    """``text`` (an error from the driver) with the DSN's passwords masked."""
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


def _endpoint(dsn: str) -> str:
    """``host:port`` a DSN points at, for messages (libpq's defaults: a local socket, port 5432)."""
    try:
        parts = urlsplit(dsn)
        query = dict(parse_qsl(parts.query))
        host = parts.hostname or query.get("host") or "localhost"
        port = parts.port or query.get("port") or 5432
    except ValueError:
        return "(unparsable host)"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _digest(schema: str, session_id: str, size: int) -> bytes:
    return hashlib.blake2b(f"{schema}\0{session_id}".encode(), digest_size=size, person=b"ctx-persist").digest()


def lock_key(schema: str, session_id: str) -> int:
    """The 64-bit advisory-lock key of a session (a hash of schema and id; collisions are 2^-64 unlikely)."""
    return int.from_bytes(_digest(schema, session_id, 8), "big", signed=True)


def channel_of(schema: str, session_id: str) -> str:
    """The LISTEN/NOTIFY channel of a session (a hash: ids may be longer than a channel name)."""
    return "cp_" + _digest(schema, session_id, 12).hex()


def application_name() -> str:
    """What ``pg_stat_activity.application_name`` shows for our connections: who holds a session."""
    return f"context-persistent pid={os.getpid()} host={socket.gethostname()}"[:63]


def _lost_errors(apg: Any) -> tuple[type[BaseException], ...]:
    """Exceptions after which a statement's outcome is unknown (the connection failed or timed out)."""
    return (OSError, asyncio.TimeoutError, apg.InterfaceError, apg.InternalClientError,
            apg.PostgresConnectionError, apg.exceptions.OperatorInterventionError)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Turn asyncpg and socket errors into DatabaseError (``what`` says what was being done)."""
    apg = require_asyncpg()
    try:
        yield
    except (OSError, asyncio.TimeoutError, apg.PostgresError, apg.InterfaceError, apg.InternalClientError) as e:
        raise DatabaseError(f"{what}: {type(e).__name__}: {e}", stored=None) from e


async def connect(dsn: str, *, writer: bool = False, timeout: float = 10.0) -> Any:
    """A new connection (writer connections get the keepalive settings); DatabaseError when unreachable."""
    apg = require_asyncpg()
    settings = {"application_name": application_name()}
    if writer:
        settings.update(WRITER_KEEPALIVE)
    try:
        return await apg.connect(dsn, timeout=timeout, server_settings=settings)
    except (OSError, asyncio.TimeoutError, apg.PostgresError, apg.InterfaceError) as e:
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            why = (f"timed out after {timeout:g} s: the server at {_endpoint(dsn)} did not complete the "
                   "connection (is the host reachable and the port right?)")
        else:
            why = f"{type(e).__name__}: {scrub(str(e), dsn)}" if str(e) else type(e).__name__
        raise DatabaseError(f"cannot connect to PostgreSQL at {redact_dsn(dsn)} ({_endpoint(dsn)}): {why}") from None


# -- schema -----------------------------------------------------------------------------------------
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


async def _lock_holder(conn: Any, key: int) -> dict[str, Any] | None:
    """Who holds an advisory lock: backend pid, application_name (our client pid and host), client address."""
    row = await conn.fetchrow(
        """SELECT l.pid, a.application_name, host(a.client_addr) AS client_addr
           FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
           WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid""",
        (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)
    return dict(row) if row else None


def _locked_error(session_id: str, holder: dict[str, Any] | None) -> SessionLockedError:
    if holder is None:
        return SessionLockedError(session_id, None, "(PostgreSQL advisory lock; the holder just went away: retry)")
    app = holder.get("application_name") or ""
    m = re.search(r"pid=(\d+)(?: host=(\S+))?", app)
    client_pid = int(m.group(1)) if m else None
    where = [f"on host {m.group(2)}"] if m and m.group(2) else []
    where.append(f"PostgreSQL backend pid {holder['pid']}")
    if app and not m:
        where.append(f"application_name {app!r}")
    if holder.get("client_addr"):
        where.append(f"client {holder['client_addr']}")
    return SessionLockedError(session_id, client_pid, "(" + ", ".join(where) + ")")


# -- the log ----------------------------------------------------------------------------------------
class PostgresEventLog:
    """The PostgreSQL backend of :class:`~context_persistent.eventlog.EventLog`. Open with :meth:`open`.

    A writer owns one connection (holding the session's advisory lock; appends and reads go through it);
    a reader owns one connection and takes no lock; each ``follow()`` opens its own listening connection.
    Not thread-safe; one owner per instance.
    """

    torn = None  # a transaction is all or nothing: there is never a torn tail to cut

    def __init__(self, dsn: str, schema: str, session_id: str, *, readonly: bool, timeout: float) -> None:
        self.dsn = dsn
        self.schema = schema
        self.session_id = session_id
        self.readonly = readonly
        self.timeout = timeout
        self.existed = False
        self.last_seq = 0
        #: The crc of the record at ``last_seq`` once read or appended: the next record's ``prev``.
        self.last_crc: bytes | None = None
        #: Where the records live, for messages (password removed).
        self.path = f"{redact_dsn(dsn)} {schema}.events session {session_id!r}"
        self._key = lock_key(schema, session_id)
        self._channel = channel_of(schema, session_id)
        self._conn: Any = None
        self._io = asyncio.Lock()
        self._closed = False
        self._broken: BaseException | None = None  # set when the writer can no longer append
        self._followers: set[Any] = set()
        self._backend: int | None = None  # server pid of the connection holding our lock
        #: Where the manager's checkpoints go for this backend (checkpoint/store.py looks for this attribute).
        self.checkpoint_store = PostgresCheckpointStore(self)

    @classmethod
    async def open(cls, dsn: str | None, session_id: str, *, schema: str | None = None, readonly: bool = False,
                   create: bool = True, timeout: float = DEFAULT_TIMEOUT) -> "PostgresEventLog":
        """Connect, create the schema if needed, take the writer lock (unless ``readonly``).

        Raises SessionLockedError (another writer holds the session, named), SessionNotFoundError (readonly
        or ``create=False`` on a missing session), DatabaseError (server unreachable, asyncpg missing),
        UnsupportedFormatError (the database has a newer layout).
        """
        validate_session_id(session_id)
        log = cls(resolve_dsn(dsn), resolve_schema(schema), session_id, readonly=readonly, timeout=timeout)
        with translated(f"opening {log.path}"):
            await log._start(create)
        return log

    @property
    def backend_pid(self) -> int | None:
        """The server process serving this log's connection (for operators and tests)."""
        return self._conn.get_server_pid() if self._conn is not None and not self._conn.is_closed() else None

    @property
    def position(self) -> int:
        return self.last_seq  # seq is the index: no byte position is needed to resume a read

    def _q(self, sql: str) -> str:
        return sql.replace("{s}", self.schema)

    async def _start(self, create: bool) -> None:
        conn = await connect(self.dsn, writer=not self.readonly)
        try:
            if self.readonly:
                version = await _schema_version(conn, self.schema)
                _check_version(version, self.schema)
                row = None if version is None else await conn.fetchrow(
                    self._q("SELECT last_seq FROM {s}.sessions WHERE session_id = $1"), self.session_id)
                if row is None:
                    raise SessionNotFoundError(f"session {self.session_id!r} not found in {redact_dsn(self.dsn)} "
                                               f"schema {self.schema!r}")
                self.existed = True
                self.last_seq = row["last_seq"]
            else:
                await ensure_schema(conn, self.schema)
                await self._lock(conn)
                self.existed, self.last_seq = await self._claim_row(conn, create)
        except BaseException:
            conn.terminate()
            raise
        self._conn = conn

    async def _lock(self, conn: Any, wait_for_pid: int | None = None) -> None:
        """Take the session's advisory lock or raise SessionLockedError naming the holder.

        ``wait_for_pid``: our own previous backend, which may still hold the lock for a moment after its
        connection was dropped; wait (up to RECONNECT_WINDOW) for it to exit rather than report it.
        """
        deadline = asyncio.get_running_loop().time() + RECONNECT_WINDOW
        while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key):
            holder = await _lock_holder(conn, self._key)
            if (holder is None or holder["pid"] == wait_for_pid) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                continue
            raise _locked_error(self.session_id, holder)
        self._backend = conn.get_server_pid()

    async def _claim_row(self, conn: Any, create: bool) -> tuple[bool, int]:
        """(existed, last_seq) of the session row, creating it if allowed; checks it against the events."""
        row = await conn.fetchrow(self._q("SELECT last_seq FROM {s}.sessions WHERE session_id = $1"), self.session_id)
        if row is None:
            if not create:
                raise SessionNotFoundError(f"session {self.session_id!r} not found in {redact_dsn(self.dsn)} "
                                           f"schema {self.schema!r}")
            await conn.execute(self._q("INSERT INTO {s}.sessions (session_id, lock_key) VALUES ($1, $2) "
                                       "ON CONFLICT (session_id) DO NOTHING"), self.session_id, self._key)
            return False, 0
        head = await conn.fetchval(self._q("SELECT coalesce(max(seq), 0) FROM {s}.events WHERE session_id = $1"),
                                   self.session_id)
        if head != row["last_seq"]:
            raise RecordCorruptedError(self.path, head, f"the sessions row says last_seq {row['last_seq']} but the "
                                       f"events table holds records up to seq {head}")
        return True, row["last_seq"]

    async def _live_conn(self) -> Any:
        """The connection, reconnected (and, for a writer, re-locked and re-checked) if it was lost."""
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the log is closed")
        if self._broken is not None:
            raise self._broken
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECONNECT_WINDOW
        while True:
            try:
                conn = await connect(self.dsn, writer=not self.readonly)
                break
            except DatabaseError:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            if not self.readonly:
                await self._lock(conn, wait_for_pid=self._backend)
                _, head = await self._claim_row(conn, create=False)
                # Another writer may have appended while we were disconnected: our caller's state is stale,
                # and its next append fails with ConcurrencyError instead of writing over a gap.
                self.last_seq = head
        except BaseException as e:
            conn.terminate()
            if isinstance(e, SessionLockedError):
                self._broken = e
            raise
        self._conn = conn
        return conn

    # -- reading ------------------------------------------------------------------------------------
    def _verify(self, seq: int, record: bytes, expect: int) -> dict[str, Any]:
        try:
            rec = codec.decode(record)
        except codec.RecordError as e:
            raise RecordCorruptedError(self.path, seq, str(e)) from None
        if rec["seq"] != seq:
            raise RecordCorruptedError(self.path, seq, f"the record inside says seq {rec['seq']}")
        if seq != expect:
            raise RecordCorruptedError(self.path, seq, f"seq {seq} does not follow seq {expect - 1} (a gap)")
        return rec

    async def _page(self, after_seq: int, limit: int) -> list[Any]:
        apg = require_asyncpg()
        async with self._io:
            conn = await self._live_conn()
            try:
                return await conn.fetch(
                    self._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 AND seq > $2 "
                            "ORDER BY seq LIMIT $3"), self.session_id, after_seq, limit, timeout=self.timeout)
            except (*_lost_errors(apg), apg.PostgresError) as e:
                raise DatabaseError(f"{self.path}: reading failed: {type(e).__name__}: {e}", stored=None) from e

    async def _links(self, after_seq: int) -> codec.Links | None:
        """The chain check for records after ``after_seq``: seeded with that record's crc (None if it is gone:
        the caller then finds the log shorter than it expected)."""
        if after_seq <= 0:
            return codec.Links(self.session_id)
        rows = await self._page(after_seq - 1, 1)
        if not rows or rows[0]["seq"] != after_seq:
            return None
        anchor = self._verify(after_seq, rows[0]["record"], after_seq)
        self.last_crc = anchor["crc"].encode()
        return codec.Links(self.session_id, anchor["crc"], anchor.get("prev") is not None)

    def _linked(self, links: codec.Links | None, rec: dict[str, Any]) -> codec.Links:
        """Check ``rec`` against the chain (the table's key orders records, the chain binds them to this
        session and to each other: a record copied in from another session's log breaks it)."""
        if links is None:
            return codec.Links(self.session_id, rec["crc"], rec.get("prev") is not None)
        problem = links.check(rec)
        if problem is not None:
            raise RecordCorruptedError(self.path, rec["seq"], f"record seq {rec['seq']} {problem}")
        return links

    async def read_batches(self, after_seq: int = 0, position: int | None = None,
                           batch: int = 4096) -> AsyncIterator[list[dict[str, Any]]]:
        last = max(after_seq, 0)
        links = await self._links(last)
        while True:
            rows = await self._page(last, batch)
            if not rows:
                break
            out = []
            for seq, record in rows:
                rec = self._verify(seq, record, last + 1)
                links = self._linked(links, rec)
                out.append(rec)
                last = seq
            self.last_seq = max(self.last_seq, last)
            self.last_crc = links.last.encode() if links is not None and links.last else self.last_crc
            yield out
            if len(rows) < batch:
                break

    # -- writing ------------------------------------------------------------------------------------
    _APPEND = """
WITH moved AS (
    UPDATE {s}.sessions SET last_seq = $3, updated_at = now()
    WHERE session_id = $1 AND last_seq = $2
    RETURNING session_id
), stored AS (
    INSERT INTO {s}.events (session_id, seq, record)
    SELECT moved.session_id, t.seq, t.record FROM moved, unnest($4::bigint[], $5::bytea[]) AS t(seq, record)
    RETURNING 1
)
SELECT (SELECT count(*) FROM stored) AS n, pg_notify($6, $7) FROM moved"""

    async def append(self, lines: Sequence[bytes], first_seq: int) -> None:
        if self.readonly:
            raise ReadOnlyError(f"{self.path}: opened readonly; appends are not allowed")
        if not lines:
            return
        seqs = list(range(first_seq, first_seq + len(lines)))
        for seq, line in zip(seqs, lines):
            if not line.startswith(b'{"v":%d,"seq":%d,' % (codec.FORMAT_VERSION, seq)):
                raise ValueError(f"record {seq - first_seq} does not start with the envelope of seq {seq}")
        apg = require_asyncpg()
        async with self._io:
            conn = await self._live_conn()
            if first_seq != self.last_seq + 1:
                raise ConcurrencyError(f"{self.path}: expected to append seq {self.last_seq + 1}, got {first_seq}")
            last = seqs[-1]
            try:
                row = await conn.fetchrow(self._q(self._APPEND), self.session_id, first_seq - 1, last, seqs,
                                          list(lines), self._channel, str(last), timeout=self.timeout)
            except _lost_errors(apg) as e:
                await self._reconcile(lines, first_seq, e)
                return
            except apg.UniqueViolationError as e:
                raise ConcurrencyError(f"{self.path}: seq {first_seq}..{last} is already stored") from e
            except apg.PostgresError as e:
                raise DatabaseError(f"{self.path}: the server refused the append ({type(e).__name__}: {e}); "
                                    "nothing was stored", stored=False) from e
            except BaseException:
                # Cancelled mid-statement: the outcome is unknown; learn it before the next append.
                self._conn = None
                conn.terminate()
                raise
            if row is None:
                head = await conn.fetchval(self._q("SELECT last_seq FROM {s}.sessions WHERE session_id = $1"),
                                           self.session_id)
                self.last_seq = head
                raise ConcurrencyError(f"{self.path}: expected to append seq {first_seq}, but the log is at seq "
                                       f"{head}: another writer appended; nothing was stored")
            self.last_seq = last
            self.last_crc = codec.crc_of(bytes(lines[-1]))

    async def _reconcile(self, lines: Sequence[bytes], first_seq: int, cause: BaseException) -> None:
        """After a failed append: return if it committed after all, else raise DatabaseError saying so."""
        what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        old = self._conn
        if old is not None and not old.is_closed() and not isinstance(cause, asyncio.TimeoutError):
            old.terminate()  # the connection is in an unknown state: start clean (re-locking below)
        if old is not None and old.is_closed():
            self._conn = None
        reader = None
        failures: tuple[type[BaseException], ...] = (DatabaseError, *_lost_errors(require_asyncpg()))
        try:
            try:
                conn = await self._live_conn()
            except SessionLockedError:
                conn = reader = await connect(self.dsn)
            rows = await conn.fetch(
                self._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 AND seq >= $2 AND seq < $3 "
                        "ORDER BY seq"), self.session_id, first_seq, first_seq + len(lines), timeout=self.timeout)
        except failures as e:
            self._conn = None
            self._broken = DatabaseError(
                f"{self.path}: the connection was lost during an append and the server could not be reached "
                f"to learn whether it was stored; reopen the session to see ({e})", stored=None)
            raise DatabaseError(
                f"{self.path}: the connection was lost during an append ({what}) and whether the records were "
                f"stored is unknown; reopen the session once the server is reachable", stored=None) from cause
        finally:
            if reader is not None:
                await reader.close()
        if [bytes(r["record"]) for r in rows] == [bytes(x) for x in lines]:
            self.last_seq = max(self.last_seq, first_seq + len(lines) - 1)
            self.last_crc = codec.crc_of(bytes(lines[-1]))
            return  # it committed before the connection failed: the records are durable
        lost = f"; another writer now holds the session ({self._broken})" if self._broken is not None else \
            "; the log reconnected and remains writable"
        raise DatabaseError(f"{self.path}: the connection was lost during an append ({what}); "
                            f"nothing was stored{lost}", stored=False) from cause

    # -- erasure (erasure.py) -------------------------------------------------------------------------
    async def replace_records(self, lines: dict[int, bytes]) -> bool:
        """Replace the records at the given seqs (each by one with the same seq and crc: an erasure tombstone)
        and delete the session's checkpoint row, in one transaction. Returns whether a checkpoint was deleted."""
        if self.readonly:
            raise ReadOnlyError(f"{self.path}: opened readonly; records cannot be replaced")
        apg = require_asyncpg()
        async with self._io:
            conn = await self._live_conn()
            try:
                async with conn.transaction():
                    for seq, line in sorted(lines.items()):
                        done = await conn.execute(self._q("UPDATE {s}.events SET record = $3 WHERE session_id = $1 "
                                                          "AND seq = $2"), self.session_id, seq, line,
                                                  timeout=self.timeout)
                        if done != "UPDATE 1":
                            raise ConcurrencyError(f"{self.path}: seq {seq} is not stored; nothing was erased")
                    done = await conn.execute(self._q("DELETE FROM {s}.checkpoints WHERE session_id = $1"),
                                              self.session_id, timeout=self.timeout)
            except apg.PostgresError as e:
                raise DatabaseError(f"{self.path}: the server refused the erasure ({type(e).__name__}: {e}); "
                                    "nothing was changed", stored=False) from e
        return bool(done != "DELETE 0")

    async def raw_rows(self) -> list[tuple[int, bytes]]:
        """``(seq, bytes)`` of every stored record of the session and of its checkpoint row (seq 0 names it)."""
        async with self._io:
            conn = await self._live_conn()
            rows = await conn.fetch(self._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 ORDER BY seq"),
                                    self.session_id, timeout=self.timeout)
            cp = await conn.fetchval(self._q("SELECT payload FROM {s}.checkpoints WHERE session_id = $1"),
                                     self.session_id, timeout=self.timeout)
        out = [(r["seq"], bytes(r["record"])) for r in rows]
        if cp is not None:
            out.append((0, bytes(cp)))
        return out

    # -- following ----------------------------------------------------------------------------------
    async def follow(self, after_seq: int = 0) -> AsyncIterator[dict[str, Any]]:
        """LISTEN first, then catch up by reading, then read again on each notification (see docs/postgres.md).

        Reads are by ``seq > last seen`` so a notification that arrives during catch-up causes at most an
        empty read: nothing is missed or repeated. A lost connection is re-opened and re-caught-up.
        """
        apg = require_asyncpg()
        last = max(after_seq, 0)
        links: codec.Links | None = codec.Links(self.session_id) if last == 0 else None
        wake: asyncio.Queue[bool] = asyncio.Queue()
        while not self._closed:
            conn = await connect(self.dsn)
            self._followers.add(conn)
            try:
                await conn.add_listener(self._channel, lambda *_: wake.put_nowait(True))
                conn.add_termination_listener(lambda *_: wake.put_nowait(False))
                while True:
                    while True:  # catch up
                        rows = await conn.fetch(
                            self._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 AND seq > $2 "
                                    "ORDER BY seq LIMIT 1000"), self.session_id, last, timeout=self.timeout)
                        for seq, record in rows:
                            rec = self._verify(seq, record, last + 1)
                            links = self._linked(links, rec)
                            last = seq
                            yield rec
                        if len(rows) < 1000:
                            break
                    if not await wake.get() or self._closed:
                        break
                    while not wake.empty():  # coalesce a burst of notifications into one read
                        if not wake.get_nowait():
                            break
            except _lost_errors(apg):
                pass  # reconnect and catch up from ``last``
            except apg.PostgresError as e:
                raise DatabaseError(f"{self.path}: following failed: {type(e).__name__}: {e}", stored=None) from e
            finally:
                self._followers.discard(conn)
                conn.terminate()
            if not self._closed:
                await asyncio.sleep(0.1)

    # -- closing ------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Close every connection; the server releases the writer lock with the connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in list(self._followers):
            conn.terminate()
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 5.0)
            except Exception:
                conn.terminate()

    async def __aenter__(self) -> "PostgresEventLog":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class PostgresCheckpointStore:
    """The checkpoint payload of a session in ``<schema>.checkpoints`` (checkpoint.CheckpointStore).

    It uses the log's own connection: a writer saves checkpoints only while it holds the session's lock,
    and an upsert replaces the row atomically. A checkpoint is a cache, so a failed load or discard is
    logged and treated as "no checkpoint" (the full replay that follows reports a real outage).
    """

    def __init__(self, log: PostgresEventLog) -> None:
        self._log = log

    async def _run(self, method: str, sql: str, *args: Any) -> Any:
        log = self._log
        async with log._io:
            conn = await log._live_conn()
            return await getattr(conn, method)(log._q(sql), log.session_id, *args, timeout=log.timeout)

    async def load(self) -> bytes | None:
        try:
            payload = await self._run("fetchval", "SELECT payload FROM {s}.checkpoints WHERE session_id = $1")
        except Exception as e:
            logger.info("%s: could not read the checkpoint (%s); replaying the whole log", self._log.path, e)
            return None
        return None if payload is None else bytes(payload)

    async def save(self, payload: bytes, seq: int) -> None:
        if self._log.readonly:
            raise ReadOnlyError(f"{self._log.path}: opened readonly; checkpoints are not written")
        await self._run("execute", "INSERT INTO {s}.checkpoints (session_id, seq, payload) VALUES ($1, $2, $3) "
                        "ON CONFLICT (session_id) DO UPDATE SET seq = EXCLUDED.seq, payload = EXCLUDED.payload, "
                        "created_at = now()", seq, payload)

    async def discard(self) -> None:
        if self._log.readonly:
            return
        try:
            await self._run("execute", "DELETE FROM {s}.checkpoints WHERE session_id = $1")
        except Exception as e:
            logger.info("%s: could not remove an unusable checkpoint (%s)", self._log.path, e)


__all__ = ["DEFAULT_SCHEMA", "ENV_DSN", "ENV_SCHEMA", "PostgresCheckpointStore", "PostgresEventLog", "SCHEMA_VERSION", "channel_of",
           "connect", "ensure_schema", "init_schema", "list_sessions", "lock_key", "status"]
