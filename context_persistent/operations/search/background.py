"""The writer's side: a thread per storage that catches sessions up after their appends, off the request path.

``notify`` costs the append a dictionary update and an event set (and, after an event that changed the history,
a copy of the history's keys: a memcpy). The thread reads the new records from the log, as any reader would, in
its own event loop and with its own connection to the index; ``flush`` (at close) waits for a session's work.
A failure is logged and retried at the next notification: the log is the truth, the index catches up.

The SQLite connection is closed when the thread has done a flushed session's work and nothing else waits (the
next notification opens it again): a closed SQLite connection checkpoints its write-ahead log and removes it. A
process that exits with it open (a CLI turn ends right after its store's close; the thread is a daemon) leaves
the log to the next one, which reads all of it to recover and then appends to it: it grew by every turn's pages
and every process paid for reading it (#23).

The indexing side (``indexer``, ``fold``, ``sqlite_index`` with ``sqlite3``, ``text``) is imported by the thread
when it first has work to do, after the quiet period that follows an append: a store that is opened and appended
to loads only this module, and the imports run while the caller waits for the model's reply (#23). A process
whose store is closed before that (an Amplifier CLI turn with a fast reply: ``leave``) imports none of it.

``leave`` is the Amplifier host's close (docs/search.md, "How it stays a projection"): the session's work the
thread has not begun is withdrawn, for the next reader or writer to catch up from the index's anchor; work it is
doing, and any work while its connection to the index is open, is waited for as ``wait`` does (the connection is
then closed, so no write-ahead log is left behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .snapshot import Snapshot

logger = logging.getLogger("context_persistent")
#: The thread waits for this long without a notification before it catches up (a burst of appends is indexed
#: once, after it, and the thread's work, which holds the GIL at times, does not slow the burst) ...
QUIET = 0.25
#: ... but never leaves work waiting longer than this.
MAX_DELAY = 2.0


class BackgroundIndexer:
    """Catches up the sessions of one storage (a folder, or a PostgreSQL schema) that this process writes."""

    _instances: dict[Any, BackgroundIndexer] = {}
    _guard = threading.Lock()

    @classmethod
    def _for(cls, key: Any, make_index: Callable[[], Any]) -> BackgroundIndexer:
        with cls._guard:
            inst = cls._instances.get(key)
            if inst is None:
                inst = cls._instances[key] = cls(make_index)
            return inst

    @classmethod
    def for_storage(cls, storage: Path) -> BackgroundIndexer:
        key = Path(storage).resolve()

        def make_index() -> Any:  # (on the thread: the index's modules and sqlite3 load there, not in the turn)
            from .sqlite_index import SqliteIndex

            return SqliteIndex(key)

        return cls._for(key, make_index)

    @classmethod
    def for_postgres(cls, dsn: str, schema: str) -> BackgroundIndexer:
        """The thread for a PostgreSQL schema's search tables (its own connection, pg_index.py)."""
        from .pg_index import PgIndex

        return cls._for(("postgres", dsn, schema), lambda: PgIndex(dsn, schema))

    def __init__(self, make_index: Callable[[], Any]) -> None:
        self._make_index = make_index
        self._pending: dict[str, Snapshot | None] = {}
        self._running: str | None = None
        self._last = 0.0  # (monotonic time of the last notification)
        self._since = 0.0  # (when the oldest pending work arrived)
        self._urgent: set[str] = set()  # (sessions a flush waits for: no quiet period)
        #: The callbacks of the coroutines ``wait`` suspended, by session: called when its work is done.
        self._waiters: dict[str, list[Callable[[], None]]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: The thread holds a connection to the index (from a catch-up's start until it closes it).
        self._connected = False
        self.errors: dict[str, str] = {}

    def notify(self, sid: str, snapshot: Snapshot | None) -> None:
        with self._cond:
            now = time.monotonic()
            if not self._pending:
                self._since = now
            self._last = now
            if snapshot is not None or sid not in self._pending:
                self._pending[sid] = snapshot
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="context-persistent-index", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, sid: str, timeout: float = 30.0) -> bool:
        """Wait until the session's notified work is done; False if it was not done in ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._cond:
            self._urgent.add(sid)
            self._cond.notify_all()
            while sid in self._pending or self._running == sid:
                left = end - time.monotonic()
                if left <= 0:
                    self._urgent.discard(sid)
                    return False
                self._cond.wait(left)
            self._urgent.discard(sid)
        return True

    async def wait(self, sid: str, timeout: float = 30.0) -> bool:
        """``flush`` for a coroutine: the same wait, on the event loop rather than on a thread of its executor
        (a CLI turn's close would start that executor, and its shutdown at exit, for this one wait)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # (called on the indexer's thread, with the condition held)
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody waits any more)
                loop.call_soon_threadsafe(_settle, done)

        with self._cond:
            if sid not in self._pending and self._running != sid:
                return True
            self._urgent.add(sid)
            self._waiters.setdefault(sid, []).append(wake)
            self._cond.notify_all()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._cond:
                waiters = self._waiters.get(sid, [])
                if wake in waiters:
                    waiters.remove(wake)
                if not waiters:
                    self._waiters.pop(sid, None)
                    self._urgent.discard(sid)

    async def leave(self, sid: str, timeout: float = 30.0) -> bool:
        """The close of a short-lived process (the Amplifier host's, docs/search.md): the session's work the
        thread has not begun is withdrawn and left to the next reader or writer, which catch up from the index's
        anchor; work it is doing, or any while it holds a connection to the index, is waited for as :meth:`wait`
        does (the thread then closes that connection: no write-ahead log is left for the next process). True
        when nothing of the session is left running."""
        with self._cond:
            if self._running != sid and not self._connected:
                self._pending.pop(sid, None)
                return True
        return await self.wait(sid, timeout)

    def _run(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        index: Any = None
        try:
            while True:
                with self._cond:
                    while True:
                        while not self._pending:
                            if not self._cond.wait(60.0):
                                if not self._pending:
                                    self._thread = None
                                    return
                        while self._pending and not self._urgent & self._pending.keys():
                            now = time.monotonic()
                            wait = min(self._last + QUIET, self._since + MAX_DELAY) - now
                            if wait <= 0:
                                break
                            self._cond.wait(wait)
                        if self._pending:  # (else all of it was withdrawn meanwhile: leave)
                            break
                    urgent = [s for s in self._pending if s in self._urgent]
                    sid = urgent[0] if urgent else next(iter(self._pending))
                    snapshot = self._pending.pop(sid)
                    self._since = time.monotonic()
                    self._running = sid
                    self._connected = True
                closed = False
                try:
                    if index is None:  # (the first work: the indexing side loads now, on this thread)
                        from .indexer import catch_up_session
                        from .sqlite_index import SqliteIndex

                        loop = asyncio.new_event_loop()
                        index = self._make_index()
                    assert loop is not None
                    loop.run_until_complete(catch_up_session(index, sid, snapshot=snapshot))
                    self.errors.pop(sid, None)
                    with self._cond:
                        idle = sid in self._urgent and not self._pending
                    if idle and isinstance(index, SqliteIndex):  # (a store's close waits: see the docstring)
                        index.close()
                        closed = True
                except Exception as e:
                    self.errors[sid] = str(e)
                    logger.warning("search index: could not index session %s (%s); a later append or search "
                                   "catches it up", sid, e)
                    if loop is not None and index is not None:
                        loop.run_until_complete(index.aclose())
                    closed = True
                finally:
                    with self._cond:
                        self._running = None
                        if closed:
                            self._connected = False
                        if sid not in self._pending:
                            for wake in self._waiters.pop(sid, ()):
                                wake()
                        self._cond.notify_all()
        finally:
            if loop is not None:
                if index is not None:
                    loop.run_until_complete(index.aclose())
                loop.close()
            with self._cond:
                self._connected = False


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
