"""The stores behind openai-agents sessions, shared by every session object on one session in a process.

openai-agents' own docs build a session object per request and never close it; ``SQLiteSession`` allows that.
Here every :class:`~context_persistent.integrations.openai_agents.PersistentSession` on the same storage and
session id in one process holds a reference to one :class:`SharedStore`: one store, on one event-loop thread.
The store closes (flushed, its lock released) when the last object is closed or garbage-collected, and at
interpreter exit; an object made after that opens it again, once the previous close has finished.

Two ways to hold the session's writer lock (``lock=``):

- ``"open"`` (the default): the process holds it from the first call until the store closes; a second
  *process* gets ``SessionLockedError``. The store stays in memory between calls.
- ``"call"``: each call opens the store, takes the lock (waiting up to ``lock_wait`` seconds while another
  process holds it), runs and closes it again, so several processes (a web server's workers) share one
  session. ``get_items`` opens read-only and takes no lock. Each call pays an open (the checkpoint and the log
  after it) and a close; calls of one process on one session run one at a time.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # noqa: F401  (imported now: at exit it would be too late, see _at_exit)
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import SessionLockedError, SessionNotFoundError, StoreClosedError
from ..store.manager import PersistentContextManager

T = TypeVar("T")
logger = logging.getLogger("context_persistent")

LockMode = Literal["open", "call"]
LOCK_MODES: tuple[str, ...] = ("open", "call")

#: Retry pauses while another process holds the lock (``lock="call"``): from the first to the longest, jittered.
_FIRST_PAUSE, _LONGEST_PAUSE = 0.002, 0.05


class SharedStore:
    """One session's store on a private event-loop thread, shared by the session objects that hold it."""

    def __init__(self, key: tuple[str, str], config: dict[str, Any], lock: LockMode, lock_wait: float,
                 after: threading.Event | None) -> None:
        self.storage_path, self.session_id = Path(key[0]), key[1]
        self.key = key
        self.config = config
        self.lock = lock
        self.lock_wait = lock_wait
        self.refs = 0
        self.closed = False
        self.done = threading.Event()  # set once the store is closed and the thread has stopped
        self._after = after  # the previous store of this key, still closing
        self._store: PersistentContextManager | None = None
        self._serial: asyncio.Lock | None = None
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the thread ---------------------------------------------------------------------------------
    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_forever()
        finally:
            loop.close()
            self._finished()

    def _finished(self) -> None:
        self.done.set()
        with _registry_lock:
            if _closing.get(self.key) is self:
                del _closing[self.key]

    def submit(self, job: Callable[[], Coroutine[Any, Any, T]]) -> "asyncio.Future[T]":
        """Start ``job()`` on the store's thread; a future in the caller's loop. Refused once closing began."""
        with self._guard:
            if self.closed:
                raise StoreClosedError(f"openai-agents session {self.session_id!r} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run_loop, args=(loop,), daemon=True,
                                                name=f"context-persistent session {self.session_id}")
                self._thread.start()
                self._loop = loop
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(job(), self._loop))

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def start(self, fn: Callable[[PersistentContextManager], Awaitable[T]], *, write: bool = True
              ) -> "asyncio.Future[T]":
        """Start ``fn(store)`` on the store's thread now; await the result with :func:`_loop.settled`.
        ``write=False``: the call only reads (``lock="call"`` opens read-only for it)."""
        if self.lock == "open":
            async def job() -> T:
                return await fn(await self._opened())
        else:
            if self.on_thread():
                raise RuntimeError("a session call from inside session.run() would wait for itself (lock='call'); "
                                   "use the store given to fn")

            async def job() -> T:
                return await self._call_locked(fn, write)
        return self.submit(job)

    # -- lock="open" -------------------------------------------------------------------------------
    async def _opened(self) -> PersistentContextManager:
        if self._store is None:
            await self._wait_for_previous()
            if self._store is None:  # (another call opened it meanwhile)
                self._store = await PersistentContextManager.open(storage_path=self.storage_path,
                                                                  session_id=self.session_id, **self.config)
        return self._store

    async def _wait_for_previous(self) -> None:
        after = self._after
        if after is not None and not after.is_set():
            await asyncio.to_thread(after.wait)
        self._after = None

    # -- lock="call" -------------------------------------------------------------------------------
    async def _call_locked(self, fn: Callable[[PersistentContextManager], Awaitable[T]], write: bool) -> T:
        if self._serial is None:
            self._serial = asyncio.Lock()
        async with self._serial:
            await self._wait_for_previous()
            if not write:
                try:
                    store = await PersistentContextManager.open(storage_path=self.storage_path,
                                                                session_id=self.session_id, readonly=True,
                                                                **self.config)
                except SessionNotFoundError:
                    store = None
                if store is None:  # (nothing written yet: read what an empty session holds)
                    store = await self._open_waiting()
            else:
                store = await self._open_waiting()
            try:
                return await fn(store)
            finally:
                await store.close()

    async def _open_waiting(self) -> PersistentContextManager:
        """Open the store for writing, waiting while another process holds its lock (up to ``lock_wait``)."""
        deadline = time.monotonic() + self.lock_wait
        pause = _FIRST_PAUSE
        while True:
            try:
                return await PersistentContextManager.open(storage_path=self.storage_path,
                                                           session_id=self.session_id, **self.config)
            except SessionLockedError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionLockedError(self.session_id, e.pid,
                                             f"(still held after waiting {self.lock_wait:g} s, lock='call')") from e
                await asyncio.sleep(min(left, pause * (0.5 + random.random())))
                pause = min(pause * 2, _LONGEST_PAUSE)

    # -- closing ------------------------------------------------------------------------------------
    def start_close(self) -> None:
        """Refuse new calls; close the store after the calls already queued, then stop the thread (no wait)."""
        with self._guard:
            if self.closed:
                return
            self.closed = True
            loop = self._loop
        if loop is None:  # (never used; its successor still waits for the store before it, if any)
            after = self._after
            if after is None or after.is_set():
                self._finished()
            else:
                def finish_after() -> None:
                    after.wait()
                    self._finished()

                threading.Thread(target=finish_after, daemon=True).start()
            return

        async def final() -> None:
            try:
                if self._serial is not None:
                    async with self._serial:  # (lock="call": the call in progress ends first)
                        pass
                if self._store is not None:
                    await self._store.close()
            except Exception:  # (nobody waits for this close but the exit hook: say what failed)
                logger.exception("openai-agents session %r: closing its store failed", self.session_id)
            finally:
                asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(final(), loop)


