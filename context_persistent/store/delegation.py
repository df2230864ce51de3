"""How the facade's attributes reach its parts: ``store.<name>`` reads and sets an attribute of one part."""

from __future__ import annotations

from typing import Any


def _kept(part: str, attr: str, doc: str | None = None) -> Any:
    """A store attribute kept by one of its parts: ``store.<name>`` reads and sets ``<part>.<attr>``."""

    def get(store: Any) -> Any:
        return getattr(getattr(store, part), attr)

    def put(store: Any, value: Any) -> None:
        setattr(getattr(store, part), attr, value)

    get.__doc__ = doc
    return property(get, put)


class _Limit:
    """A class-level number the request views read, which tests lower on one store."""

    def __init__(self, part: str, attr: str, default: int) -> None:
        self.part, self.attr, self.default = part, attr, default

    def __get__(self, store: Any, owner: Any = None) -> int:
        if store is None:
            return self.default
        return int(getattr(getattr(store, self.part), self.attr))

    def __set__(self, store: Any, value: int) -> None:
        setattr(getattr(store, self.part), self.attr, value)


__all__ = ["_Limit", "_kept"]
