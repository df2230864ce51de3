"""The storage boundary: the small protocol every event-log backend implements.

Everything above it (projection, views, compaction, export, fork) works unchanged on any backend. A
backend stores encoded records (see codec.py: the same envelope and checksum everywhere) and hands back
parsed records. It decides no policy: the manager decides what to write, the backend only makes it durable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EventLog(Protocol):
    """An append-only, per-session sequence of records with strictly increasing ``seq``."""

    session_id: str
    readonly: bool
    #: True when the session existed before this log was opened.
    existed: bool
    #: Highest seq known to be in the log (after reading or appending).
    last_seq: int
    #: The ``crc`` of the record at ``last_seq`` once read or appended (None for an empty log): the next
    #: record's ``prev`` (codec.Links). A backend checks every record's ``prev`` as it reads.
    last_crc: bytes | None
    #: Where the log lives, for messages: a Path for files, a description (DSN without password) otherwise.
    path: Any

    def read_batches(self, after_seq: int = 0, position: int | None = None,
                     batch: int = 4096) -> AsyncIterator[list[dict[str, Any]]]:
        """Valid records with ``seq > after_seq``, in order, in lists of up to ``batch``.

        ``position`` is a backend hint saved in checkpoints (the byte offset after ``after_seq`` for files);
        a backend must verify it and fall back to a full read, never return a wrong record. Raises
        LogCorruptedError for a bad record that is not the last one.
        """
        ...

    @property
    def position(self) -> int:
        """The backend hint for "right after ``last_seq``" (see ``read_batches``)."""
        ...

    async def append(self, lines: Sequence[bytes], first_seq: int) -> None:
        """Durably append encoded records whose seqs run from ``first_seq``.

        ``first_seq`` must be ``last_seq + 1``, else ConcurrencyError (another writer got there first).
        On failure nothing of ``lines`` is in the log and LogWriteError (a ContextPersistentError) is raised.
        """
        ...

    def follow(self, after_seq: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Records appended by anyone (any process) after ``after_seq``, as they arrive; no gap, no repeat."""
        ...

    async def close(self) -> None:
        """Flush what the durability policy deferred and release the writer lock (idempotent)."""
        ...
