"""Opening a store: ``open_store`` (check the configuration, open the log, load the state) and what
``PersistentContextManager.open(...)`` returns, ``Opening``: awaitable, and an async context manager."""

from __future__ import annotations

import os
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import PersistentContextManager


async def open_store(cls: type[PersistentContextManager], *, storage_path: str | os.PathLike[str], session_id: str,
                     hooks: Any = None, readonly: bool = False, **config: Any) -> PersistentContextManager:
    """A store of class ``cls`` opened: configuration checked, the log opened (retention on open first), the
    state loaded; whatever fails after the log is open releases its writer lock."""
    from ..storage.paths import validate_session_id

    validate_session_id(session_id)
    cfg = cls.check_config(config)
    if cfg.get("retention") is not None:  # (a policy may apply on open: operations/retention_on_open.py)
        from ..operations.retention_on_open import open_store_log
    else:  # (no policy: the log alone; a turn does not load the retention side)
        from ..storage.backends import open_log as open_store_log
    path = Path(storage_path).expanduser()
    log = await open_store_log(path, session_id, cfg, readonly=readonly)
    try:
        store = cls(storage_path=path, session_id=session_id, log=log, config=cfg, hooks=hooks)
        await store._life.load()
        store._views.bounds.restore(store._s.checkpoints.loaded_view_prefix)  # (store/view_bound.py)
    except BaseException:
        await log.close()
        raise
    return store


class Opening:
    """What ``PersistentContextManager.open(...)`` returns: await it for the store, or enter it with
    ``async with`` (the store is closed on leaving the block)."""

    __slots__ = ("_opening", "_store")

    def __init__(self, opening: Coroutine[Any, Any, PersistentContextManager]) -> None:
        self._opening = opening
        self._store: PersistentContextManager | None = None

    def __await__(self) -> Generator[Any, None, PersistentContextManager]:
        return self._opening.__await__()

    async def __aenter__(self) -> PersistentContextManager:
        self._store = await self._opening
        return self._store

    async def __aexit__(self, *exc: object) -> None:
        if self._store is not None:
            await self._store.close()

    def close(self) -> None:
        """Drop an opening that will never be awaited (no "never awaited" warning)."""
        self._opening.close()


__all__ = ["Opening", "open_store"]
