"""Connections to PostgreSQL: the driver (asyncpg, optional), connecting, error translation, lock keys.

Shared by the log and the administration; it holds no state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from ...errors import DatabaseError
from .dsn import _endpoint, redact_dsn, scrub

#: Seconds spent reconnecting after a lost connection before giving up (and, for an append whose reply was
#: lost, learning whether it was stored: pg/settle.py).
RECONNECT_WINDOW = 5.0

INSTALL_HINT = "pip install asyncpg (the 'postgres' extra of context-persistent; README, \"Install\")"

#: Server-side TCP keepalive for the writer's connection: a writer whose machine vanishes (no FIN/RST) is
#: noticed by the server after about idle + count × interval = 25 s, which frees its advisory lock.
WRITER_KEEPALIVE = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "25000",
}


def require_asyncpg() -> Any:
    """The asyncpg module, or DatabaseError with the install hint."""
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError:
        raise DatabaseError(f"the postgres backend needs asyncpg, which is not installed: {INSTALL_HINT}") from None
    return asyncpg



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



async def reconnect(dsn: str, window: float, *, writer: bool = False) -> Any:
    """A new connection after one was lost: :func:`connect`, tried again every 0.2 s for ``window`` seconds
    (a restarting server); DatabaseError when it still cannot be reached."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window
    while True:
        try:
            return await connect(dsn, writer=writer)
        except DatabaseError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def close_quietly(conn: Any) -> None:
    """Close ``conn`` if it is open (5 s at most; else, or if closing fails, drop it)."""
    if conn is not None and not conn.is_closed():
        try:
            await asyncio.wait_for(conn.close(), 5.0)
        except Exception:
            conn.terminate()
