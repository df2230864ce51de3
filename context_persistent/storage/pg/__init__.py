"""The PostgreSQL backend (optional extra ``context-persistent[postgres]``, asyncpg), in layers:

- ``dsn``: the DSN and schema settings, and masking their passwords (pure);
- ``connection``: the driver, connecting, error translation, advisory-lock keys and channels;
- ``schema``: the tables, the layout version, creating them;
- ``log``: the event log (``PostgresEventLog``: append, read, follow, the writer lock and its takeover)
  and the checkpoint rows (``PostgresCheckpointStore``); ``settle``: an append whose connection was lost,
  found stored or refused; ``pages``, ``retention``, ``vacuum`` (the history read back by key, the ledger and
  trash tables, VACUUM after an erasure);
- ``admin``: the ``db`` commands and what ``ls``/``stats`` ask of a database.

Every name is importable from ``context_persistent.storage.pg`` itself. See docs/postgres.md.
"""

from .admin import init_schema, list_sessions, session_bytes, status
from .connection import (
    INSTALL_HINT,
    WRITER_KEEPALIVE,
    application_name,
    channel_of,
    connect,
    lock_key,
    require_asyncpg,
    translated,
)
from .dsn import DEFAULT_SCHEMA, ENV_DSN, ENV_SCHEMA, redact_dsn, resolve_dsn, resolve_schema, scrub
from .log import DEFAULT_TIMEOUT, RECONNECT_WINDOW, PostgresCheckpointStore, PostgresEventLog
from .schema import SCHEMA_VERSION, ensure_schema

__all__ = ["DEFAULT_SCHEMA", "DEFAULT_TIMEOUT", "ENV_DSN", "ENV_SCHEMA", "INSTALL_HINT", "PostgresCheckpointStore",
           "PostgresEventLog", "RECONNECT_WINDOW", "SCHEMA_VERSION", "WRITER_KEEPALIVE", "application_name",
           "channel_of", "connect", "ensure_schema", "init_schema", "list_sessions", "lock_key", "redact_dsn",
           "require_asyncpg", "resolve_dsn", "resolve_schema", "scrub", "session_bytes", "status", "translated"]
