"""The value classes of the turn path: plain slotted classes with a written-out ``__init__`` and the comparison,
``repr`` and copying of a dataclass, shared here (pure).

Why not dataclasses: every ``amplifier run --resume`` is a new process that imports the module again, and
``@dataclass`` compiles each generated method from source (Python 3.11: ``exec`` of ``__init__``, ``__repr__``,
``__eq__``, ``__setattr__``, ``__hash__``), 0.5-1 ms of CPU a class, over 10 ms a turn for the classes a turn
loads (docs/performance.md, "The fixed cost of a turn"). A subclass names its fields in ``__slots__`` (in the
order of its ``__init__``; a name starting with ``_`` is internal: not compared, printed or copied) and gets:

- :class:`Value`: ``==`` and ``repr`` as a dataclass's (same class, fields equal; ``Name(field=value, ...)``);
  mutable, so not hashable (as a dataclass with ``eq`` and without ``frozen``).
- :class:`Frozen`: that, hashable by its fields, and assigning a field raises ``FrozenInstanceError`` (its
  ``__init__`` sets them with ``object.__setattr__``, as a frozen dataclass's does); copied and pickled as a
  frozen slotted dataclass is.
- :func:`replace`: ``dataclasses.replace`` for them (a copy with some fields changed, through ``__init__``).
"""

from __future__ import annotations

from typing import Any, TypeVar

V = TypeVar("V", bound="Value")

#: What a :class:`Frozen` class's ``__init__`` sets its fields with (its own ``__setattr__`` refuses).
set_field = object.__setattr__


class Value:
    """Base of a mutable value class: dataclass-like ``==`` and ``repr`` over the fields in ``__slots__``."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]  # (mutable and compared by value, as a dataclass with eq)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:  # (its fields are its own __slots__: a parent's would be left out of ==)
            if issubclass(base, Value) and base.__module__ != __name__:  # (Value and Frozen are bases)
                raise TypeError(f"{cls.__qualname__}: a value class cannot extend another ({base.__qualname__}); "
                                "name every field in its own __slots__")

    def _fields(self) -> tuple[str, ...]:
        names: tuple[str, ...] = type(self).__slots__
        return tuple(n for n in names if n[0] != "_")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        fields = self._fields()
        return tuple(getattr(self, n) for n in fields) == tuple(getattr(other, n) for n in fields)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._fields())})"


class Frozen(Value):
    """Base of an immutable value class: also hashable by its fields; a field cannot be assigned."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(getattr(self, n) for n in self._fields()))

    def __setattr__(self, name: str, value: Any) -> None:
        from dataclasses import FrozenInstanceError

        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        from dataclasses import FrozenInstanceError

        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __getstate__(self) -> tuple[Any, ...]:  # (copy and pickle: the slots' values, set back below)
        names: tuple[str, ...] = type(self).__slots__
        return tuple(getattr(self, n) for n in names)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        names: tuple[str, ...] = type(self).__slots__
        for n, v in zip(names, state):
            object.__setattr__(self, n, v)


def replace(obj: V, **changes: Any) -> V:
    """A copy of ``obj`` with ``changes`` (field names) applied, made by its class's ``__init__`` (as
    ``dataclasses.replace``). TypeError for a name that is not a field."""
    fields = obj._fields()
    unknown = set(changes) - set(fields)
    if unknown:
        raise TypeError(f"{type(obj).__qualname__} has no field {sorted(unknown)[0]!r}")
    return type(obj)(**{n: changes[n] if n in changes else getattr(obj, n) for n in fields})


__all__ = ["Frozen", "Value", "replace", "set_field"]
