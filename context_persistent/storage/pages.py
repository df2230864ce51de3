"""Messages read from the log on demand (I/O): the history keeps a *reference* per message, not its contents.

A reference (``ref``) is an int: ``position << 20 | index``, the byte position of the record that holds the
message in the log and the message's index inside it (0 for ``message_added``; the list position for
``messages_replaced``, ``system_prompt_set`` and their erasure tombstones, as in the message's key). A
:class:`MessageReader` turns a ref back into the message: it reads that one line (``log.read_line_at``), verifies
its checksum, picks the item and keeps it in a small cache of parsed messages, bounded in bytes (least recently
used first out). Erasure rewrites records in place (same length, same position) and then rebuilds the history;
:meth:`MessageReader.clear` drops what the cache holds. The cache and the checks are :class:`PageCache`, which
the PostgreSQL reader (pg/pages.py, where a ref is the message's key) shares. docs/architecture.md, "Bounded
memory".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import Any

from .paths import LOG_NAME

from ..model import codec
from ..model import events as ev
from ..errors import LogCorruptedError
from .segments import LogReader

REF_INDEX_BITS = 20
_INDEX_MASK = (1 << REF_INDEX_BITS) - 1
#: Default memory budget of the cache of parsed messages: the JSON bytes of the messages it holds, plus
#: ``MESSAGE_OVERHEAD`` for each message a pass over the history kept. While the whole history fits, it stays
#: in memory after its first read (a resumed turn reads the log once); beyond it, it is paged.
CACHE_BYTES = 96 << 20
#: The budget of a reader that passes over a log once (verify, repair, the command line's reads): it gains
#: nothing from keeping the history, and its memory must not grow with the log (docs/operations.md, "Memory of
#: the commands").
STREAM_CACHE_BYTES = 32 << 20
#: What a parsed message costs in memory beyond its JSON (a dict and its strings), for the budget.
MESSAGE_OVERHEAD = 256
#: The most log bytes one sequential read of :meth:`MessageReader.fetch_many` spans.
RUN_BYTES = 8 << 20


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
    expired = ev.expired_of(rec)
    if expired is not None:  # a message it carries: ``carried[index]`` (segment retention; null once erased)
        carried = expired.get("carried")
        if isinstance(carried, list) and 0 <= index < len(carried) and isinstance(carried[index], dict):
            return carried[index].get("message")
        return None
    items = data.get("messages")
    if isinstance(items, list) and 0 <= index < len(items):
        return items[index]
    return None


class PageCache(ABC):
    """What every pager shares: the LRU cache of parsed messages by ref, at most ``cache_bytes`` (the JSON bytes
    of the messages it holds), and what it does with a record it read for a ref: verify it (``codec.decode``),
    pick the message the ref names (LogCorruptedError if there is none: nothing is skipped silently) and keep
    it. A subclass reads records: ``_line(at)`` (the record a ref's upper part names) and ``_broken(at, why)``
    (the error naming where it is); ``fetch_many`` reads what the cache does not hold, in runs.

    ``reads`` counts records read and ``hits`` refs served from the cache (tests and benchmarks use them to
    check that a path reads only what it needs).
    """

    def __init__(self, cache_bytes: int) -> None:
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        #: The messages of a checkpoint's message section seeded into an empty cache (:meth:`seed`), by ref, each
        #: counted ``_block_cost`` bytes: one plain dict made in one call instead of an entry of ``_cache`` each
        #: (4x cheaper to make, 1.6x to look up at 100k messages). They count as older than anything in
        #: ``_cache``, read or not: evicted first (in ``_block_order``, the section's order, from ``_block_next``
        #: on); a message of it stays there when read, so that a pass looks its refs up in one dict.
        self._block: dict[int, Any] = {}
        self._block_order: list[int] = []
        self._block_next = 0
        self._block_cost = 0
        self._held = 0
        #: Refs below it are not kept by :meth:`put` (:meth:`keep_from`).
        self._floor = 0
        self.reads = 0
        self.hits = 0
        #: A checkpoint's message section whose messages went to the first ``get_messages()`` instead of the
        #: cache (checkpoint/sections.py, ``defer_section``): put in the cache before the cache is first used.
        self._pending: Callable[[], None] | None = None

    def defer_seed(self, settle: Callable[[], None]) -> None:
        """Call ``settle`` (it seeds the cache) before the cache is next read or written; :meth:`clear` drops it."""
        self._pending = settle

    def settle(self) -> None:
        """Seed what :meth:`defer_seed` deferred, if anything (once)."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            pending()

    @contextmanager
    def seed_kept_deferred(self) -> Iterator[None]:
        """Reads inside the block do not settle a deferred seed (the log's tail after a checkpoint, read for the
        messages handed out with the section's): it stays deferred after, unless the block deferred or settled
        another."""
        pending, self._pending = self._pending, None
        try:
            yield
        finally:
            if self._pending is None:
                self._pending = pending

    @abstractmethod
    def _line(self, at: int) -> bytes:
        """The record that refs with upper part ``at`` name (a byte position, or a seq on PostgreSQL)."""

    @abstractmethod
    def _broken(self, at: int, reason: str) -> LogCorruptedError:
        """The error for the record at ``at``, naming where it is."""

    def fetch(self, ref: int) -> dict[str, Any]:
        """The message ``ref`` names; LogCorruptedError if the log does not hold a valid record with that
        message there (nothing is skipped silently)."""
        if self._pending is not None:
            self.settle()
        cache = self._cache
        hit = cache.get(ref)
        if hit is not None:
            cache.move_to_end(ref)
            self.hits += 1
            return hit[0]  # type: ignore[no-any-return]
        seeded = self._block.get(ref) if self._block else None
        if seeded is not None:  # (left where it is: a pass's lookups stay in one dict)
            self.hits += 1
            return seeded  # type: ignore[no-any-return]
        at, index = split_ref(ref)
        line = self._line(at)
        rec = self._record(at, line)
        message = self._message(at, rec, index)
        data = rec["data"]
        if isinstance(data.get("messages"), list) and len(data["messages"]) > 1:
            # A record of several messages: keep its others too (reading one usually means reading its neighbours).
            share = max(1, len(line) // len(data["messages"]))
            for i, m in enumerate(data["messages"]):
                if i != index and type(m) is dict:
                    self.put(make_ref(at, i), m, share)
            self.put(ref, message, share)
        else:
            self.put(ref, message, len(line))
        return message

    def _record(self, at: int, line: bytes) -> dict[str, Any]:
        """The record ``line`` (read for refs at ``at``), verified."""
        self.reads += 1
        try:
            return codec.decode(line)
        except codec.RecordError as e:
            raise self._broken(at, f"the record a message of the history refers to fails verification: {e}"
                               ) from None

    def _message(self, at: int, rec: dict[str, Any], index: int) -> dict[str, Any]:
        message = message_of(rec, index)
        if type(message) is not dict:
            raise self._broken(at, f"the record (seq {rec.get('seq')}, {rec.get('type')}) holds no message at "
                               f"index {index}, which the history refers to")
        return message

    def _uncached(self, refs: list[int]) -> tuple[list[Any], dict[int, list[int]]]:
        """``refs`` served from the cache (None where it misses) and the misses: ``{ref >> 20: [their places]}``."""
        if self._pending is not None:
            self.settle()
        every = self._all_held(refs)
        if every is not None:  # (a history all in memory: every ref a hit)
            self.hits += len(refs)
            return every, {}
        cache, block = self._cache, self._block
        out: list[Any] = [None] * len(refs)
        want: dict[int, list[int]] = {}
        for k, ref in enumerate(refs):
            hit = cache.get(ref)
            if hit is not None:
                self.hits += 1
                out[k] = hit[0]
            elif block and ref in block:
                self.hits += 1
                out[k] = block[ref]
            else:
                want.setdefault(refs[k] >> REF_INDEX_BITS, []).append(k)
        return out, want

    def _all_held(self, refs: list[int]) -> list[Any] | None:
        """The messages ``refs`` name if the cache holds every one of them (seeded or not), else None; changes
        nothing."""
        cache, block = self._cache, self._block
        if not block:
            try:
                return [cache[ref][0] for ref in refs]
            except KeyError:
                return None
        # (the usual case after a lazy open: the section's messages, then those read or appended since, at the end)
        k = len(refs)
        while k and refs[k - 1] not in block:
            k -= 1
        try:  # (looked up in C)
            if k == len(refs):
                return list(map(block.__getitem__, refs))
            return list(map(block.__getitem__, refs[:k])) + [cache[ref][0] for ref in refs[k:]]
        except KeyError:
            pass
        out = []
        get = cache.get
        for ref in refs:  # (any other mix, one at a time)
            m = block.get(ref)
            if m is None:
                hit = get(ref)
                if hit is None:
                    return None
                m = hit[0]
            out.append(m)
        return out

    @property
    def held_messages(self) -> int:
        """How many messages the cache holds (seeded or not; a seed :meth:`defer_seed` deferred is not counted
        and not made)."""
        return len(self._cache) + len(self._block)

    def keep_from(self, position: int) -> None:
        """From now on :meth:`put` ignores the messages of records before ``position`` (0: keeps all again).

        For a replay of the whole log: it puts every message in log order, and only those of about its last
        ``cache_bytes`` would still be in the cache at its end; the others would be put only to be evicted."""
        self._floor = position << REF_INDEX_BITS

    def keep_read(self, ref: int, message: dict[str, Any], size: int) -> None:
        """Keep ``message`` (``size`` JSON bytes) that a pass over the history read, if the cache has room for
        it without evicting anything: the whole history stays in memory while it fits ``cache_bytes``, and a
        pass over a longer one never evicts what the request view reads (docs/architecture.md, "Bounded
        memory")."""
        if self._pending is not None:
            self.settle()
        if ref < self._floor or ref in self._cache or ref in self._block:
            return
        size += MESSAGE_OVERHEAD
        if self._held + size > self.cache_bytes:
            return
        self._cache[ref] = (message, size)
        self._held += size

    def cached(self, refs: list[int]) -> list[dict[str, Any]] | None:
        """The messages ``refs`` name if the cache holds every one of them, else None; changes neither the
        cache's order nor its counters. A checkpoint's message section is written from it (checkpoint/
        payload.py, ``dump_messages``): a history all in memory is written, one that is paged is not."""
        if self._pending is not None:
            self.settle()
        return self._all_held(refs)

    def seed(self, refs: list[int], messages: list[Any], size: int) -> int:
        """Keep the messages of a checkpoint's message section (``messages[i]`` is what ``refs[i]`` names; None
        items are skipped), each counted as ``size`` JSON bytes (the section's average), as :meth:`keep_read`
        keeps what a pass read: never evicting, and only while the budget has room. Returns how many it kept.

        What a message section holds is what the log's records held when the checkpoint was written; records
        change in place only by erasure, which deletes the checkpoint before it changes the log (erasure.py)."""
        if self._pending is not None:
            self.settle()
        cost = size + MESSAGE_OVERHEAD
        room = max(0, (self.cache_bytes - self._held) // cost)
        cache, floor, block = self._cache, self._floor, self._block
        if not cache and not block and not floor and None not in messages:
            # (the usual case, a seed at open into an empty cache: one plain dict, made in one call; _block)
            block = dict(zip(refs, messages) if room >= len(refs) else zip(refs[:room], messages[:room]))
            self._block, self._block_order, self._block_next, self._block_cost = block, refs, 0, cost
            self._held += cost * len(block)
            return len(block)
        if floor or None in messages or block:
            fresh = [(r, (m, cost)) for r, m in zip(refs, messages)
                     if m is not None and r >= floor and r not in cache and r not in block]
            del fresh[room:]
            cache.update(fresh)
            self._held += cost * len(fresh)
            return len(fresh)
        # (the common case, every item a message: one update, then what the cache held before put back as it was)
        held = list(cache.items())
        before = len(cache)
        cache.update(zip(refs[:room], zip(messages[:room], repeat(cost))))
        cache.update(held)
        added = len(cache) - before
        self._held += cost * added
        return added

    def put(self, ref: int, message: dict[str, Any], size: int) -> None:
        """Keep ``message`` (about ``size`` bytes) as what ``ref`` names, evicting the least recently used."""
        if self._pending is not None:
            self.settle()
        if ref < self._floor:
            return
        cache = self._cache
        old = cache.pop(ref, None)
        if old is not None:
            self._held -= old[1]
        elif self._block and self._block.pop(ref, None) is not None:
            self._held -= self._block_cost
        if size > self.cache_bytes:
            return
        cache[ref] = (message, size)
        self._held += size
        while self._held > self.cache_bytes:
            if self._block:  # (the seeded messages are the least recently used)
                self._evict_seeded()
                continue
            _, (_, n) = cache.popitem(last=False)
            self._held -= n

    def _evict_seeded(self) -> None:
        """Drop the oldest message of ``_block`` still there (in the section's order)."""
        block, order, i = self._block, self._block_order, self._block_next
        while i < len(order):
            ref = order[i]
            i += 1
            if block.pop(ref, None) is not None:
                self._held -= self._block_cost
                break
        else:  # (not reached: every ref of the block is in its order)
            block.popitem()
            self._held -= self._block_cost
        self._block_next = i
        if not block:
            self._block_order, self._block_next = [], 0

    def clear(self) -> None:
        """Forget everything read (after records were rewritten: erasure), and a seed deferred."""
        self._pending = None
        self._cache.clear()
        self._block, self._block_order, self._block_next = {}, [], 0
        self._held = 0

    @property
    def held_bytes(self) -> int:
        if self._pending is not None:
            self.settle()
        return self._held


class MessageReader(PageCache):
    """Reads messages by ref from one session's log (its folder ``directory``), through an LRU cache of at most
    ``cache_bytes``. Lines are read through a :class:`~context_persistent.storage.segments.LogReader` kept open (global
    positions across sealed segments); it is opened again when a position lies beyond what it saw (a roll since)
    and by :meth:`clear`. :meth:`close` releases it.
    """

    def __init__(self, directory: Path, cache_bytes: int = CACHE_BYTES,
                 open_reader: Callable[[], LogReader] | None = None) -> None:
        super().__init__(cache_bytes)
        #: Opens the reader first (a read-only log's own files: log.FileEventLog.reader); a position beyond
        #: what it holds is looked for again in the log as it is now.
        self._open_reader = open_reader
        self.directory = directory
        self.path = directory / LOG_NAME
        self._reader: LogReader | None = None

    def _broken(self, at: int, reason: str) -> LogCorruptedError:
        return LogCorruptedError(str(self.path), 0, at, reason)

    def fetch_many(self, refs: list[int]) -> list[dict[str, Any]]:
        """The messages ``refs`` name, in order: those not in the cache read in runs, each run one sequential
        read of the log from its first record to its last (``RUN_BYTES`` at most): what iterating a history
        costs is then about a replay's parse, not a read per message. Messages read here are kept while the cache
        has room for them (:meth:`keep_read`): they never evict what it holds."""
        out, want = self._uncached(refs)
        if want:
            positions = sorted(want)
            i = 0
            while i < len(positions):
                j = i
                while j + 1 < len(positions) and positions[j + 1] - positions[i] <= RUN_BYTES:
                    j += 1
                self._read_run(positions[i:j + 1], want, refs, out)
                i = j + 1
        return out

    def _read_run(self, positions: list[int], want: dict[int, list[int]], refs: list[int], out: list[Any]) -> None:
        done = set()
        if self._reader is None:
            self._reader = self._open(0)
        lines = self._reader.lines(positions[0], positions[-1] + 1)
        # A pass keeps what it reads only while the whole log fits the budget (its bytes bound the history's): a
        # longer history is paged, and a pass over it streams, its memory bounded whatever its length.
        resident = self._reader.end() <= self.cache_bytes
        while True:
            try:
                at, line = next(lines)
            except StopIteration:
                break
            except (ValueError, LogCorruptedError):
                break  # (the reader predates a roll: what is left is read one by one below, which reopens it)
            ks = want.get(at)
            if ks is None or not line.endswith(b"\n"):
                continue
            rec = self._record(at, line)
            share = len(line) // len(ks)
            for k in ks:
                out[k] = message = self._message(at, rec, refs[k] & _INDEX_MASK)
                if resident:
                    self.keep_read(refs[k], message, share)
            done.add(at)
        for p in positions:
            if p not in done:
                for k in want[p]:
                    out[k] = self.fetch(refs[k])

    def _open(self, attempt: int) -> LogReader:
        if self._open_reader is not None and not attempt:
            return self._open_reader()
        return LogReader(self.directory)

    def _line(self, position: int) -> bytes:
        """The line at global ``position``: through the open reader, opened again once if the position is
        beyond what it saw; LogCorruptedError if no complete line starts there."""
        for attempt in (0, 1):
            if self._reader is None:
                self._reader = self._open(attempt)
            try:
                line = self._reader.read_line_at(position)
            except (ValueError, LogCorruptedError) as e:  # (past what the reader saw: opened before a roll?)
                line, why = b"", e.reason if isinstance(e, LogCorruptedError) else str(e)
            else:
                why = "the log ends before its newline"
                if line.endswith(b"\n"):
                    return line
            self._reader.close()
            self._reader = None
            if attempt:
                raise LogCorruptedError(str(self.path), 0, position, f"no complete record starts at this byte, which "
                                        f"a message of the history refers to: {why}")
        raise AssertionError("unreachable")

    def clear(self) -> None:
        """Forget everything read (after the log was rewritten: erasure)."""
        super().clear()
        self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
