"""Events a host keeps in a session's log for its own state: writing them and reading them back.

A framework whose persistence is not a list of messages (LangGraph's checkpoints and pending writes) keeps
its records in the same log as the messages, as events of the types in ``events.HOST_EVENTS``. They change
no view (they are audit events for the projection, docs/format.md), so the store does not hold them in
memory: the host reads them back with :func:`read_host_events` (a read-only pass over the log, as
``context-persistent tail`` makes) and keeps what it needs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..model import events as ev
from ..storage.backends import open_log

if TYPE_CHECKING:
    from .manager import PersistentContextManager


def _check_type(type_: str) -> None:
    if type_ not in ev.HOST_EVENTS:
        raise ValueError(f"{type_!r} is not a host event type; allowed: {', '.join(sorted(ev.HOST_EVENTS))}")


async def record_host_event(store: "PersistentContextManager", type_: str, data: dict[str, Any]) -> int:
    """Append one host event to ``store``'s log; returns its seq once it is durable (the store's fsync policy)."""
    _check_type(type_)
    if not isinstance(data, dict):
        raise ValueError(f"host event data must be a dict, got {type(data).__name__}")
    return await store._commit(type_, data)


async def read_host_events(store: "PersistentContextManager", types: frozenset[str] = ev.HOST_EVENTS,
                           batch: int = 4096) -> AsyncIterator[dict[str, Any]]:
    """The records of ``types`` in ``store``'s log, oldest first, up to the head when called.

    Reads the log through a second, read-only handle (no lock), so the store keeps writing meanwhile; a
    corrupt record is LogCorruptedError, as on open.
    """
    for t in types:
        _check_type(t)
    head = store.head_seq
    log = await open_log(store.storage_path, store.session_id, store.config, readonly=True)
    try:
        async for records in log.read_batches(batch=batch):
            for rec in records:
                if rec["seq"] > head:
                    return
                if rec["type"] in types:
                    yield rec
    finally:
        await log.close()


__all__ = ["read_host_events", "record_host_event"]
