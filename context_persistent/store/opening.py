"""What ``PersistentContextManager.open(...)`` returns: awaitable, and an async context manager."""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import PersistentContextManager


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


__all__ = ["Opening"]
