"""Message keys (pure): ``seq << 20 | index``, where ``seq`` is the event that added the message and ``index``
its position inside that event (0 for ``message_added``; the list position for ``messages_replaced``). Keys are
stable across restarts, so pins and redactions can name a message.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

INDEX_BITS = 20
MAX_BATCH = 1 << INDEX_BITS  # messages one messages_replaced event may hold


def make_key(seq: int, index: int = 0) -> int:
    return (seq << INDEX_BITS) | index


def split_key(key: int) -> tuple[int, int]:
    return key >> INDEX_BITS, key & (MAX_BATCH - 1)



def new_keys(values: Iterable[int] = ()) -> "array[int]":
    """A list of message keys, packed: 8 bytes a key (``array('q')``; keys are ints below 2**63)."""
    return array("q", values)
