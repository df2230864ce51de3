"""Messages read from the log on demand (I/O): the history keeps a *reference* per message, not its contents.

A reference (``ref``) is an int: ``position << 20 | index``, the byte position of the record that holds the
message in the log and the message's index inside it (0 for ``message_added``; the list position for
``messages_replaced``, ``system_prompt_set`` and their erasure tombstones, as in the message's key). A
:class:`MessageReader` turns a ref back into the message: it reads that one line (``log.read_line_at``), verifies
its checksum, picks the item and keeps it in a small cache of parsed messages, bounded in bytes (least recently
used first out). Erasure rewrites records in place (same length, same position) and then rebuilds the history;
:meth:`MessageReader.clear` drops what the cache holds. docs/architecture.md, "Bounded memory".
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from . import codec
from .errors import LogCorruptedError
from .log import line_at, read_line_at

REF_INDEX_BITS = 20
_INDEX_MASK = (1 << REF_INDEX_BITS) - 1
#: Default bound of the cache of parsed messages: the JSON bytes of the messages it holds.
CACHE_BYTES = 32 << 20


def make_ref(position: int, index: int = 0) -> int:
    return (position << REF_INDEX_BITS) | index


def split_ref(ref: int) -> tuple[int, int]:
    return ref >> REF_INDEX_BITS, ref & _INDEX_MASK


def message_of(rec: dict[str, Any], index: int) -> Any:
    """The message at ``index`` of a record that holds messages, else None."""
    data = rec.get("data")
    if not isinstance(data, dict):
        return None
    if rec.get("type") == "message_added":
        return data.get("message") if index == 0 else None
    items = data.get("messages")
    if isinstance(items, list) and 0 <= index < len(items):
        return items[index]
    return None


class MessageReader:
    """Reads messages by ref from one session's log, through an LRU cache of at most ``cache_bytes``.

    ``reads`` counts lines read from the log and ``hits`` refs served from the cache (tests and benchmarks
    use them to check that a path reads only what it needs).
    """

    def __init__(self, path: Path, cache_bytes: int = CACHE_BYTES) -> None:
        self.path = path
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._held = 0
        self.reads = 0
        self.hits = 0

    def fetch(self, ref: int) -> dict[str, Any]:
        """The message ``ref`` names; LogCorruptedError if the log does not hold a valid record with that
        message there (nothing is skipped silently)."""
        cache = self._cache
        hit = cache.get(ref)
        if hit is not None:
            cache.move_to_end(ref)
            self.hits += 1
            return hit[0]  # type: ignore[no-any-return]
        position, index = split_ref(ref)
        line = read_line_at(self.path, position)
        self.reads += 1
        try:
            rec = codec.decode(line)
        except codec.RecordError as e:
            raise LogCorruptedError(str(self.path), line_at(self.path, position), position,
                                    f"the record a message of the history refers to fails verification: {e}"
                                    ) from None
        message = message_of(rec, index)
        if type(message) is not dict:
            raise LogCorruptedError(str(self.path), line_at(self.path, position), position,
                                    f"the record (seq {rec.get('seq')}, {rec.get('type')}) holds no message at "
                                    f"index {index}, which the history refers to")
        data = rec["data"]
        if rec["type"] != "message_added" and len(data["messages"]) > 1:
            # A record of several messages: keep its others too (reading one usually means reading its neighbours).
            share = max(1, len(line) // len(data["messages"]))
            for i, m in enumerate(data["messages"]):
                if i != index and type(m) is dict:
                    self.put(make_ref(position, i), m, share)
            self.put(ref, message, share)
        else:
            self.put(ref, message, len(line))
        return message

    def put(self, ref: int, message: dict[str, Any], size: int) -> None:
        """Keep ``message`` (about ``size`` bytes) as what ``ref`` names, evicting the least recently used."""
        cache = self._cache
        old = cache.pop(ref, None)
        if old is not None:
            self._held -= old[1]
        if size > self.cache_bytes:
            return
        cache[ref] = (message, size)
        self._held += size
        while self._held > self.cache_bytes:
            _, (_, n) = cache.popitem(last=False)
            self._held -= n

    def clear(self) -> None:
        self._cache.clear()
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held
