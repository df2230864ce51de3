"""The Amplifier entry point: ``mount(coordinator, config)``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .manager import KNOWN_KEYS, PersistentContextManager

logger = logging.getLogger("context_persistent")

ENV_STORAGE = "CONTEXT_PERSISTENT_DIR"
#: The storage folder when neither the config nor the environment names one: one place per user, whatever the
#: working directory (docs/configuration.md, "Where sessions are stored").
DEFAULT_STORAGE = Path("~") / ".amplifier" / "context"
#: Events this module emits, registered with ``observability.events``.
OBSERVABLE_EVENTS = [
    "context:pre_compact",
    "context:post_compact",
    "context:compaction",
    "context:recovered",
    "context:transcript_ignored",
]


def storage_from(config: dict[str, Any]) -> Path:
    """``config["storage_path"]`` > ``$CONTEXT_PERSISTENT_DIR`` > ``~/.amplifier/context``."""
    return storage_source(config)[0]


def storage_source(config: dict[str, Any]) -> tuple[Path, str]:
    """The storage folder and where it came from: ``"config"`` (``storage_path``), ``"environment"``
    (``$CONTEXT_PERSISTENT_DIR``) or ``"default"`` (``~/.amplifier/context``)."""
    if config.get("storage_path"):
        return Path(config["storage_path"]).expanduser(), "config"
    if os.environ.get(ENV_STORAGE):
        return Path(os.environ[ENV_STORAGE]).expanduser(), "environment"
    return DEFAULT_STORAGE.expanduser(), "default"


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> Any:
    """Open the session's store and mount it at ``"context"`` of ``coordinator``; returns the cleanup
    coroutine function that closes it.

    ``config`` is the mount plan's ``context.config`` (docs/configuration.md): the storage folder is
    ``storage_path``, else ``$CONTEXT_PERSISTENT_DIR``, else ``~/.amplifier/context``; the session id is
    ``session_id``, else ``coordinator.session_id``. Unknown keys are ignored with a warning. Raises
    ValueError without a session id or for a bad value, and whatever ``PersistentContextManager.open``
    raises (SessionLockedError, LogCorruptedError, ...).
    """
    config = dict(config or {})
    session_id = config.pop("session_id", None) or getattr(coordinator, "session_id", None)
    if not session_id:
        raise ValueError("context-persistent needs a session id: config['session_id'] or coordinator.session_id")
    storage = storage_from(config)
    config.pop("storage_path", None)
    for key in sorted(set(config) - KNOWN_KEYS):
        logger.warning("context-persistent: ignoring unknown config key %r (known: %s)", key,
                       ", ".join(sorted(KNOWN_KEYS)))
        config.pop(key)
    store = await PersistentContextManager.open(
        storage_path=storage, session_id=str(session_id), hooks=getattr(coordinator, "hooks", None), **config
    )
    try:
        await coordinator.mount("context", store)
        register = getattr(coordinator, "register_contributor", None)
        if callable(register):
            register("observability.events", "context-persistent", lambda: list(OBSERVABLE_EVENTS))
    except BaseException:
        await store.close()
        raise

    async def cleanup() -> None:
        await store.close()

    return cleanup
