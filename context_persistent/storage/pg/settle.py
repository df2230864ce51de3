"""Settling an append on PostgreSQL after its connection was lost (I/O): stored or refused, never unknown while
the server can be reached.

A connection can end at any moment: a server restart, a failover, an administrator's ``pg_terminate_backend``
(and again on the connection opened to recover from that). :func:`live_writer_conn` gets the writer's
connection for an append, reconnecting (and re-locking) as often as the connection is lost before the statement
is sent: nothing was sent, so nothing was stored (a server that cannot be reached: DatabaseError, stored=False). :func:`settle` learns the outcome of an append whose reply was
lost: it reconnects and reads the seqs it tried to write, as many times as that is cut short, for up to
``RECONNECT_WINDOW`` seconds. Only when the server cannot be reached for that long is the outcome unknown
(``DatabaseError(stored=None)``; docs/postgres.md, "Connection loss").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import DatabaseError, SessionLockedError
from ...model import codec
from .connection import RECONNECT_WINDOW, _lost_errors, close_quietly, connect, require_asyncpg

if TYPE_CHECKING:
    from .log import PostgresEventLog

#: Seconds between two attempts after a connection was lost again.
RETRY_PAUSE = 0.02


def _drop(log: "PostgresEventLog", conn: Any) -> None:
    """Forget ``conn`` as the log's connection (and end it): the next use reconnects and re-locks."""
    if conn is not None:
        conn.terminate()
    if log._conn is conn:
        log._conn = None


def _window() -> float:
    return asyncio.get_running_loop().time() + RECONNECT_WINDOW


async def live_writer_conn(log: "PostgresEventLog") -> Any:
    """The writer's connection for an append: ``log._live_conn()``, tried again while the connection it opens
    is lost before it is ready (for up to ``RECONNECT_WINDOW`` seconds). DatabaseError(stored=False) when the
    server cannot be reached (nothing was sent); SessionLockedError when another writer took the session."""
    lost = _lost_errors(require_asyncpg())
    deadline = _window()
    while True:
        try:
            return await log._live_conn()
        except lost as e:
            _drop(log, log._conn)
            if asyncio.get_running_loop().time() >= deadline:
                raise DatabaseError(f"{log.path}: the connection was lost again and again while reconnecting "
                                    f"({type(e).__name__}: {e}); nothing was stored", stored=False) from e
            await asyncio.sleep(RETRY_PAUSE)


async def settle(log: "PostgresEventLog", lines: Sequence[bytes], first_seq: int, cause: BaseException) -> None:
    """After an append whose connection failed: return if it committed after all (the log's head moves on),
    else raise DatabaseError(stored=False); DatabaseError(stored=None) only if the server could not be reached
    for ``RECONNECT_WINDOW`` seconds (the log then refuses further appends: reopen the session to see)."""
    what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    old = log._conn
    if old is not None and not old.is_closed() and not isinstance(cause, asyncio.TimeoutError):
        old.terminate()  # the connection is in an unknown state: start clean (re-locking below)
    if old is not None and old.is_closed():
        log._conn = None
    failures: tuple[type[BaseException], ...] = (DatabaseError, *_lost_errors(require_asyncpg()))
    deadline = _window()
    while True:
        conn = reader = None
        try:
            try:
                conn = await log._live_conn()
            except SessionLockedError:
                conn = reader = await connect(log.dsn)
            rows = await conn.fetch(
                log._q("SELECT seq, record FROM {s}.events WHERE session_id = $1 AND seq >= $2 AND seq < $3 "
                       "ORDER BY seq"), log.session_id, first_seq, first_seq + len(lines), timeout=log.timeout)
            break
        except failures as e:
            # Lost again (the connection opened to find out was ended too) or not reachable: try again while the
            # window lasts; each attempt reconnects (and a reconnect itself waits that long for the server).
            if reader is None:
                _drop(log, conn if conn is log._conn else None)
                log._conn = None
            if asyncio.get_running_loop().time() < deadline and e is not log._broken:
                await asyncio.sleep(RETRY_PAUSE)
                continue
            log._broken = DatabaseError(
                f"{log.path}: the connection was lost during an append and the server could not be reached "
                f"to learn whether it was stored; reopen the session to see ({e})", stored=None)
            raise DatabaseError(
                f"{log.path}: the connection was lost during an append ({what}) and whether the records were "
                f"stored is unknown; reopen the session once the server is reachable", stored=None) from cause
        finally:
            await close_quietly(reader)
    if [bytes(r["record"]) for r in rows] == [bytes(x) for x in lines]:
        log.last_seq = max(log.last_seq, first_seq + len(lines) - 1)
        log.last_crc = codec.crc_of(bytes(lines[-1]))
        return  # it committed before the connection failed: the records are durable
    lost = f"; another writer now holds the session ({log._broken})" if log._broken is not None else \
        "; the log reconnected and remains writable"
    raise DatabaseError(f"{log.path}: the connection was lost during an append ({what}); "
                        f"nothing was stored{lost}", stored=False) from cause
