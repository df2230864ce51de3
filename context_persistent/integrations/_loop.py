"""A private event-loop thread for an adapter's stores, callable from any thread or event loop.

The store's objects belong to the event loop that opened them; a framework may call an adapter from its
own loop, from another thread, or synchronously (LangGraph's ``invoke`` calls ``put`` from worker threads).
So an adapter runs its stores on one thread of its own and hands each call there: :meth:`LoopThread.call`
from async code, :meth:`LoopThread.call_sync` from sync code. Calls run in the order they were handed in.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import StoreClosedError

T = TypeVar("T")


async def settled(fut: "asyncio.Future[T]") -> T:
    """The outcome of a call running on the loop thread.

    If the caller is cancelled meanwhile, the call still runs to its end (a write is never left half done),
    and then the cancellation is raised.
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                cancelled = True
                continue
            if not cancelled:
                raise
        except BaseException:
            if not cancelled:
                raise
        else:
            if not cancelled:
                return result
        raise asyncio.CancelledError()


class LoopThread:
    """One daemon thread running an event loop, started on the first call; ``close(final)`` stops it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.closed = False

    def _submit(self, job: Callable[[], Coroutine[Any, Any, T]]) -> "Any":
        with self._lock:
            if self.closed:
                raise StoreClosedError(f"{self.name} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, daemon=True, name=self.name)
                thread.start()
                self._loop, self._thread = loop, thread
            return asyncio.run_coroutine_threadsafe(job(), self._loop)

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    async def call(self, job: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``await job()`` on the loop thread, without blocking the caller's loop."""
        if self.on_thread():
            return await job()
        return await settled(asyncio.wrap_future(self._submit(job)))

    def call_sync(self, job: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``job()`` run on the loop thread; blocks the calling thread until it is done."""
        if self.on_thread():
            raise RuntimeError(f"a synchronous call to {self.name} from its own loop would wait for itself")
        result: T = self._submit(job).result()
        return result

    def close(self, final: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Run ``final()`` on the thread (if it was started), then stop it (idempotent; blocks until done)."""
        if self.on_thread():
            raise RuntimeError(f"{self.name} cannot be closed from its own thread")
        with self._lock:
            if self.closed:
                return
            self.closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if final is not None:
                asyncio.run_coroutine_threadsafe(final(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


__all__ = ["LoopThread", "settled"]
