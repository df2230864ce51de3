"""Retention's ``follow_host`` rule on the file backend: which sessions the host deleted (docs/amplifier.md,
"Sessions the host deletes"; docs/operations.md, "Retention").

A session is followed only if its folder holds a link (``storage/host_link.py``: written by the Amplifier mount
once it has seen the CLI's folder of that session exist, and recorded in the log as ``host_linked``). It is
selected when that folder is gone while the folder that held it (the host's ``sessions/`` folder of that
project) is still there: the host removed the session (``amplifier session delete`` or ``cleanup``). Never
selected: a session without a link (created by the library, another host, or before the CLI ever saved it),
a link naming another session id (a copied folder), a host folder whose parent is missing too (an unmounted
disk or another HOME looks the same as a deleted project), and a session restored from a ``follow_host``
trash entry after it was linked (the user chose to keep it).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from ..model.retention import RESTORED, Entry, SessionInfo
from ..storage.host_link import BadLinkError, read_link

logger = logging.getLogger("context_persistent")

RULE = "follow_host"


def host_folder(link: dict[str, str], home: Path | None) -> Path:
    """The host's folder of a linked session: the recorded one, or with ``home`` the same project's folder
    under ``home/.amplifier`` (a home moved or mounted elsewhere)."""
    if home is None:
        return Path(link["folder"])
    return home / ".amplifier" / "projects" / link["project"] / "sessions" / link["session_id"]


def _kept_by_restore(entries: dict[str, Entry], session_id: str, linked_at: datetime) -> bool:
    """Whether the session came back from a ``follow_host`` trash entry after it was linked."""
    for entry in entries.values():
        if entry.session_id != session_id or entry.data.get("rule") != RULE:
            continue
        for step in entry.history:
            if step["type"] == RESTORED and datetime.fromisoformat(step["ts"]) >= linked_at:
                return True
    return False


def host_gone(storage: Path, session_id: str, entries: dict[str, Entry], home: Path | None = None) -> str | None:
    """Why ``follow_host`` expires the session (a sentence), or None when it does not."""
    try:
        link = read_link(storage / session_id)
    except BadLinkError as e:
        logger.warning("retention: session %s is not followed: %s (the Amplifier mount writes it again at the "
                       "session's next open)", session_id, e)
        return None
    if link is None or link["session_id"] != session_id:
        return None
    folder = host_folder(link, home)
    if folder.exists() or folder.is_symlink() or not folder.parent.is_dir():
        return None
    if _kept_by_restore(entries, session_id, datetime.fromisoformat(link["linked_at"])):
        return None
    return (f"its {link['host']} session folder {folder} is gone (removed by the host, e.g. `amplifier session "
            "delete` or `amplifier session cleanup`)")


def follow(storage: Path, infos: list[SessionInfo], entries: dict[str, Entry],
           home: Path | None = None) -> list[SessionInfo]:
    """``infos`` with ``host_gone`` set for each session the host deleted (one small file read per session)."""
    return [replace(s, host_gone=host_gone(storage, s.session_id, entries, home)) for s in infos]


__all__ = ["RULE", "follow", "host_folder", "host_gone"]
