"""What the writer hands the search index's thread with a notification: the history's keys after a record
(background.py sends it, indexer.py uses it; apart from both so that the writer's side loads neither the
indexing modules nor a cycle)."""

from __future__ import annotations

from array import array
from typing import Any

from ...model.values import Value


class Snapshot(Value):
    """The history's keys right after record ``seq`` (the writer's state, handed over with a notification)."""

    __slots__ = ("seq", "keys")
    seq: int
    keys: Any

    def __init__(self, seq: int, keys: Any) -> None:
        self.seq = seq
        self.keys = keys


def keys_snapshot(seq: int, keys: Any) -> Snapshot:
    """A copy of the history's keys (a packed array: a memcpy) to hand to the indexer."""
    return Snapshot(seq, array("q", keys) if not isinstance(keys, array) else keys[:])


__all__ = ["Snapshot", "keys_snapshot"]
