"""The Amplifier entry point: ``mount(coordinator, config)``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .manager import KNOWN_KEYS, PersistentContextManager

logger = logging.getLogger("context_persistent")

ENV_STORAGE = "CONTEXT_PERSISTENT_DIR"
DEFAULT_STORAGE = Path(".amplifier") / "context"
#: Events this module emits, registered with ``observability.events``.
OBSERVABLE_EVENTS = [
    "context:pre_compact",
    "context:post_compact",
    "context:compaction",
    "context:recovered",
    "context:transcript_ignored",
]


def storage_from(config: dict[str, Any]) -> Path:
    """``config["storage_path"]`` > ``$CONTEXT_PERSISTENT_DIR`` > ``.amplifier/context`` under the cwd."""
    value = config.get("storage_path") or os.environ.get(ENV_STORAGE)
    return Path(value).expanduser() if value else Path.cwd() / DEFAULT_STORAGE


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> Any:
    """Open the session's store and mount it at ``"context"``; returns the cleanup that closes it."""
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
