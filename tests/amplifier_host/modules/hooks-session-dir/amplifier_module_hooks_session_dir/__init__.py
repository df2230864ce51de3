"""Creates the CLI's folder for the session at mount: ``amplifier run`` reads the session's metadata
before anything else has created that folder (the real logging hook would create it)."""

from __future__ import annotations

from typing import Any

__amplifier_module_type__ = "hook"


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    session_id = str(getattr(coordinator, "session_id", "") or "")
    if not session_id or session_id == "test-session":  # the kernel's validator mounts with this id
        return
    from amplifier_app_cli.session_store import SessionStore

    (SessionStore().base_dir / session_id).mkdir(parents=True, exist_ok=True)
