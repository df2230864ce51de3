"""Where the viewer reads sessions from: a storage folder or a PostgreSQL schema, every session opened
read-only (no writer lock, nothing written), a few kept open between requests.

A read-only store sees the log as it was when it opened. The viewer keeps it while the log does not change
(the file backend compares the log files' size and modification time; PostgreSQL its last seq) and opens
a fresh one when it did, so every page shows the session as it is now, at the cost of opening it again
(a checkpoint's front section and the log after it: docs/architecture.md, "Lazy open").

The request view of a long session is built from its newest messages and the system messages the lazily
opened history lists (compaction/window.py); once a page from the middle or the token chart has loaded the
rest of the history's refs, that list is gone and a rebuild scans the history. So request views get a
store of their own (``purpose="request"``), which pages never touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..storage.paths import LOG_NAME, validate_session_id
from .timeline import MarkIndex

#: Messages a viewer's store keeps parsed in its page cache (each store; a writer's default is 32 MiB).
PAGE_CACHE_BYTES = 8 << 20
#: Stores kept open (at the head, and as of a past seq for time travel).
MAX_OPEN, MAX_PAST = 6, 4


@dataclass(slots=True)
class _Entry:
    store: Any
    signature: Any
    users: int = 0
    retired: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Source:
    """The sessions of one storage folder (``storage``) or, with ``backend`` ``{"backend": "postgres",
    "dsn": ..., "pg_schema": ...}``, of one PostgreSQL schema. Every open is read-only."""

    def __init__(self, storage: str | os.PathLike[str], backend: dict[str, Any] | None = None) -> None:
        self.storage = Path(storage).expanduser()
        self.backend = dict(backend or {})
        self.config: dict[str, Any] = {**self.backend, "page_cache_bytes": PAGE_CACHE_BYTES}
        self._open: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._past: OrderedDict[tuple[str, int, str], _Entry] = OrderedDict()
        self._rows: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: The notable events of each session looked at (timeline.py), shared by the API and time travel.
        self.marks = MarkIndex()

    @property
    def is_postgres(self) -> bool:
        return self.backend.get("backend") == "postgres"

    def describe(self) -> str:
        """What is shown (a storage folder, or the redacted DSN and schema)."""
        if self.is_postgres:
            from ..storage.pg import redact_dsn, resolve_schema

            return f"{redact_dsn(self.backend['dsn'])} schema {resolve_schema(self.backend.get('pg_schema'))}"
        return str(self.storage)

    # -- which sessions -------------------------------------------------------------------------------
    async def session_ids(self) -> list[str]:
        """The ids of the sessions, sorted (folders whose name starts with a dot are not sessions)."""
        if self.is_postgres:
            return [r["session_id"] for r in await self._pg_rows()]
        from ..storage.segments import has_log

        if not self.storage.is_dir():
            return []
        return sorted(d.name for d in self.storage.iterdir() if not d.name.startswith(".") and has_log(d))

    async def _pg_rows(self) -> list[dict[str, Any]]:
        from ..storage import pg

        return await pg.list_sessions(self.backend.get("dsn"), self.backend.get("pg_schema"))

    async def signature(self, session_id: str) -> Any:
        """Something that changes whenever the session's log does: the stat of its files, or its last seq."""
        validate_session_id(session_id)
        if self.is_postgres:
            for row in await self._pg_rows():
                if row["session_id"] == session_id:
                    return row["last_seq"]
            return None
        folder = self.storage / session_id
        out: list[tuple[int, int, int] | None] = []
        for name in (LOG_NAME, "segments.json"):
            try:
                st = os.stat(folder / name)
            except FileNotFoundError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    # -- stores ---------------------------------------------------------------------------------------
    async def _open_store(self, session_id: str) -> Any:
        from ..store.manager import PersistentContextManager

        return await PersistentContextManager.open(storage_path=self.storage, session_id=session_id, readonly=True,
                                                   **self.config)

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def store(self, session_id: str, purpose: str = "pages") -> AsyncIterator[Any]:
        """A read-only store of the session as it is now (SessionNotFoundError if there is none; ValueError for
        an id that is not a session id, so no path outside the storage is ever opened). Each ``purpose``
        (``pages``, ``request``) has a store of its own (see the module's docstring)."""
        validate_session_id(session_id)
        key = (session_id, purpose)
        async with self._lock(f"{session_id}\x00{purpose}"):
            sig = await self.signature(session_id)
            entry = self._open.get(key)
            if entry is None or entry.signature != sig:
                if entry is not None:
                    await self._retire(self._open.pop(key))
                entry = _Entry(await self._open_store(session_id), sig)
                self._open[key] = entry
                while len(self._open) > MAX_OPEN:
                    await self._retire(self._open.popitem(last=False)[1])
            self._open.move_to_end(key)
            entry.users += 1
        try:
            yield entry.store
        finally:
            entry.users -= 1
            if entry.retired and entry.users == 0:
                await entry.store.close()

    @contextlib.asynccontextmanager
    async def store_at(self, session_id: str, seq: int | None, purpose: str = "pages") -> AsyncIterator[Any]:
        """The session as it was right after event ``seq`` (a read-only store), or as it is now when ``seq`` is
        None or the head. ValueError for a seq outside 1..head. The past state is cut from the head's when
        only appends and audit records came after ``seq`` (past.py), else replayed from the log."""
        async with self.store(session_id, purpose) as head:
            if seq is None or seq == head.head_seq:
                yield head
                return
            key = (session_id, seq, purpose)
            async with self._lock(f"{session_id}\x00past"):
                entry = self._past.get(key)
                if entry is None:
                    entry = _Entry(await self._past_store(session_id, seq, head), None)
                    self._past[key] = entry
                    while len(self._past) > MAX_PAST:
                        await self._retire(self._past.popitem(last=False)[1])
                self._past.move_to_end(key)
                entry.users += 1
            try:
                yield entry.store
            finally:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    await entry.store.close()

    async def _past_store(self, session_id: str, seq: int, head: Any) -> Any:
        """A store of the past state at ``seq``: cut from the session's pages store (its history loads in full
        once; a request store's stays lazy), lazy for the request view when ``head`` lists its system
        messages, or else replayed by ``head.at``."""
        from .past import appends_only, listed_system_indices, open_cut

        system = listed_system_indices(head)
        async with self.store(session_id) as pages:
            if pages.head_seq == head.head_seq:
                marks = None if appends_only(pages._state) else await self.marks.of(self, session_id)
                past = await open_cut(pages, seq, marks, system)
                if past is not None:
                    return past
        return await head.at(seq)

    async def _retire(self, entry: _Entry) -> None:
        entry.retired = True
        if entry.users == 0:
            await entry.store.close()

    async def close(self) -> None:
        """Close every store kept open (one in use is closed when its request ends)."""
        entries = list(self._open.values()) + list(self._past.values())
        self._open.clear()
        self._past.clear()
        for entry in entries:
            await self._retire(entry)

    @contextlib.asynccontextmanager
    async def log(self, session_id: str) -> AsyncIterator[Any]:
        """The session's event log, opened read-only (for reading records by seq, or following it)."""
        from ..storage.backends import open_log
        from ..store.manager import PersistentContextManager

        validate_session_id(session_id)
        cfg = PersistentContextManager.check_config(self.backend)
        log = await open_log(self.storage, session_id, cfg, readonly=True, create=False)
        try:
            yield log
        finally:
            await log.close()

    # -- the sessions page ----------------------------------------------------------------------------
    async def listing(self) -> list[dict[str, Any]]:
        """One row per session: messages, events, bytes, last activity, parent (a row is reused while its log
        does not change). A session that cannot be read has an ``error`` and is still listed."""
        rows = []
        ids = await self.session_ids()
        for sid in ids:
            try:
                sig = await self.signature(sid)
                known = self._rows.get(sid)
                if known is None or known[0] != sig:
                    known = (sig, await self._row(sid))
                    self._rows[sid] = known
                rows.append(known[1])
            except Exception as e:  # one unreadable session must not hide the others
                rows.append({"session_id": sid, "error": f"{type(e).__name__}: {e}"})
        for gone in set(self._rows) - set(ids):
            del self._rows[gone]
        return rows

    async def _row(self, session_id: str) -> dict[str, Any]:
        async with self.store(session_id) as store:
            session = store._state.session
            row: dict[str, Any] = {
                "session_id": session_id, "messages": len(store._state.messages), "events": store.head_seq,
                "bytes": _log_bytes(store._log), "parent": session.get("parent"),
                "imported": (session.get("imported") or {}).get("source"),
                "created": None, "last_activity": None,
            }
        async with self.log(session_id) as log:
            row["last_activity"] = await last_timestamp(log)
            row["created"] = await first_timestamp(log)
        return row


def _log_bytes(log: Any) -> int | None:
    size = getattr(log, "size", None)
    return None if size is None else int(size) + int(getattr(log, "base", 0))


async def last_timestamp(log: Any) -> str | None:
    """The ``ts`` of the log's last record (file logs: read from the end; PostgreSQL: by its last seq)."""
    record_before = getattr(log, "record_before", None)
    if record_before is not None:
        rec = record_before(log.position)
        return None if rec is None else str(rec.get("ts"))
    last = getattr(log, "position", 0)
    if isinstance(last, int) and last > 0:
        async for batch in log.read_batches(after_seq=last - 1):
            return str(batch[-1].get("ts")) if batch else None
    return None


async def first_timestamp(log: Any) -> str | None:
    """The ``ts`` of the log's first record (one batch read, then the reading stops)."""
    batches = log.read_batches(batch=1)
    try:
        async for batch in batches:
            return str(batch[0].get("ts")) if batch else None
    finally:
        await batches.aclose()
    return None
