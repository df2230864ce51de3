"""What Pydantic AI's vendored tests import from their own test package (tests/_inline_snapshot.py and
tests/conftest.py), written here: ``snapshot`` returns its value (their stub's behaviour without
``--inline-snapshot``), ``IsStr``/``IsNow``/``IsDatetime`` match as the dirty-equals matchers they re-export
do for the arguments their tests use, ``message``/``message_part``/``try_import`` and the ``tiny_audio``
fixture as their conftest defines them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, TypeVar

import pytest
from pydantic_ai import BinaryContent

T = TypeVar("T")


def snapshot(value: Any = None) -> Any:
    return value


class _Matcher:
    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IsStr(_Matcher):
    def __init__(self, *, regex: str | None = None) -> None:
        self.regex = regex

    def __eq__(self, other: object) -> bool:
        import re

        return isinstance(other, str) and (self.regex is None or re.fullmatch(self.regex, other) is not None)


class IsDatetime(_Matcher):
    def __init__(self, **_: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, datetime)


class IsNow(_Matcher):
    """A datetime within a minute of now (dirty-equals' default delta is 2 s; a stored round trip is slower)."""

    def __init__(self, *, tz: timezone | None = None) -> None:
        self.tz = tz

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, datetime):
            return False
        now = datetime.now(tz=self.tz or (other.tzinfo and timezone.utc))
        return abs(now - other) < timedelta(minutes=1)


def message(messages: Sequence[Any], message_type: type[T], *, index: int = 0) -> T:
    msg = messages[index]
    assert isinstance(msg, message_type)
    return msg


def message_part(messages: Sequence[Any], part_type: type[T], *, message_index: int = 0, part_index: int = 0) -> T:
    part = messages[message_index].parts[part_index]
    assert isinstance(part, part_type)
    return part


@contextmanager
def try_import() -> Iterator[Callable[[], bool]]:
    ok = False

    def check() -> bool:
        return ok

    try:
        yield check
    except ImportError:
        pass
    else:
        ok = True


@pytest.fixture
def tiny_audio() -> BinaryContent:
    return BinaryContent(data=b"\x10\x11\x12", media_type="audio/mpeg")
