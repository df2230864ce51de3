"""Messages of a PostgreSQL session read back on demand (I/O): the PostgreSQL side of pages.py.

On PostgreSQL a message's ref is its key, ``seq << 20 | index``: the record that holds it is the row of
``<schema>.events`` with that seq. :class:`PostgresMessageReader` reads such rows (one for a ref, one
``seq = ANY(...)`` query for a run of refs), verifies each with ``codec.decode`` and its seq, picks the
message and keeps it in the same bounded LRU cache as the file backend's reader.

A history is read synchronously (a list's ``__getitem__``), from the thread of the store's event loop, which
cannot be awaited there. The reader therefore has a connection of its own, driven by an event loop of its own
on a private thread, both started on the first read the cache cannot serve; the caller's thread waits for
the query (as the file backend waits for a disk read). A lost connection is opened again (for up to
``RECONNECT_WINDOW`` seconds) and the read tried once more: reads change nothing, so trying again is safe.
:meth:`PostgresMessageReader.close` ends the connection and the thread; the store calls it when it closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import DatabaseError, LogCorruptedError, RecordCorruptedError, StoreClosedError
from ..pages import CACHE_BYTES, REF_INDEX_BITS, PageCache
from .connection import _lost_errors, close_quietly, reconnect, require_asyncpg

if TYPE_CHECKING:
    from .log import PostgresEventLog

T = TypeVar("T")

#: The most refs one query asks for (``fetch_many`` splits longer lists).
QUERY_ROWS = 1024


class PostgresMessageReader(PageCache):
    """Reads messages by key from one PostgreSQL session's rows, through an LRU cache of at most
    ``cache_bytes`` (pages.PageCache). ``connects`` counts the connections it opened."""

    #: A ref is the message's key (the writer and the replay give :meth:`Projection.apply` the record's seq).
    refs_are_keys = True

    def __init__(self, log: "PostgresEventLog", cache_bytes: int = CACHE_BYTES) -> None:
        from .log import RECONNECT_WINDOW

        super().__init__(cache_bytes)
        self.dsn = log.dsn
        self.session_id = log.session_id
        self.path = log.path
        self.timeout = log.timeout
        self.window = RECONNECT_WINDOW
        self._sql = (f"SELECT seq, record FROM {log.schema}.events WHERE session_id = $1 "
                     "AND seq = ANY($2::bigint[])")
        self._lock = threading.Lock()  # one read at a time (a reader has one connection)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        self._closed = False
        self.connects = 0

    def _broken(self, at: int, reason: str) -> LogCorruptedError:
        return RecordCorruptedError(self.path, at, reason)

    def _record(self, at: int, line: bytes) -> dict[str, Any]:
        rec = super()._record(at, line)
        if rec["seq"] != at:
            raise self._broken(at, f"the record inside says seq {rec['seq']}")
        return rec

    def _line(self, seq: int) -> bytes:
        return self._rows([seq])[seq]

    def fetch_many(self, refs: list[int]) -> list[dict[str, Any]]:
        """The messages ``refs`` name, in order: those not in the cache read with one query per
        ``QUERY_ROWS`` records. Messages read here are kept while the cache has room for them
        (``keep_read``): they never evict what it holds."""
        out, want = self._uncached(refs)
        seqs = sorted(want)
        for start in range(0, len(seqs), QUERY_ROWS):
            rows = self._rows(seqs[start:start + QUERY_ROWS])
            for seq in seqs[start:start + QUERY_ROWS]:
                rec = self._record(seq, rows[seq])
                share = len(rows[seq]) // len(want[seq])
                for k in want[seq]:
                    out[k] = message = self._message(seq, rec, refs[k] & ((1 << REF_INDEX_BITS) - 1))
                    self.keep_read(refs[k], message, share)
        return out

    # -- the private connection ---------------------------------------------------------------------
    @property
    def backend_pid(self) -> int | None:
        """The server process serving the reader's connection (None before its first read; for tests)."""
        conn = self._conn
        return conn.get_server_pid() if conn is not None and not conn.is_closed() else None

    def _rows(self, seqs: list[int]) -> dict[int, bytes]:
        """The records stored at ``seqs`` (RecordCorruptedError if one is missing), read on the reader's own
        connection and thread; DatabaseError if the server cannot be reached."""
        found = self.query("fetch", self._sql, seqs, what="reading messages of the history")
        rows = {r["seq"]: bytes(r["record"]) for r in found}
        for seq in seqs:
            if seq not in rows:
                raise self._broken(seq, "no record with this seq is stored, but the history refers to a message "
                                   "of it (was the session deleted or moved to the trash while it was open?)")
        return rows

    def query(self, method: str, sql: str, *args: Any, what: str) -> Any:
        """``conn.<method>(sql, session_id, *args)`` on the reader's own connection, from the caller's thread
        (``what`` names the read in errors: DatabaseError if the server cannot be reached)."""
        return self.run(self._query(method, sql, args, what), what)

    def run(self, work: Coroutine[Any, Any, T], what: str) -> T:
        """Run ``work`` on the reader's own event loop and thread and wait for it (StoreClosedError once the
        reader is closed)."""
        with self._lock:
            if self._closed:
                work.close()
                raise StoreClosedError(f"session {self.session_id!r}: the store is closed; its history cannot be "
                                       "read any more")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, daemon=True,
                                          name=f"context-persistent reader {self.session_id}")
                thread.start()
                self._loop, self._thread = loop, thread
            future = asyncio.run_coroutine_threadsafe(work, self._loop)
            try:
                # (a query has its own timeout; this one bounds a wait that should never happen)
                return future.result(timeout=2 * self.timeout + self.window + 30)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise DatabaseError(f"{self.path}: {what} did not finish", stored=None) from None

    async def _query(self, method: str, sql: str, args: tuple[Any, ...], what: str) -> Any:
        apg = require_asyncpg()
        for attempt in (0, 1):
            conn = self._conn
            if conn is None or conn.is_closed():
                conn = self._conn = await reconnect(self.dsn, self.window)
                self.connects += 1
            try:
                return await getattr(conn, method)(sql, self.session_id, *args, timeout=self.timeout)
            except _lost_errors(apg) as e:
                self._conn = None
                conn.terminate()
                if attempt:
                    raise DatabaseError(f"{self.path}: {what} failed: the connection was lost "
                                        f"({type(e).__name__}: {e})", stored=None) from e
                continue
            except apg.PostgresError as e:
                raise DatabaseError(f"{self.path}: {what} failed: {type(e).__name__}: {e}", stored=None) from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        """End the connection and the thread (idempotent); reads after this raise StoreClosedError."""
        with self._lock:
            self._closed = True
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._disconnect(), loop).result(timeout=10)
        except Exception:
            pass  # (the server is gone: the socket closes with the loop below)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        await close_quietly(conn)
