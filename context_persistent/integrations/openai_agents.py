"""An openai-agents ``Session`` whose items live in the event log: :class:`PersistentSession`.

openai-agents (``pip install 'context-persistent[openai-agents]'``) keeps a conversation in a *session*: an
object with ``session_id``, ``session_settings`` and four async methods, ``get_items(limit)``,
``add_items(items)``, ``pop_item()`` and ``clear_session()``. This one stores the items (Responses input
items: messages, function calls and their outputs, reasoning items, anything JSON) in the session's event
log, one ``message_added`` event each, and gives them back exactly as they were added:

- an item with a chat role (``user``, ``assistant``, ``system``, ``developer``, ...) is stored as it is;
- any other item (``function_call``, ``function_call_output``, ``reasoning``, ``compaction``, ...) is
  stored as a message that carries the item whole under ``"openai_agents_item"``, with a role and the
  fields the store's views and token counts understand (``tool_calls`` for a function call, ``role: tool``
  and ``tool_call_id`` for its output);
- ``pop_item`` writes a ``redacted`` event (the item leaves every view, the log keeps its bytes),
  ``clear_session`` a ``cleared`` event: nothing is deleted from the log.

``add_items`` returns once its items are durable (with the default ``fsync="always"``, each item is a
durable single-record append: see ``PersistentContextManager.add_messages``). The store runs on a private event-loop thread of the session, so the session
can be used from any event loop or thread (``Runner.run``, ``run_sync`` and ``run_streamed`` alike), and
calls through one session object are serialised. One process at a time may write a session: a second
writer gets ``SessionLockedError`` on its first call. Close the session with ``close()`` (or
``await aclose()``, or ``async with``) to release it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from agents.memory.session_settings import SessionSettings, coerce_session_settings, resolve_session_limit

from ..errors import StoreClosedError
from ..model.events import ROLES
from ..store.manager import PersistentContextManager
from ..storage.paths import validate_session_id

__all__ = ["ITEM_KEY", "PersistentSession", "item_from_message", "message_from_item"]

T = TypeVar("T")

#: The key under which an item without a chat role is kept whole in its stored message.
ITEM_KEY = "openai_agents_item"

_ROLES = frozenset(ROLES)


def _text(value: Any) -> str | None:
    """Readable text of an item part, for the store's views and token counts (not used to rebuild the item)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = [p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(texts) if texts else None
    return None


