"""The viewer's search: the search projection (operations/search, docs/search.md) behind the viewer's
``SearchProvider`` hook, without writing to the storage.

A file storage is searched through an index of the viewer's own, in a private temporary folder (0700) kept
while the viewer runs: it is built from the logs on the first search and caught up from each session's last
indexed record on every later one, like the storage's own index, which the viewer never writes. A PostgreSQL
schema is searched in the search tables its writers keep current, read only (no catch-up; a hit its log
disagrees with is left out).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from .source import Source


class ProjectionSearch:
    """Search hits from the search projection, as the viewer's ``/api/search`` returns them."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._folder: Path | None = None

    def _index_path(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="context-persistent-viewer-index-"))  # (created 0700)
        return self._folder / "index.sqlite3"

    async def search(self, query: str, *, limit: int) -> list[dict[str, Any]]:
        from ..operations.search import search

        backend = self.source.backend
        if backend.get("backend") == "postgres":
            hits = await search(None, query, limit=limit, dsn=backend["dsn"], pg_schema=backend.get("pg_schema"),
                                read_only=True)
        else:
            hits = await search(self.source.storage, query, limit=limit, index_path=self._index_path())
        return [h.to_json() for h in hits]

    def close(self) -> None:
        """Remove the viewer's own index (at exit)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


__all__ = ["ProjectionSearch"]
