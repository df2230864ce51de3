"""The two backends of the search index behind one interface, for the tests that run on both (test_search.py,
test_search_postgres.py): open a session, trash and restore, catch the index up, rebuild it, search, list."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager, list_sessions, search
from context_persistent.model.retention import RetentionPolicy
from context_persistent.operations import trash
from context_persistent.operations.search.indexer import catch_up_storage, rebuild, rebuild_pg
from context_persistent.operations.search.pg_index import PgIndex
from context_persistent.operations.search.sqlite_index import SqliteIndex


class FileBackend:
    name = "file"

    def __init__(self, storage: Path) -> None:
        self.storage = storage
        self.where: dict[str, Any] = {}

    async def open(self, sid: str, **config: Any) -> PersistentContextManager:
        return await PersistentContextManager.open(storage_path=self.storage, session_id=sid, **config)

    async def has(self, sid: str) -> bool:
        return (self.storage / sid).exists()

    async def trash(self, policy: RetentionPolicy) -> None:
        await trash.apply_file(self.storage, policy)

    async def restore_one(self) -> bool:
        entries = await trash.list_trash(self.storage) if trash.trash_dir(self.storage).exists() else []
        if entries:
            await trash.restore(self.storage, entries[0]["entry"])
        return bool(entries)

    async def caught_up(self) -> dict[str, Any]:
        index = SqliteIndex(self.storage)
        try:
            await catch_up_storage(index)
            return index.contents()
        finally:
            index.close()

    async def rebuilt(self) -> dict[str, Any]:
        await rebuild(self.storage)
        index = SqliteIndex(self.storage)
        try:
            return index.contents()
        finally:
            index.close()

    async def search(self, query: str, **kw: Any) -> list[Any]:
        return await search(self.storage, query, **kw)

    async def list(self) -> list[dict[str, Any]]:
        return await list_sessions(self.storage)


class PgBackend:
    name = "postgres"

    def __init__(self, dsn: str, schema: str, tmp: Path) -> None:
        self.dsn, self.schema, self.tmp = dsn, schema, tmp
        self.where = {"dsn": dsn, "pg_schema": schema}

    async def open(self, sid: str, **config: Any) -> PersistentContextManager:
        return await PersistentContextManager.open(storage_path=self.tmp, session_id=sid, backend="postgres",
                                                   **self.where, **config)

    async def has(self, sid: str) -> bool:
        from context_persistent.storage.pg import list_sessions as pg_sessions

        return sid in {r["session_id"] for r in await pg_sessions(self.dsn, self.schema)}

    async def trash(self, policy: RetentionPolicy) -> None:
        from context_persistent.storage.pg.retention import apply_pg

        await apply_pg(self.dsn, self.schema, policy)

    async def restore_one(self) -> bool:
        from context_persistent.storage.pg.retention import list_trash_pg, restore_pg

        entries = await list_trash_pg(self.dsn, self.schema)
        if entries:
            await restore_pg(self.dsn, self.schema, entries[0]["entry"])
        return bool(entries)

    async def _contents(self, catch_up: bool) -> dict[str, Any]:
        index = PgIndex(self.dsn, self.schema)
        try:
            if catch_up:
                await catch_up_storage(index)
            return await index.contents()
        finally:
            await index.aclose()

    async def caught_up(self) -> dict[str, Any]:
        return await self._contents(True)

    async def rebuilt(self) -> dict[str, Any]:
        await rebuild_pg(self.dsn, self.schema)
        return await self._contents(False)

    async def search(self, query: str, **kw: Any) -> list[Any]:
        return await search(None, query, **self.where, **kw)

    async def list(self) -> list[dict[str, Any]]:
        return await list_sessions(None, **self.where)


def fresh_schema() -> str:
    """A schema name of its own for one test (retention policies act on every session of a schema)."""
    return f"cp_search_{uuid.uuid4().hex[:10]}"
