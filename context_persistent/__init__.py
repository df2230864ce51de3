"""context-persistent: an event-sourced, crash-safe context store for long-running LLM agents.

Also a drop-in Amplifier ``context`` module (entry point ``context-persistent`` → :func:`mount`).
"""

from __future__ import annotations

from .errors import (
    ConcurrencyError,
    ContextPersistentError,
    DatabaseError,
    InvalidRecordError,
    LedgerError,
    LogChangedError,
    LogCorruptedError,
    LogWriteError,
    MalformedInputError,
    ReadOnlyError,
    RecordCorruptedError,
    RecordsExpiredError,
    SessionExistsError,
    SessionLockedError,
    SessionNotFoundError,
    SessionTrashedError,
    StoreClosedError,
    UnsafeStorageError,
    UnsupportedFormatError,
)
from .store.manager import PersistentContextManager
from .integrations.amplifier import mount


def __getattr__(name: str) -> object:
    # import_ pulls in the snapshot machinery (transfer.py) (aiofiles and the formats): load it on first use.
    if name == "import_":
        from .store.importing import import_

        return import_
    if name == "read_usage":
        from .store.usage_read import read_usage

        return read_usage
    if name in ("search", "list_sessions", "SearchHit", "SearchResults", "QueryError"):  # (the search index)
        from .operations import search

        return getattr(search, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "ConcurrencyError",
    "ContextPersistentError",
    "DatabaseError",
    "InvalidRecordError",
    "LedgerError",
    "LogChangedError",
    "LogCorruptedError",
    "LogWriteError",
    "MalformedInputError",
    "PersistentContextManager",
    "QueryError",
    "ReadOnlyError",
    "RecordCorruptedError",
    "RecordsExpiredError",
    "SearchHit",
    "SearchResults",
    "SessionExistsError",
    "SessionLockedError",
    "SessionNotFoundError",
    "SessionTrashedError",
    "StoreClosedError",
    "UnsafeStorageError",
    "UnsupportedFormatError",
    "__version__",
    "import_",
    "list_sessions",
    "mount",
    "read_usage",
    "search",
]
