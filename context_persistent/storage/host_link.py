"""``host.json``: the index of a session's link to a host's session folder (docs/amplifier.md, "Sessions the
host deletes").

The link itself is recorded in the session's log (a ``host_linked`` event: which host, which folder); this
small file in the session folder repeats it so that retention's ``follow_host`` rule reads one file per
session instead of every log. It holds no conversation data, moves with the session folder (to the trash and
back) and is written owner-only, through a temporary file and a rename. A missing file means "not followed";
the mount writes it again from what it knows at the next open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from .paths import create_private_file, fsync_dir, write_all

LINK_NAME = "host.json"
#: The keys a link holds (a file without them is not a link: the session is not followed).
LINK_KEYS = ("host", "session_id", "folder", "home", "project", "linked_at", "seq")


class BadLinkError(ValueError):
    """A ``host.json`` that is not a link this package wrote (the session is not followed)."""


def read_link(session_folder: Path) -> dict[str, Any] | None:
    """The link of a session folder; None when it has none; BadLinkError naming the file when it is not one
    (never taken for a link: such a session is not followed)."""
    path = session_folder / LINK_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        link = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadLinkError(f"{path} is not JSON ({e})") from None
    if not isinstance(link, dict) or any(k not in link for k in LINK_KEYS) or not all(
            isinstance(link[k], str) for k in LINK_KEYS if k != "seq"):
        raise BadLinkError(f"{path} lacks one of {', '.join(LINK_KEYS)} or holds a value of the wrong type")
    return link


def write_link(session_folder: Path, link: dict[str, Any]) -> None:
    """Write the link durably (a temporary file, fsync, rename, the folder synced)."""
    tmp = f".{LINK_NAME}.tmp-{os.getpid()}"
    fd = create_private_file(session_folder, tmp)
    try:
        write_all(fd, orjson.dumps(link, option=orjson.OPT_SORT_KEYS) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(session_folder / tmp, session_folder / LINK_NAME)
    fsync_dir(session_folder)


__all__ = ["BadLinkError", "LINK_KEYS", "LINK_NAME", "read_link", "write_link"]
