"""The value classes of the turn path (model/values.py) behave as the dataclasses they replaced: ``==``,
``repr``, hashing and immutability of the frozen ones, ``replace``."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest

from context_persistent.model.values import Frozen, Value, replace
from context_persistent.storage.manifest import Compressed, Manifest, Segment


class Point(Frozen):
    __slots__ = ("x", "y", "_cache")

    def __init__(self, x: int, y: Any = None) -> None:
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)
        object.__setattr__(self, "_cache", [x])


class Counter(Value):
    __slots__ = ("name", "n")

    def __init__(self, name: str, n: int = 0) -> None:
        self.name = name
        self.n = n


@dataclasses.dataclass(frozen=True)
class DataPoint:
    x: int
    y: Any = None


def test_a_frozen_value_compares_prints_and_hashes_by_its_fields_as_a_frozen_dataclass() -> None:
    a, b = Point(1, "a"), Point(1, "a")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Point(1, "b") and a != Point(2, "a")
    assert repr(a) == "Point(x=1, y='a')" == repr(DataPoint(1, "a")).replace("DataPoint", "Point")
    assert a != DataPoint(1, "a") and (a == (1, "a")) is False  # (another class is never equal)
    nan = float("nan")  # (fields are compared as tuples, identity first, as a dataclass compares them)
    assert Point(1, nan) == Point(1, nan) and DataPoint(1, nan) == DataPoint(1, nan)
    assert Point(1, nan) != Point(1, float("nan"))


def test_a_frozen_value_cannot_be_changed() -> None:
    a = Point(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.x = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del a.x
    with pytest.raises(AttributeError):
        object.__setattr__(a, "z", 1)  # (slots: no other attribute)
    assert a.x == 1


def test_a_mutable_value_compares_by_its_fields_and_is_not_hashable() -> None:
    c = Counter("a")
    c.n += 1
    assert c == Counter("a", 1) and c != Counter("a")
    assert repr(c) == "Counter(name='a', n=1)"
    with pytest.raises(TypeError):
        hash(c)


def test_replace_makes_a_changed_copy_through_init() -> None:
    a = Point(1, "a")
    b = replace(a, y="b")
    assert b == Point(1, "b") and a == Point(1, "a") and b._cache == [1]
    assert replace(a) == a and replace(a) is not a
    with pytest.raises(TypeError, match="no field 'z'"):
        replace(a, z=1)
    with pytest.raises(TypeError, match="no field '_cache'"):  # (an internal slot is not a field)
        replace(a, _cache=[])


def test_frozen_values_copy_and_pickle() -> None:
    a = Point(1, {"k": [1]})
    b = copy.deepcopy(a)
    assert b == a and b.y is not a.y and b._cache == [1] and copy.copy(a).y is a.y
    seg = Segment("segment-000001.jsonl", 1, 2, "a", "b", 0, 10, "sha256:x", Compressed(5, "sha256:y", ((0, 0),)))
    manifest = Manifest("s", (seg,))
    again = pickle.loads(pickle.dumps(manifest))
    assert again == manifest and again.index_at(5) == 0 and again.segments[0].file == "segment-000001.jsonl.zst"


def test_a_value_class_cannot_extend_another() -> None:
    """Its fields are its own ``__slots__``: a parent's would be left out of ``==``, ``repr`` and ``replace``."""
    from context_persistent.model.values import Frozen

    class Point(Frozen):
        __slots__ = ("x",)

        def __init__(self, x: int) -> None:
            object.__setattr__(self, "x", x)

    with pytest.raises(TypeError, match="cannot extend another"):
        class Point3(Point):  # noqa: F841
            __slots__ = ("z",)
