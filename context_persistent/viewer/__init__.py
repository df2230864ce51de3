"""The viewer: a local, read-only web app that shows the sessions of a storage folder or a PostgreSQL schema
(``context-persistent serve``, docs/viewer.md).

May import: integrations, store, transfer, operations, storage, model and errors (a host, like the command
line, which alone sits above it); nothing below imports it. Checked by import-linter (``.importlinter``). It
never writes to the storage nor takes a session's writer lock (every session is
opened ``readonly=True``). Its web dependencies (Starlette, uvicorn) are the optional extra ``[viewer]``:
``source``, ``timeline``, ``views`` and ``shaping`` import none of them, ``app`` and ``server`` do.
"""

from __future__ import annotations

from .extensions import Extensions, SearchProvider, UsageProvider

__all__ = ["Extensions", "SearchProvider", "UsageProvider"]