def message_from_item(item: Any, where: str = "item") -> dict[str, Any]:
    """The message stored for one openai-agents item (see the module docstring)."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be a dict (a Responses input item), got {type(item).__name__}")
    if item.get("role") in _ROLES and ITEM_KEY not in item:
        return item
    kind = item.get("type")
    message: dict[str, Any]
    if kind == "function_call":
        message = {"role": "assistant", "content": None,
                   "tool_calls": [{"id": item.get("call_id"), "type": "function",
                                   "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]}
    elif isinstance(kind, str) and (kind.endswith("_output") or kind.endswith("_response")):
        output = item.get("output")
        message = {"role": "tool", "content": output if isinstance(output, str) else _text(output)}
        if "call_id" in item:
            message["tool_call_id"] = item["call_id"]
    elif kind == "reasoning":
        message = {"role": "assistant", "content": _text(item.get("summary"))}
    else:
        message = {"role": "assistant", "content": _text(item.get("content"))}
    message[ITEM_KEY] = item
    return message


def item_from_message(message: dict[str, Any]) -> Any:
    """The item a stored message holds (the inverse of :func:`message_from_item`)."""
    return message[ITEM_KEY] if ITEM_KEY in message else message


async def _settled(fut: asyncio.Future[T]) -> T:
    """The outcome of a call running on the session's thread.

    If the caller is cancelled meanwhile, the call still runs to its end (a write is not left half done), and
    then the cancellation is raised, hiding any error of the call (as openai-agents' own sessions do).
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


class PersistentSession:
    """An openai-agents session stored in ``<storage_path>/<session_id>/events.jsonl``.

    ``PersistentSession(session_id, storage_path, session_settings=None, **config)``: ``config`` takes the
    store's configuration keys (docs/configuration.md), for example ``fsync="batch"`` or
    ``backend="postgres"``. Opening is deferred to the first call; bad arguments are refused here.
    """

    def __init__(self, session_id: str, storage_path: str | os.PathLike[str], *,
                 session_settings: SessionSettings | dict[str, Any] | None = None, **config: Any) -> None:
        validate_session_id(session_id)
        if config.get("recognise_replay", False) is not False:
            raise ValueError("recognise_replay is not available for openai-agents sessions: add_items always "
                             "stores what it is given (openai-agents never replays a saved history)")
        config["recognise_replay"] = False
        PersistentContextManager.check_config(dict(config))  # a bad key or value fails now, not on first use
        self.session_id = session_id
        self.storage_path = Path(storage_path).expanduser()
        self.session_settings: SessionSettings | None = (
            SessionSettings() if session_settings is None else coerce_session_settings(session_settings))
        self._config = config
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._store: PersistentContextManager | None = None
        self._closed = False

    # -- the session's thread -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"openai-agents session {self.session_id!r} is closed")

    def _submit(self, job: Callable[[], Coroutine[Any, Any, T]]) -> "asyncio.Future[T]":
        """Start ``job()`` on the session's thread (starting the thread if needed); a future in the caller's loop.

        Under the lock that ``close()`` takes: a job is either refused or queued ahead of the close.
        """
        with self._lock:
            self._check_open()
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, daemon=True,
                                          name=f"context-persistent session {self.session_id}")
                thread.start()
                self._loop, self._thread = loop, thread
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(job(), self._loop))

    async def _open_store(self) -> PersistentContextManager:
        if self._store is None:
            self._store = await PersistentContextManager.open(storage_path=self.storage_path,
                                                              session_id=self.session_id, **self._config)
        return self._store

    async def _call(self, fn: Callable[[PersistentContextManager], Awaitable[T]]) -> T:
        """Run ``fn(store)`` on the session's thread and wait for it without blocking the caller's loop."""
        async def job() -> T:
            return await fn(await self._open_store())

        return await _settled(self._submit(job))

    # -- the openai-agents session protocol -----------------------------------------------------------
    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The items in order; ``limit`` (else ``session_settings.limit``): only the newest N.

        As with openai-agents' ``SQLiteSession``, a limit of 0 gives no items and a negative one all of them.
        """
        n = resolve_session_limit(limit, self.session_settings)
        last = None if n is None or n < 0 else n

        async def read(store: PersistentContextManager) -> list[Any]:
            # The copy of a long history allocates many containers, all acyclic: the cyclic GC would scan the
            # whole heap again and again for nothing (4x the copy's time at 20,000 items). Paused, as the
            # store's replay does.
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                return [item_from_message(m) for m in await store.get_messages(last=last)]
            finally:
                if gc_was_enabled:
                    gc.enable()

        return await self._call(read)

    async def add_items(self, items: list[Any]) -> None:
        """Append the items; returns once they are durable. A bad item (ValueError) stores none of them."""
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"items must be a list of Responses input items, got {type(items).__name__}")
        messages = [message_from_item(item, f"items[{i}]") for i, item in enumerate(items)]
        if not messages:
            self._check_open()  # (a closed session refuses even an empty list)
            return

        async def write(store: PersistentContextManager) -> None:
            await store.add_messages(messages)

        await self._call(write)

    async def pop_item(self) -> Any | None:
        """Remove the newest item from the session (a ``redacted`` event) and return it; None if empty.
        Concurrent calls each remove and return a different item."""
        async def pop(store: PersistentContextManager) -> Any | None:
            newest = await store.pop_message()
            return None if newest is None else item_from_message(newest)

        return await self._call(pop)

    async def clear_session(self) -> None:
        """Empty the session (a ``cleared`` event; the log keeps what was there)."""
        async def clear(store: PersistentContextManager) -> None:
            await store.clear()

        await self._call(clear)

    # -- beyond the protocol --------------------------------------------------------------------------
    async def record_usage(self, result: Any, *, provider: str | None = "openai") -> int:
        """Record what the model reported for a run: ``result`` is a ``RunResult`` (each of its
        ``raw_responses``, by ``response_id``: recording a run twice counts it once), a ``ModelResponse`` or a
        ``Usage``. Returns the number of reports written (docs/integrations.md, "Usage")."""
        from .usage_of import openai_agents_reports

        reports = openai_agents_reports(result)

        async def record(store: PersistentContextManager) -> int:
            done = 0
            for usage, kw in reports:
                done += await store.record_usage(usage, provider=provider, source="openai-agents", **kw) is not None
            return done

        return await self._call(record)

    async def run(self, fn: Callable[[PersistentContextManager], Awaitable[T]]) -> T:
        """``await fn(store)`` on the session's thread: the underlying store, for its views, ``stats()``, ``export``.

        For example ``await session.run(lambda store: store.get_reasoning_view())``. The store belongs to that
        thread's event loop: use it only inside ``fn``.
        """
        return await self._call(fn)

    def close(self) -> None:
        """Flush and release the session, and stop its thread (idempotent; blocks until done)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("close() was called from inside session.run(); close the session after it returns")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if self._store is not None:
                asyncio.run_coroutine_threadsafe(self._store.close(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    async def aclose(self) -> None:
        """``close()`` without blocking the caller's event loop."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "PersistentSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<PersistentSession {self.session_id!r} storage={str(self.storage_path)!r}>"
