"""``encode_messages`` (set_messages' one encode of the whole transcript) gives the bytes and the errors of
``validate_messages`` joined as an array, whatever the messages."""

from __future__ import annotations

import collections
import math

import pytest

from context_persistent.model import events as ev
from context_persistent.model.codec import MAX_DEPTH


def _joined(messages):
    return b"[" + b",".join(ev.validate_messages(messages)) + b"]"


def _nested(depth: int) -> dict:
    """A message nesting ``depth`` containers, itself counting as one."""
    inner: object = "x"
    for _ in range(depth - 1):
        inner = [inner]
    return {"role": "user", "content": inner}


GOOD = [
    [],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
    ({"role": "system", "content": "s"}, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text"}]}),
    [{"role": "user", "content": "caf\u00e9 \ud800 lone surrogate"}],
    [{"role": "user", "content": "x", "n": 1.5, "m": None}],
    [_nested(MAX_DEPTH)],
]

BAD = [
    "not a list",
    [{"content": "no role"}],
    [{"role": "robot"}],
    [{"role": ["unhashable"]}],
    [{"role": "user"}, "not a dict"],
    [{"role": "user", "content": math.nan}],
    [{"role": "user", "content": {1: "int key"}}],
    [{"role": "user", "content": object()}],
    [collections.OrderedDict(role="user", content="a dict subclass")],
    [{"role": "user"}, _nested(MAX_DEPTH + 1)],
]


@pytest.mark.parametrize("messages", GOOD)
def test_same_bytes_as_the_per_message_encode(messages):
    assert ev.encode_messages(messages) == _joined(messages)


@pytest.mark.parametrize("messages", BAD)
def test_same_error_as_the_per_message_encode(messages):
    with pytest.raises((ValueError, TypeError)) as expected:
        _joined(messages)
    with pytest.raises(type(expected.value)) as got:
        ev.encode_messages(messages)
    assert str(got.value) == str(expected.value)
