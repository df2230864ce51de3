"""The exception hierarchy: one root, a few children, each naming what went wrong."""

from __future__ import annotations


class ContextPersistentError(Exception):
    """Root of every error this package raises on purpose (bad arguments stay ValueError/TypeError)."""


class SessionNotFoundError(ContextPersistentError):
    """A session that must exist (read-only open, export, fork source) does not."""


class SessionExistsError(ContextPersistentError):
    """A session that must not exist yet (import, fork target) already does."""


class SessionLockedError(ContextPersistentError):
    """Another writer holds the session's lock."""

    def __init__(self, session_id: str, pid: int | None, where: str = "") -> None:
        self.session_id = session_id
        self.pid = pid
        holder = f"pid {pid}" if pid else "another writer (pid unknown)"
        super().__init__(
            f"session {session_id!r} is locked by {holder}{' ' + where if where else ''}; "
            "only one writer may hold a session at a time (open with readonly=True to read it)"
        )


class ConcurrencyError(ContextPersistentError):
    """An append expected a sequence number that another writer has already used."""


class StoreClosedError(ContextPersistentError):
    """The store was used after close()."""


class ReadOnlyError(ContextPersistentError):
    """A write was attempted on a store opened with readonly=True."""


#: What the chain check says of a log whose first record names another session id's root: a renamed or copied
#: session folder, which repair cannot fix (its records are not damaged).
FOREIGN_LOG = "belongs to a log of another session id"
#: What to do about a foreign log, in every message that reports one.
FOREIGN_LOG_ADVICE = (
    "the folder holds the log of another session id (a renamed or copied session folder; its first record, "
    "session_started, names that id): give the folder that name again, or, to keep the copy as a session of its "
    "own, put it under that name in another storage folder and bring it over with `context-persistent --storage "
    "OTHER export ID copy.jsonl` then `context-persistent import copy.jsonl NEW` (or `fork ID NEW` there); "
    "`repair` cannot fix this, as nothing in it is damaged")


class LogCorruptedError(ContextPersistentError):
    """A record before the end of the log fails its checksum or cannot be parsed."""

    def __init__(self, path: str, line: int, offset: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.offset = offset
        self.reason = reason
        advice = (FOREIGN_LOG_ADVICE if FOREIGN_LOG in reason else
                  "Run `context-persistent verify` for a report and `context-persistent repair` to quarantine bad "
                  "records and keep every valid one")
        super().__init__(f"{path}: line {line} (byte offset {offset}) is corrupt: {reason}; nothing was loaded. "
                         f"{advice[0].upper()}{advice[1:]}")


class InvalidRecordError(LogCorruptedError):
    """A record passed its checksum but its data does not have the shape its event type needs."""

    def __init__(self, seq: object, type_: object, reason: str, path: str = "") -> None:
        self.seq = seq
        self.type = type_
        ContextPersistentError.__init__(self)
        self.path, self.line, self.offset, self.reason = path, 0, -1, reason

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return (f"{where}record seq {self.seq} ({self.type}) passed its checksum but cannot be applied: "
                f"{self.reason}; nothing was loaded. Run `context-persistent verify` for a report")


class UnsupportedFormatError(ContextPersistentError):
    """The log was written by a newer, incompatible format version."""


class LogWriteError(ContextPersistentError):
    """Writing or syncing the log failed (disk full, permission, I/O error); nothing was recorded."""

    def __init__(self, path: str, op: str, cause: OSError,
                 consequence: str = "the record was not stored and the log is unchanged") -> None:
        self.path = path
        self.errno = cause.errno
        super().__init__(f"could not {op} {path}: {cause.strerror or cause} (errno {cause.errno}); {consequence}")


class RecordCorruptedError(LogCorruptedError):
    """A record stored in a database fails its checksum, cannot be parsed, or breaks the seq order."""

    def __init__(self, where: str, seq: int, reason: str) -> None:
        self.path = where
        self.line = seq
        self.offset = -1
        self.seq = seq
        self.reason = reason
        ContextPersistentError.__init__(
            self,
            f"{where}: the record stored as seq {seq} is corrupt: {reason}; nothing was loaded "
            "(a corrupt record is never skipped: restore it from a backup, or export the session up to "
            "the seq before it)",
        )


class DatabaseError(ContextPersistentError):
    """The database backend failed: the server is unreachable, the connection was lost, or asyncpg is missing.

    ``stored`` says whether the write in progress landed: ``False`` (it did not), ``True``, or ``None``
    (it could not be determined: reopen the session to see).
    """

    def __init__(self, message: str, stored: bool | None = False) -> None:
        self.stored = stored
        super().__init__(message)


class MalformedInputError(ContextPersistentError, ValueError):
    """A file given to import (snapshot, transcript, context-messages) is malformed; names the file and line.

    Also a ValueError (bad input). Raised before anything is written: no session is created.
    """

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        where = f"{path}: line {line}" if line else path
        super().__init__(f"{where}: {reason}; nothing was imported")


class LogChangedError(ContextPersistentError):
    """A follower found that records it had already reported were removed or rewritten (not by appending)."""


class UnsafeStorageError(ContextPersistentError, PermissionError):
    """A storage or session folder, or a file the store writes, is not safe to write: a folder not owned by
    this user or writable by others, or a symbolic link (or hard-linked file) where the store writes. The
    store never follows a symlink it writes through, so nothing outside the storage can be modified."""

    def __init__(self, errno_: int, message: str, path: str) -> None:
        super().__init__(errno_, message, path)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SessionTrashedError(ContextPersistentError):
    """The session was moved to the trash by a retention policy: it does not open as a live session."""

    def __init__(self, session_id: str, entries: list[str], where: str) -> None:
        # ``where``: the trash entry's folder or table row, for the message
        self.session_id = session_id
        self.entries = entries
        super().__init__(
            f"session {session_id!r} is in the trash ({where}), moved "
            f"there by a retention policy: restore it with `context-persistent trash restore {entries[-1]}`, or "
            f"purge it (`context-persistent trash purge {entries[-1]} --force`) to start a new session under "
            "this id")


class LedgerError(ContextPersistentError):
    """The retention ledger holds a record that is not a valid ledger record, or disagrees with the trash."""


class RecordsExpiredError(ContextPersistentError, LookupError):
    """A read asked for a record, position or seq that segment retention expired: the oldest sealed segments
    of the session's log went to the trash, recorded by an ``expired`` record (docs/format.md, "Segment
    retention"). ``last_seq`` is the last expired seq, ``start`` the position of the first record left."""

    def __init__(self, where: str, asked: str, last_seq: int, start: int, expired_seq: int) -> None:
        self.last_seq, self.start, self.expired_seq = last_seq, start, expired_seq
        super().__init__(
            f"{where}: {asked} was expired by retention (seqs 1..{last_seq}, bytes before position {start}, are "
            f"no longer in the log; the `expired` record at seq {expired_seq} says which segments, why and when; "
            f"they stay in the trash until purged: `context-persistent trash list`)")
