"""What the Amplifier host does around the store that a library user does not: writes after its cleanup closed
the store, a second ``amplifier`` process on a session, and the link to the CLI's own folder of the session
that retention's ``follow_host`` follows (docs/amplifier.md, "The host's edges")."""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import SessionLockedError
from ..model import events as ev
from ..storage.host_link import BadLinkError, read_link, write_link
from ..store.manager import PersistentContextManager

logger = logging.getLogger("context_persistent")


class HostContext(PersistentContextManager):
    """The store as the Amplifier mount hands it to the host.

    After Ctrl-C the interactive CLI's orchestrator writes its "cancelled" message once the cleanup has closed
    the store. Such a message is appended all the same (the log is opened again for it, written, closed: what
    ``add_message`` acknowledges is durable), with no traceback; if another process holds the session by
    then, one warning line says the message was not stored and why. Only a store the mount's cleanup closed
    does this (``closed_by_host``); everything else is the library's ``PersistentContextManager``, but for its
    close, which leaves the search index's catch-up of the last records the writer's thread has not begun to
    readers (docs/search.md, "How it stays a projection").
    """

    closed_by_host = False
    #: How the mount opened the store: what a late write opens it with again.
    reopen_with: dict[str, Any] = {}
    #: The CLI's folder of this session (``cli_session_folder``), or None outside the CLI.
    host_folder: Path | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._s.share_views = True  # (the request view holds get_messages' copies: Session.view_copy)
        # (a CLI turn is a process: its close leaves the index's catch-up of its last records to readers)
        self._s.index_left_to_readers = True

    async def link_host(self) -> bool:
        """Link the session to the CLI's folder of it once that folder exists: a ``host_linked`` record in the
        log, then its index ``host.json`` in the session folder (storage/host_link.py). Done at most once per
        folder; True when the session is linked. Only on the file backend, and never for a read-only store."""
        folder = self.host_folder
        s = self._s
        if folder is None or s.closed or s.readonly or s.config.get("backend", "file") != "file":
            return False
        if not folder.is_dir():
            return False
        mine = s.log_dir()
        try:
            link = read_link(mine)
        except BadLinkError as e:
            logger.warning("context-persistent: %s; writing it again", e)
            link = None
        if link is not None and link["folder"] == str(folder) and link["session_id"] == s.session_id:
            return True
        home, project = folder.parents[4], folder.parents[1].name
        data = {"host": "amplifier", "folder": str(folder), "home": str(home), "project": project}
        seq = await self._commit(ev.HOST_LINKED, data)
        write_link(mine, {**data, "session_id": s.session_id, "seq": seq,
                          "linked_at": datetime.now(timezone.utc).isoformat()})
        return True

    async def try_link_host(self) -> None:
        """:meth:`link_host`, where a failure is one warning line: the link never fails a session."""
        try:
            await self.link_host()
        except Exception as e:
            logger.warning("context-persistent: session %s not linked to the CLI's folder %s (retention's "
                           "follow_host will not follow it): %s", self._s.session_id, self.host_folder, e)

    async def get_messages(self, last: int | None = None) -> list[dict[str, Any]]:
        """The host's ``get_messages()``, with context-simple's contract (the CLI calls it three times a turn,
        and once more per turn in an interactive session): a new list whose dicts are copies of the history's,
        made once and handed out again while only messages were appended, so a call costs the new messages,
        not the history. The request view holds the same dicts (Session.view_copy): a turn copies the history
        once. A caller that changes a dict it was given sees the change in later results and in the request
        views that hold it (as with context-simple, whose results are its own history); the stored history,
        the log, checkpoints, token counts and compaction never do (docs/amplifier.md, "get_messages in the
        host")."""
        if last is not None:
            return await super().get_messages(last)
        self._s.check_open()
        return self._s.history_copy(shared=True)

    async def add_message(self, message: dict[str, Any]) -> None:
        if self.closed and self.closed_by_host:
            await self._late(message)
            return
        await super().add_message(message)

    async def _late(self, message: dict[str, Any]) -> None:
        kwargs = {**self.reopen_with, "recognise_replay": False}
        try:
            store = await PersistentContextManager.open(storage_path=self._s.storage_path,
                                                        session_id=self._s.session_id, **kwargs)
        except SessionLockedError as e:
            logger.warning("context-persistent: a %s message written after session %s ended was not stored: %s",
                           message.get("role") if isinstance(message, dict) else "bad", self._s.session_id,
                           host_terms(e))
            return
        try:
            await store.add_message(message)
        finally:
            await store.close()
        logger.info("session %s: a message written after the session ended was appended", self._s.session_id)


def host_terms(e: SessionLockedError) -> str:
    """What a CLI user can do about a session another process holds, in the host's terms."""
    holder = f"process {e.pid}" if e.pid else "another process"
    return (f"session {e.session_id} is open in another amplifier process ({holder}); only one process can "
            f"run a session at a time. Exit that session first (or wait for it to finish), or start a new "
            f"session; to read this one meanwhile: context-persistent show {e.session_id}")


class SessionInUseError(SessionLockedError):
    """SessionLockedError whose message speaks the Amplifier CLI's terms (raised by the mount)."""

    def __init__(self, e: SessionLockedError) -> None:
        super().__init__(e.session_id, e.pid)
        self.args = (host_terms(e),)

    def __str__(self) -> str:
        return str(self.args[0])



def cli_session_folder(session_id: str) -> Path | None:
    """The Amplifier CLI's folder of ``session_id`` (``~/.amplifier/projects/<project>/sessions/<id>``, as its
    ``SessionStore`` makes it: the project from the working folder), or None when this process is not the CLI
    (``amplifier_app_cli`` not loaded: another host, or the library alone)."""
    if "amplifier_app_cli" not in sys.modules or not session_id or os.sep in session_id:
        return None
    try:
        from amplifier_app_cli.project_utils import get_project_slug  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path.home() / ".amplifier" / "projects" / str(get_project_slug()) / "sessions" / session_id
