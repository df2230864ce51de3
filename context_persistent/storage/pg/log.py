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
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...model import codec
from ...errors import (
    ConcurrencyError,
    DatabaseError,
    ReadOnlyError,
    RecordCorruptedError,
    SessionLockedError,
    SessionNotFoundError,
    SessionTrashedError,
    StoreClosedError,
)
from ..checkpoint.payload import _TRAILER, Checkpoint, CheckpointError, _head
from ..checkpoint.store import check_front, check_state
from ..paths import validate_session_id
from .connection import (RECONNECT_WINDOW, _lost_errors, channel_of, close_quietly, connect, lock_key, reconnect,
                         require_asyncpg, translated)
from .dsn import redact_dsn, resolve_dsn, resolve_schema
from .schema import _check_version, _schema_version, ensure_schema
from .settle import live_writer_conn, settle

#: Seconds an append or a read may take before it is abandoned (and, for an append, reconciled).
DEFAULT_TIMEOUT = 30.0

logger = logging.getLogger("context_persistent.storage.pg")


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
    """The PostgreSQL backend of :class:`~context_persistent.storage.eventlog.EventLog`. Open with :meth:`open`.

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
        #: The byte length of each record of the batch ``read_batches`` yielded last (the same order): what a
        #: paged history's cache counts for the messages it keeps (pg/pages.py).
        self.batch_sizes: list[int] = []
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
                    await self._refuse_trashed(conn)
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
            await self._refuse_trashed(conn)
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

    async def _refuse_trashed(self, conn: Any) -> None:
        """SessionTrashedError if a retention policy moved this session to the trash (pg/retention.py)."""
        from .retention import trashed_entries

        entries = await trashed_entries(conn, self.schema, self.session_id)
        if entries:
            raise SessionTrashedError(self.session_id, entries, f"{redact_dsn(self.dsn)} schema {self.schema!r}, "
                                      f"table trash, entry {', '.join(entries)}")

    async def _live_conn(self) -> Any:
        """The connection, reconnected (and, for a writer, re-locked and re-checked) if it was lost."""
        if self._closed:
            raise StoreClosedError(f"session {self.session_id!r}: the log is closed")
        if self._broken is not None:
            raise self._broken
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        conn = await reconnect(self.dsn, RECONNECT_WINDOW, writer=not self.readonly)
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
            sizes = []
            for seq, record in rows:
                rec = self._verify(seq, record, last + 1)
                links = self._linked(links, rec)
                out.append(rec)
                sizes.append(len(record))
                last = seq
            self.batch_sizes = sizes
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
            conn = await live_writer_conn(self)  # (reconnected as often as it is lost before the statement)
            if first_seq != self.last_seq + 1:
                raise ConcurrencyError(f"{self.path}: expected to append seq {self.last_seq + 1}, got {first_seq}")
            last = seqs[-1]
            try:
                row = await conn.fetchrow(self._q(self._APPEND), self.session_id, first_seq - 1, last, seqs,
                                          list(lines), self._channel, str(last), timeout=self.timeout)
            except _lost_errors(apg) as e:
                await settle(self, lines, first_seq, e)  # stored (returns) or refused; unknown only if unreachable
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
        await close_quietly(conn)

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

    #: Its payloads' front sections are read alone at open, the rest when needed (checkpoint.policy).
    reads_front = True

    def __init__(self, log: PostgresEventLog) -> None:
        self._log = log

    async def open_front(self, reader: Any) -> "tuple[Checkpoint, PostgresStateSection, int, int] | None":
        """Read and verify only the header and front section of the stored payload, without fetching the rest
        of it: ``(checkpoint, state section, its offset, its length)`` (checkpoint.store.FileCheckpointStore's
        ``open_front``), or None if there is none. The state section is read later through ``reader``
        (pg/pages.PostgresMessageReader, whose own connection serves reads made from a list's ``__getitem__``).
        CheckpointError if the payload is not a checkpoint's; an error of the server is logged (None, as
        :meth:`load`)."""
        got = await self._part(1, _FIRST_READ)
        if got is None:
            return None
        size, first = got
        nl = first.find(b"\n")
        if nl < 0:
            raise CheckpointError(f"truncated or malformed ({size} bytes, no header line in the first "
                                  f"{len(first)} bytes)")
        line = first[:nl + 1]
        head = _head(line[:-1])
        rest = first[nl + 1:nl + 2 + head["front_bytes"] + _TRAILER]
        want = head["front_bytes"] + 1 + _TRAILER - len(rest)
        if want > 0 and len(first) < size:  # (a large front section: the rest of it in a second read)
            more = await self._part(len(first) + 1, want)
            if more is None:
                return None
            rest += more[1]
        cp, offset, length = check_front(line, head, rest, size)
        if cp.state_in is not None:
            raise CheckpointError("its state section is in another file, which only a file checkpoint can have")
        return cp, PostgresStateSection(self._log, reader, line + rest), offset, length

    async def _run(self, method: str, sql: str, *args: Any) -> Any:
        log = self._log
        async with log._io:
            conn = await log._live_conn()
            return await getattr(conn, method)(log._q(sql), log.session_id, *args, timeout=log.timeout)

    async def _part(self, start: int, count: int) -> tuple[int, bytes] | None:
        """``(the payload's length, its count bytes from byte start, 1-based)``, or None if there is none or it
        cannot be read (logged, as :meth:`load`: a cache; the replay that follows reports a real outage)."""
        sql = "SELECT length(payload), substring(payload from $2 for $3) FROM {s}.checkpoints WHERE session_id = $1"
        try:
            row = await self._run("fetchrow", sql, start, count)
        except Exception as e:
            logger.info("%s: could not read the checkpoint (%s); replaying the whole log", self._log.path, e)
            return None
        return None if row is None else (row[0], bytes(row[1]))

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


#: The bytes of a payload read first at open: its header line (a few hundred bytes) and the start of its front
#: section (the rest of which is read next: the state section is never read at open).
_FIRST_READ = 1 << 16


class PostgresStateSection:
    """The state section of a checkpoint opened by :meth:`PostgresCheckpointStore.open_front`, read when the
    history needs it (``read_state``, synchronous, on the reader's own connection). Only from the same payload:
    if the row was replaced since the open (its header and front differ), CheckpointError."""

    def __init__(self, log: PostgresEventLog, reader: Any, prefix: bytes) -> None:
        self.path = log.path
        self._reader = reader
        self._prefix = prefix
        self._sql = (f"SELECT substring(payload from 1 for $2) = $3, substring(payload from $4 for $5) "
                     f"FROM {log.schema}.checkpoints WHERE session_id = $1")

    def read_state(self, offset: int, length: int) -> dict[str, Any]:
        """Read, verify and parse the state section (checkpoint.store.read_state)."""
        row = self._reader.query("fetchrow", self._sql, len(self._prefix), self._prefix, offset + 1,
                                 length + 1 + _TRAILER, what="reading the checkpoint's state section")
        if row is None or not row[0]:
            raise CheckpointError(f"{self.path}: the checkpoint was replaced or removed since it was opened")
        return check_state(bytes(row[1]), length)

    def close(self) -> None:
        """Nothing is held (the reader owns the connection)."""
