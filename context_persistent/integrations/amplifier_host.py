"""What the Amplifier host does around the store that a library user does not: writes after its cleanup closed
the store, and a second ``amplifier`` process on a session (docs/amplifier.md, "The host's edges")."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import SessionLockedError
from ..store.manager import PersistentContextManager

logger = logging.getLogger("context_persistent")


class HostContext(PersistentContextManager):
    """The store as the Amplifier mount hands it to the host.

    After Ctrl-C the interactive CLI's orchestrator writes its "cancelled" message once the cleanup has closed
    the store. Such a message is appended all the same (the log is opened again for it, written, closed: what
    ``add_message`` acknowledges is durable), with no traceback; if another process holds the session by
    then, one warning line says the message was not stored and why. Only a store the mount's cleanup closed
    does this (``closed_by_host``); everything else is the library's ``PersistentContextManager``.
    """

    closed_by_host = False
    #: How the mount opened the store: what a late write opens it with again.
    reopen_with: dict[str, Any] = {}

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