_registry: dict[tuple[str, str], SharedStore] = {}
_closing: dict[tuple[str, str], SharedStore] = {}
_registry_lock = threading.Lock()
_exit_hook = False


def acquire(storage_path: Path, session_id: str, config: dict[str, Any], lock: LockMode,
            lock_wait: float) -> SharedStore:
    """The shared store of this storage and session id (made if needed), with one more reference.

    ValueError if the session is already open in this process with other settings."""
    global _exit_hook
    key = (str(storage_path.expanduser().resolve()), session_id)
    with _registry_lock:
        entry = _registry.get(key)
        if entry is not None and entry.closed:  # (released meanwhile: its close has begun)
            entry = None
        if entry is not None and (entry.config != config or entry.lock != lock or entry.lock_wait != lock_wait):
            raise ValueError(
                f"openai-agents session {session_id!r} in {key[0]} is already open in this process with other "
                f"settings (lock={entry.lock!r}, lock_wait={entry.lock_wait!r}, {entry.config!r}); every session "
                "object on one session shares one store, so give them the same settings")
        if entry is None:
            previous = _closing.get(key) or _registry.get(key)
            entry = _registry[key] = SharedStore(key, dict(config), lock, lock_wait,
                                                 None if previous is None else previous.done)
            if not _exit_hook:
                _at_exit(close_all)
                _exit_hook = True
        entry.refs += 1
        return entry


def release(entry: SharedStore, wait: bool) -> None:
    """Drop one reference; the last one closes the store (``wait``: and blocks until it is closed)."""
    with _registry_lock:
        entry.refs -= 1
        if entry.refs > 0:
            return
        if _registry.get(entry.key) is entry:
            del _registry[entry.key]
        _closing[entry.key] = entry
    entry.start_close()
    if wait:
        entry.done.wait()


def release_later(entry: SharedStore) -> None:
    """:func:`release` from another thread: for a session object's finalizer, which may run inside any code of
    this thread (a garbage collection), even while it holds the registry's lock."""
    try:
        threading.Thread(target=release, args=(entry, False), name="context-persistent release").start()
    except RuntimeError:  # (the interpreter is shutting down: close_all closes the store)
        pass


def _at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit while threads can still be used: before ``concurrent.futures`` refuses new
    work (which ``asyncio.to_thread`` in a store's close needs), as ``threading._register_atexit`` hooks run
    first; plain ``atexit`` where that hook is missing."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
    else:
        register(fn)


def close_all() -> None:
    """Close every shared store and wait for them (at interpreter exit: nothing acknowledged is left unsynced)."""
    with _registry_lock:
        entries = list(_registry.values()) + list(_closing.values())
        for entry in list(_registry.values()):
            _closing[entry.key] = entry
        _registry.clear()
    for entry in entries:
        entry.start_close()
    for entry in entries:
        entry.done.wait()


def open_count() -> int:
    """How many shared stores are open or closing in this process (for tests and diagnostics)."""
    with _registry_lock:
        return len(_registry) + len(_closing)


__all__ = ["LOCK_MODES", "LockMode", "SharedStore", "acquire", "close_all", "open_count", "release", "release_later"]
