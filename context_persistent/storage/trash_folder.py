"""Where the trash keeps a session: the folder layout of the retention ledger and the trash, and the check an
open makes for a session whose folder is gone (storage: it reads one folder listing; moving sessions in and
out of the trash is ``operations/trash.py``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SessionTrashedError

#: The folder of the ledger and the trash, inside the storage root (a leading dot: never a session id).
RETENTION_DIR = ".retention"
TRASH_DIR = "trash"
#: A trash entry being purged is renamed to this prefix first, so a half-deleted folder is never listed.
PURGING = ".purging-"


def retention_dir(storage: Path) -> Path:
    return storage / RETENTION_DIR


def trash_dir(storage: Path) -> Path:
    return storage / RETENTION_DIR / TRASH_DIR


def entries_for(storage: Path, session_id: str) -> list[str]:
    """The trash entries of ``session_id`` (names of folders in the trash), oldest first."""
    trash = trash_dir(storage)
    try:
        names = os.listdir(trash)
    except FileNotFoundError:
        return []
    from ..model.retention import ENTRY_SEP  # (only where a trash exists: every new session's open checks, #23)

    prefix = session_id + ENTRY_SEP
    found = [n for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()]
    return sorted(found, key=lambda n: int(n.rsplit(ENTRY_SEP, 1)[1]))


def check_not_trashed(storage: Path, session_id: str) -> None:
    """SessionTrashedError if ``session_id`` has no folder but is in the trash (called by open for a session
    folder that does not exist: one ``listdir`` of the trash, only then)."""
    entries = entries_for(storage, session_id)
    if entries:
        raise SessionTrashedError(session_id, entries, ", ".join(str(trash_dir(storage) / e) for e in entries))


__all__ = ["PURGING", "RETENTION_DIR", "TRASH_DIR", "check_not_trashed", "entries_for", "retention_dir", "trash_dir"]
