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
durable single-record append: see ``PersistentContextManager.add_messages``). The store runs on a private
event-loop thread, so the session can be used from any event loop or thread (``Runner.run``, ``run_sync`` and
``run_streamed`` alike). Every session object on one session in a process shares that store
(integrations/shared_stores.py): a new object per request works, closed or not. With the default
``lock="open"`` one process at a time writes a session (a second process gets ``SessionLockedError`` on its
first call); with ``lock="call"`` each call takes the lock for its own duration, so several processes can.
``close()`` (or ``await aclose()``, or ``async with``) gives the object's share back; the last one closes
the store and releases the session.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from agents.memory.session_settings import SessionSettings, coerce_session_settings, resolve_session_limit

from ..errors import StoreClosedError
from ..model.events import ROLES
from ..store.manager import PersistentContextManager
from ..storage.paths import validate_session_id
from . import shared_stores
from ._loop import settled
from .shared_stores import LOCK_MODES, LockMode

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


class PersistentSession:
    """An openai-agents session stored in ``<storage_path>/<session_id>/events.jsonl``.

    ``PersistentSession(session_id, storage_path, session_settings=None, lock="open", lock_wait=10.0,
    **config)``: ``config`` takes the store's configuration keys (docs/configuration.md), for example
    ``fsync="batch"`` or ``backend="postgres"``. Every object on the same storage and session id in one process
    shares one open store (closed with the last object, or when the last one is garbage-collected, or at
    exit): a new object per request, never closed, works. ``lock="call"``: each call takes the session's lock
    for its own duration (waiting up to ``lock_wait`` seconds), so several processes share a session
    (integrations/shared_stores.py). Opening is deferred to the first call; bad arguments are refused here.
    """

    def __init__(self, session_id: str, storage_path: str | os.PathLike[str], *,
                 session_settings: SessionSettings | dict[str, Any] | None = None, lock: LockMode = "open",
                 lock_wait: float = 10.0, **config: Any) -> None:
        validate_session_id(session_id)
        if config.get("recognise_replay", False) is not False:
            raise ValueError("recognise_replay is not available for openai-agents sessions: add_items always "
                             "stores what it is given (openai-agents never replays a saved history)")
        if lock not in LOCK_MODES:
            raise ValueError(f"lock must be one of {', '.join(map(repr, LOCK_MODES))}, got {lock!r}")
        if isinstance(lock_wait, bool) or not isinstance(lock_wait, (int, float)) or not 0 <= lock_wait < 1e9:
            raise ValueError(f"lock_wait must be a number of seconds >= 0, got {lock_wait!r}")
        if config.get("readonly"):
            raise ValueError("readonly is not available for openai-agents sessions (a session writes)")
        config["recognise_replay"] = False
        PersistentContextManager.check_config(dict(config))  # a bad key or value fails now, not on first use
        self.session_id = session_id
        self.storage_path = Path(storage_path).expanduser()
        self.session_settings: SessionSettings | None = (
            SessionSettings() if session_settings is None else coerce_session_settings(session_settings))
        self._lock = threading.Lock()
        self._closed = False
        self._shared = shared_stores.acquire(self.storage_path, session_id, config, lock, float(lock_wait))
        # An object dropped without close() gives its reference back when it is collected.
        self._finalizer = weakref.finalize(self, shared_stores.release_later, self._shared)
        self._finalizer.atexit = False  # (at exit, shared_stores.close_all closes every store and waits)

    # -- the shared store ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"openai-agents session {self.session_id!r} is closed")

    async def _call(self, fn: Callable[[PersistentContextManager], Awaitable[T]], write: bool = True) -> T:
        """Run ``fn(store)`` on the store's thread and wait for it without blocking the caller's loop."""
        with self._lock:  # (a call is either refused or queued ahead of this object's close)
            self._check_open()
            fut = self._shared.start(fn, write=write)
        return await settled(fut)

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

        return await self._call(read, write=False)

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
        """Give this object's reference back; the last one flushes and closes the store and stops its thread
        (idempotent; blocks until this object's part is done)."""
        if self._shared.on_thread():
            raise RuntimeError("close() was called from inside session.run(); close the session after it returns")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._finalizer.detach() is not None:
            shared_stores.release(self._shared, wait=True)

    async def aclose(self) -> None:
        """``close()`` without blocking the caller's event loop."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "PersistentSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<PersistentSession {self.session_id!r} storage={str(self.storage_path)!r}>"
