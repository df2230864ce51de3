"""The state a session's events fold into (pure).

``Projection.apply(record)`` is the one fold function: replay on open, the incremental update after each
append, and checkpoint restore all go through it (a checkpoint is this state, serialised).

Every message has a key: ``seq << 20 | index`` where ``seq`` is the event that added it and ``index`` its
position inside that event (0 for ``message_added``; the list position for ``messages_replaced``). Keys are
stable across restarts, so pins and redactions can name a message.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from . import events as ev
from .codec import FORMAT_VERSION
from ..errors import InvalidRecordError

INDEX_BITS = 20
MAX_BATCH = 1 << INDEX_BITS  # messages one messages_replaced event may hold


def make_key(seq: int, index: int = 0) -> int:
    return (seq << INDEX_BITS) | index


def split_key(key: int) -> tuple[int, int]:
    return key >> INDEX_BITS, key & (MAX_BATCH - 1)



def new_keys(values: Iterable[int] = ()) -> "array[int]":
    """A list of message keys, packed: 8 bytes a key (``array('q')``; keys are ints below 2**63)."""
    return array("q", values)


def _list_of(values: Any) -> list[Any]:
    return values.tolist() if type(values) is array else list(values)


def same_items(a: Any, b: Any) -> bool:
    """Whether two per-message lists (lists, packed or lazy) hold equal items, in order."""
    if type(a) is type(b) is array:
        return a == b  # type: ignore[no-any-return]
    if type(a) is type(b) is Counts or type(a) is type(b) is Refs and not a.extras and not b.extras:
        return a.a == b.a  # type: ignore[no-any-return]
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


class _Packed(ABC):
    """A list of per-message values held as 8-byte ints (``array('q')``) instead of Python objects (about
    24 bytes a message for a history's refs, keys and token counts instead of about 120). Reads and writes
    go through ``_enc``/``_dec``; every list operation the projection's users make is supported."""

    __slots__ = ("a",)

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self.a = array("q")
        self.extend(values)

    @abstractmethod
    def _enc(self, v: Any) -> int:
        """The int stored for ``v``."""

    @abstractmethod
    def _dec(self, v: int) -> Any:
        """The value a stored int stands for."""

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: Any) -> Any:
        if type(i) is slice:
            dec = self._dec
            return [dec(v) for v in self.a[i]]
        return self._dec(self.a[i])

    def __setitem__(self, i: Any, value: Any) -> None:
        if type(i) is slice:
            enc = self._enc
            self.a[i] = array("q", [enc(v) for v in value])
        else:
            self.a[i] = self._enc(value)

    def __delitem__(self, i: Any) -> None:
        del self.a[i]

    def append(self, value: Any) -> None:
        self.a.append(self._enc(value))

    def extend(self, values: Iterable[Any]) -> None:
        enc = self._enc
        self.a.extend(array("q", [enc(v) for v in values]))

    def __iter__(self) -> Iterator[Any]:
        dec = self._dec
        for v in self.a:
            yield dec(v)

    def __contains__(self, value: Any) -> bool:
        return any(v == value for v in self)

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        n = len(self.a)
        stop = n if stop is None else stop
        for i in range(*slice(start, stop).indices(n)):
            if self[i] == value:
                return i
        raise ValueError(f"{value!r} is not in list")

    def count(self, value: Any) -> int:
        return sum(1 for v in self if v == value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (_Packed, LazyList, list, PagedList)):
            return same_items(self, other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def tolist(self) -> list[Any]:
        return list(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"


#: How a token count not made yet is held in :class:`Counts`.
NOT_COUNTED = -1


class Counts(_Packed):
    """Token counts, one per message: an int, or None for a message not counted yet (held as -1)."""

    __slots__ = ()

    @classmethod
    def none(cls, n: int) -> "Counts":
        """``n`` counts not made yet."""
        c = cls()
        c.a = array("q", [NOT_COUNTED]) * n
        return c

    def _enc(self, v: Any) -> int:
        return NOT_COUNTED if v is None else v  # type: ignore[no-any-return]

    def _dec(self, v: int) -> Any:
        return None if v < 0 else v

    def append(self, value: Any) -> None:  # (once per message of a replay: no _enc call)
        self.a.append(NOT_COUNTED if value is None else value)

    def extend(self, values: Iterable[Any]) -> None:
        if type(values) is Counts:
            self.a.extend(values.a)
        else:
            self.a.extend(array("q", [NOT_COUNTED if v is None else v for v in values]))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.a) if NOT_COUNTED not in self.a else super().__iter__()

    def _code(self, value: Any) -> int | None:
        """The packed value of ``value``, None if no count equals it."""
        if value is None:
            return NOT_COUNTED
        return value if type(value) is int and value >= 0 else None

    def __contains__(self, value: Any) -> bool:
        code = self._code(value)
        return code is not None and code in self.a

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        code = self._code(value)
        if code is None:
            raise ValueError(f"{value!r} is not in list")
        return self.a.index(code, start, len(self.a) if stop is None else stop)

    def count(self, value: Any) -> int:
        code = self._code(value)
        return 0 if code is None else self.a.count(code)

    def copy(self) -> "Counts":
        c = Counts()
        c.a = array("q", self.a)
        return c


class Refs(_Packed):
    """The items of a paged history: refs (ints >= 0, pages.make_ref) packed; any other item (a message whose
    record position is not known, such as an expired record's placeholders) is kept in ``extras`` and held
    as ``~j``, its index there."""

    __slots__ = ("extras",)

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self.extras: list[Any] = []
        super().__init__(values)

    def _enc(self, v: Any) -> int:
        if type(v) is int:
            if v < 0:
                raise ValueError(f"a reference to the log is {v}, not a position")
            return v
        self.extras.append(v)
        return ~(len(self.extras) - 1)

    def _dec(self, v: int) -> Any:
        return v if v >= 0 else self.extras[~v]

    def append(self, value: Any) -> None:  # (once per message of a replay: no _enc call for a ref)
        self.a.append(value if type(value) is int and value >= 0 else self._enc(value))

    def extend(self, values: Iterable[Any]) -> None:
        if type(values) is Refs and not values.extras:
            self.a.extend(values.a)
        else:
            super().extend(values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.a) if not self.extras else super().__iter__()

    def copy(self) -> "Refs":
        r = Refs()
        r.a, r.extras = array("q", self.a), list(self.extras)
        return r


def json_default(value: Any) -> Any:
    """``orjson.dumps(..., default=json_default)``: a packed list as the JSON list it stands for."""
    if isinstance(value, (_Packed, array)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")



def expired_range(data: dict[str, Any], seq: int | None) -> tuple[int, int]:
    """``(first_seq, last_seq)`` of an ``expired`` record's data, checked (before the record's own ``seq``)."""
    lo, hi = data["first_seq"], data["last_seq"]
    if type(lo) is not int or type(hi) is not int or not 1 <= lo <= hi or (seq is not None and hi >= seq):
        raise ValueError(f"data.first_seq..last_seq is {lo!r}..{hi!r}: it must be a range of earlier seqs")
    return lo, hi


#: grouping.SYSTEM_ROLES, repeated so that ``import context_persistent`` does not load grouping (~10 ms);
#: tests/test_lazy_open.py checks that the two agree.
SYSTEM_ROLES = ("system", "developer")

#: Loads the part of the state a lazy projection does not hold yet: returns ``(messages, keys, tokens)`` of
#: the first ``n`` messages (see :class:`LazyList`).
BaseLoader = Callable[[], tuple[list[Any], list[Any], list[Any]]]


class LoadRefused(Exception):
    """A lazy list was asked to load the rest inside :meth:`Projection.loads_refused` (nothing was loaded)."""


class _Bulk:
    """What the three lazy lists of one projection share: the loader of the part they do not hold."""

    __slots__ = ("n", "loader", "lists", "owner", "refuse")

    def __init__(self, n: int, loader: BaseLoader, owner: "Projection") -> None:
        self.n = n
        self.loader: BaseLoader | None = loader
        self.lists: tuple[LazyList, LazyList, LazyList] | None = None
        self.owner = owner
        self.refuse = False

    def load(self) -> None:
        """Load the rest once; every lazy list (and the projection) then holds a plain list."""
        loader = self.loader
        if loader is None:
            return
        if self.refuse:
            raise LoadRefused("this needs the part of the history that is not loaded")
        base = loader()  # (if it raises, the next access tries again and raises again: nothing half-loaded)
        if any(len(part) != self.n for part in base):
            raise ValueError(f"the loaded state holds {[len(p) for p in base]} items, expected {self.n}")
        self.loader = None
        assert self.lists is not None
        for lazy, full in zip(self.lists, base):
            lazy._fill(full)
        owner = self.owner
        messages, keys, tokens = self.lists
        if owner.messages is messages:  # (an event such as cleared may have replaced them since)
            owner.messages, owner.keys, owner.tokens = messages._full, keys._full, tokens._full  # type: ignore[assignment]


class LazyList:
    """A list of ``n`` items of which only some are in memory until the rest is needed.

    Items at ``known`` indices and items appended later are served directly; any other access (an unknown
    index, iteration, ``index``, ``count``, a slice over unknown items, deletion) first loads the rest
    through the shared loader, then behaves exactly like the plain list. Code written for lists therefore
    stays correct: it is only slower the first time it touches what was not kept. See docs/architecture.md
    ("Lazy open").
    """

    __slots__ = ("_bulk", "_known", "_tail", "_full", "system_indices", "_pager")

    def __init__(self, bulk: _Bulk, known: dict[int, Any], system_indices: list[int] | None = None,
                 pager: Pager | None = None, tail: Any = None) -> None:
        self._bulk = bulk
        #: For the messages list of a paged history: items that are ints are refs, read through it.
        self._pager = pager
        self._known = known
        #: Items appended since the open (a packed list where the loaded one is packed).
        self._tail: Any = [] if tail is None else tail
        self._full: list[Any] | None = None
        #: For the messages list: every system/developer index (complete), so a windowed rebuild need not scan.
        self.system_indices = system_indices

    def _fill(self, base: Any) -> None:
        paged = type(base) is PagedList
        for i, v in self._known.items():  # newer than the bulk (token counts made since it was written)
            if paged and type(v) is dict and type(base.items[i]) is int:
                continue  # (a message the front section held, which the bulk refers to: keep the ref)
            base[i] = v
        base.extend(self._tail)
        self._full, self._known, self._tail = base, {}, self._tail[:0]
        self.system_indices = None

    @property
    def loaded(self) -> bool:
        return self._full is not None

    def _all(self) -> list[Any]:
        if self._full is None:
            self._bulk.load()
        assert self._full is not None
        return self._full

    def _index(self, i: int) -> int:
        n = self._bulk.n + len(self._tail)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError("list index out of range")
        return j

    def __len__(self) -> int:
        return len(self._full) if self._full is not None else self._bulk.n + len(self._tail)

    def __getitem__(self, i: Any) -> Any:
        if self._full is not None:
            return self._full[i]
        if type(i) is slice:
            start, stop, step = i.indices(len(self))
            if step == 1 and start >= stop:
                return []
            if step == 1 and (start >= self._bulk.n or all(j in self._known for j in range(start, min(stop, self._bulk.n)))):
                return [self[j] for j in range(start, stop)]
            return self._all()[i]
        j = self._index(i)
        n = self._bulk.n
        if j >= n:
            v = self._tail[j - n]
        else:
            try:
                v = self._known[j]
            except KeyError:
                return self._all()[j]
        return self._pager.fetch(v) if type(v) is int and self._pager is not None else v

    def __setitem__(self, i: Any, value: Any) -> None:
        if self._full is not None or type(i) is slice:
            self._all()[i] = value
            return
        j = self._index(i)
        n = self._bulk.n
        if j >= n:
            self._tail[j - n] = value
        elif j in self._known:
            self._known[j] = value
        else:
            self._all()[j] = value

    def get_known(self, i: int, default: Any = None) -> Any:
        """The item at ``i`` if it is in memory, else ``default`` (never loads)."""
        if self._full is not None:
            return self._full[i]
        n = self._bulk.n
        v = self._tail[i - n] if i >= n else self._known.get(i, default)
        return self._pager.fetch(v) if type(v) is int and self._pager is not None else v

    def known_indices(self) -> list[int]:
        """The indices served without loading, in order."""
        if self._full is not None:
            return list(range(len(self._full)))
        n = self._bulk.n
        return sorted(self._known) + list(range(n, n + len(self._tail)))

    def append(self, value: Any) -> None:
        if self._full is not None:
            self._full.append(value)
            return
        if self.system_indices is not None:
            m = self._pager.fetch(value) if type(value) is int and self._pager is not None else value
            if type(m) is dict and m.get("role") in SYSTEM_ROLES:
                self.system_indices.append(len(self))
        self._tail.append(value)

    def __delitem__(self, i: Any) -> None:
        if self._full is None and type(i) is slice and i.step is None and i.stop is None:
            start = i.start if i.start is not None else 0
            n = len(self)
            j = start + n if start < 0 else start
            if self._bulk.n <= j <= n:  # only items appended since the open: no need to load the rest
                del self._tail[j - self._bulk.n:]
                if self.system_indices is not None:
                    self.system_indices[:] = [k for k in self.system_indices if k < j]
                return
        del self._all()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    def __contains__(self, value: Any) -> bool:
        return value in self._all()

    def __eq__(self, other: object) -> bool:
        return same_items(self._all(), other._all() if isinstance(other, LazyList) else other)

    __hash__ = None  # type: ignore[assignment]

    def index(self, value: Any, *args: Any) -> int:
        return self._all().index(value, *args)

    def count(self, value: Any) -> int:
        return self._all().count(value)

    def __repr__(self) -> str:
        if self._full is not None:
            return repr(self._full)
        return f"<LazyList {len(self)} items, {len(self._known) + len(self._tail)} in memory>"


class Pager(Protocol):
    """Where a paged history reads its messages (pages.MessageReader, pg/pages.PostgresMessageReader):
    ``fetch(ref)``, ``fetch_many(refs)`` and ``put(ref, message, size)``."""

    def fetch(self, ref: int) -> dict[str, Any]: ...

    def fetch_many(self, refs: list[int]) -> list[dict[str, Any]]: ...

    def put(self, ref: int, message: dict[str, Any], size: int) -> None: ...


class PagedList:
    """The messages of a history whose items are messages (dicts) or references to them in the log (ints,
    pages.make_ref). Reads resolve references through the pager (a small cache, then the log); the list
    itself holds 8 bytes per message (:class:`Refs`). Structural changes (append, delete, slices) work on the
    items as they are, so nothing is read for them. ``items`` is the raw list (what a checkpoint stores).
    """

    __slots__ = ("items", "pager")

    def __init__(self, items: Iterable[Any], pager: Pager) -> None:
        self.items = items if type(items) is Refs else Refs(items)
        self.pager = pager

    def _get(self, v: Any) -> Any:
        return self.pager.fetch(v) if type(v) is int else v

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        if type(i) is slice:
            return _resolve(self.items[i], self.pager)
        v = self.items[i]
        return self.pager.fetch(v) if type(v) is int else v

    def __setitem__(self, i: Any, value: Any) -> None:
        self.items[i] = value

    def __delitem__(self, i: Any) -> None:
        del self.items[i]

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values.items if type(values) is PagedList else values)

    def __iter__(self) -> Iterator[Any]:
        items, pager = self.items, self.pager
        for start in range(0, len(items), ITER_CHUNK):  # (refs read in runs: pages.MessageReader.fetch_many)
            yield from _resolve(items[start:start + ITER_CHUNK], pager)

    def __contains__(self, value: Any) -> bool:
        return any(m == value for m in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PagedList, LazyList, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def index(self, value: Any, *args: Any) -> int:
        start = args[0] if args else 0
        for i in range(start, len(self.items)):
            if self[i] == value:
                return i
        raise ValueError(f"{value!r} is not in list")

    def count(self, value: Any) -> int:
        return sum(1 for m in self if m == value)

    def __repr__(self) -> str:
        return f"<PagedList {len(self.items)} messages>"


#: Items a PagedList resolves per read of the log while iterating.
ITER_CHUNK = 1024


def _resolve(items: list[Any], pager: Pager) -> list[Any]:
    """``items`` with every ref replaced by its message (read together, in runs)."""
    refs = [v for v in items if type(v) is int]
    if not refs:
        return list(items)
    got = iter(pager.fetch_many(refs))
    return [next(got) if type(v) is int else v for v in items]


def raw_items(messages: Any) -> Any:
    """The items of a history as stored: messages, or refs where the history is paged (never reads); a
    paged history's are its :class:`Refs` (not a copy)."""
    return messages.items if type(messages) is PagedList else list(messages)


class Projection:
    """Full history plus pins, as of ``head_seq``. Mutated only by :meth:`apply`.

    A projection restored from a checkpoint's front section (:meth:`lazy`) holds only part of the history
    in memory (``messages``, ``keys`` and ``tokens`` are :class:`LazyList`); it loads the rest on first need,
    or when :meth:`materialise` is called, and is from then on an ordinary projection.
    """

    __slots__ = ("messages", "keys", "tokens", "pinned", "head_seq", "has_history", "session", "version",
                 "counts", "counted_version", "removed", "pager")

    def __init__(self, pager: Pager | None = None) -> None:
        #: With a pager (pages.MessageReader, pg/pages.PostgresMessageReader), messages are kept as refs to
        #: their records wherever :meth:`apply` is given the record's position (a file log's byte position,
        #: a PostgreSQL record's seq): ``messages`` is then a :class:`PagedList`.
        self.pager = pager
        self.messages: list[dict[str, Any]] = PagedList([], pager) if pager is not None else []  # type: ignore[assignment]
        #: The messages' keys, packed (``array('q')``).
        self.keys: Any = new_keys()
        #: Token count of each message under the manager's counter, ``None`` until first needed (packed).
        self.tokens: Any = Counts()
        self.pinned: set[int] = set()
        self.head_seq = 0
        #: True once any event that changes history (add, replace, clear) has been applied.
        self.has_history = False
        #: The ``session_started`` data (format, tokenizer, program, parent).
        self.session: dict[str, Any] = {}
        #: Bumped on every change that can alter a view; caches compare it.
        self.version = 0
        #: Events seen, by type (for stats).
        self.counts: dict[str, int] = {}
        #: The ``version`` at which every entry of ``tokens`` was last known to be counted (-1: never).
        self.counted_version = -1
        #: Key ranges ``(first, last)`` of messages seen removed since this projection began: erased ones and
        #: those of seq gaps (records a repair quarantined). A later pin of one pins nothing, and a
        #: ``replay_recognised`` naming one (removed after the fold was written) folds the others. (Erasure
        #: and repair delete the checkpoint; the next one is written past these records, so need not keep them.)
        self.removed: list[tuple[int, int]] = []

    def apply(self, rec: dict[str, Any], position: int | None = None, length: int = 0) -> None:
        """Fold one record into the state; InvalidRecordError if its data lacks what its type needs.

        ``position``: where the record starts in the log (and ``length``, its line's bytes): a paged projection
        then keeps refs to its messages instead of the messages (they stay in the pager's cache for a while).
        """
        try:
            self._apply(rec, position if self.pager is not None else None, length)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            raise InvalidRecordError(rec.get("seq"), rec.get("type"), f"{type(e).__name__}: {e}") from None

    def _paged(self, items: Any) -> Any:
        return PagedList(items, self.pager) if self.pager is not None else items

    def _refs(self, position: int | None, msgs: list[Any], indices: Any, length: int) -> list[Any]:
        """The items for ``msgs[i]`` (``i`` in ``indices``) of the record at ``position``: refs (the messages
        go to the pager's cache) where the record's position is known, else the messages."""
        if position is None:
            return [msgs[i] for i in indices]
        pager = self.pager
        assert pager is not None
        share = max(1, length // max(1, len(msgs)))
        out = []
        for i in indices:
            ref = (position << INDEX_BITS) | i
            pager.put(ref, msgs[i], share)
            out.append(ref)
        return out

    def _keys_with_head(self, head: list[int], n: int) -> None:
        """Keys and token counts with the first ``n`` replaced by ``head`` (new messages, not counted)."""
        keys = new_keys(head)
        keys.extend(self.keys[n:])
        tokens = Counts.none(len(head))
        tokens.extend(self.tokens[n:])
        self.keys, self.tokens = keys, tokens

    def _with_head(self, head: list[Any], n: int) -> Any:
        """The history with its first ``n`` items replaced by ``head`` (never reads a paged history's messages)."""
        messages: Any = self.messages
        if type(messages) is LazyList:
            messages = messages._all()
        if type(messages) is PagedList:
            items = Refs(head)
            items.extend(messages.items[n:])
            return PagedList(items, messages.pager)
        return [*head, *messages[n:]]

    def _apply(self, rec: dict[str, Any], position: int | None = None, length: int = 0) -> None:
        seq = rec["seq"]
        kind = rec["type"]
        data = rec["data"]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if seq > self.head_seq + 1:  # a gap: records a repair quarantined
            self.removed.append((make_key(self.head_seq + 1), make_key(seq - 1, MAX_BATCH - 1)))
        self.head_seq = seq
        if kind == ev.MESSAGE_ADDED:
            message = data["message"]
            if type(message) is not dict:
                raise TypeError(f"data.message is {type(message).__name__}, not a message object")
            if position is not None:
                ref = position << INDEX_BITS
                self.pager.put(ref, message, length)  # type: ignore[union-attr]
                self.messages.append(ref)  # type: ignore[arg-type]
            else:
                self.messages.append(message)
            self.keys.append(seq << INDEX_BITS)
            self.tokens.append(None)
            self.has_history = True
        elif kind == ev.MESSAGES_REPLACED:
            msgs = data["messages"]
            if type(msgs) is not list or any(type(m) is not dict for m in msgs):
                raise TypeError("data.messages is not a list of message objects")
            self.messages = self._paged(self._refs(position, msgs, range(len(msgs)), length))
            self.keys = new_keys(make_key(seq, i) for i in range(len(msgs)))
            self.tokens = Counts.none(len(msgs))
            self.pinned = set()
            self.has_history = True
        elif kind == ev.CLEARED:
            self.messages = self._paged([])
            self.keys = new_keys()
            self.tokens = Counts()
            self.pinned = set()
            self.has_history = True
        elif kind == ev.PINNED:
            if not (self.removed and self._was_removed(data["key"])):  # (a pin of an erased message)
                self.pinned.add(data["key"])
        elif kind == ev.UNPINNED:
            self.pinned.discard(data["key"])
        elif kind == ev.REDACTED:
            key = data["key"]
            try:
                i = self.keys.index(key)
            except ValueError:
                pass
            else:
                del self.messages[i], self.keys[i], self.tokens[i]
                self.pinned.discard(key)
        elif kind == ev.REPLAY_RECOGNISED and "keys" in data:
            # The newest messages repeated the loaded history (replay.py): out of the views, kept in the log.
            keys = data["keys"]
            n = len(keys) if type(keys) is list else 0
            if n == 0 or n > len(self.keys) or not self._ends_with(keys):
                keys = self._fold_survivors(keys) if n else None
                if keys is None:
                    raise ValueError("data.keys must name the newest messages of the history, in order")
                n = len(keys)
            if n:
                del self.messages[-n:], self.keys[-n:], self.tokens[-n:]
                self.pinned.difference_update(keys)
        elif kind == ev.SYSTEM_PROMPT_SET:
            self._set_system_prompt(seq, data["messages"], position, length)
        elif kind == ev.ERASED:
            self._apply_erased(seq, data, position, length)
        elif kind == ev.EXPIRED:
            self._apply_expired(seq, data, position, length)
        elif kind == ev.SESSION_STARTED:
            self.session = dict(data)
        elif kind in ev.EVENT_TYPES:
            return  # audit events (transcript_ignored, compacted, ...) leave the views as they are
        else:
            # A newer major format is refused by its version; within this one, an unknown type is damage.
            raise ValueError(f"unknown event type {kind!r}; format {FORMAT_VERSION} knows "
                             f"{', '.join(sorted(ev.EVENT_TYPES))}")
        self.version += 1

    def _was_removed(self, key: int) -> bool:
        return any(lo <= key <= hi for lo, hi in self.removed)

    def _fold_survivors(self, keys: list[Any]) -> list[int] | None:
        """The keys of a replay fold without those of messages removed after it was written (erased, or
        quarantined by a repair), if what is left names the newest messages of the history; else None."""
        if not self.removed or any(type(k) is not int for k in keys):
            return None
        left = [k for k in keys if not self._was_removed(k)]
        if len(left) == len(keys) or len(left) > len(self.keys) or (left and not self._ends_with(left)):
            return None
        return left

    def _ends_with(self, keys: list[Any]) -> bool:
        """Whether the newest messages' keys are ``keys`` (``keys`` not empty)."""
        return _list_of(self.keys[-len(keys):]) == keys

    def leading_system_count(self) -> int:
        """How many ``system`` messages open the history (the system prompt; a lazy list reads no others)."""
        messages = self.messages
        system = getattr(messages, "system_indices", None) if type(messages) is LazyList else None
        n = 0
        if system is not None:
            for i in system:
                if i != n or messages[i].get("role") != "system":
                    break
                n += 1
            return n
        for m in messages:
            if m.get("role") != "system":
                break
            n += 1
        return n

    def _set_system_prompt(self, seq: int, new: Any, position: int | None = None, length: int = 0) -> None:
        """``system_prompt_set``: the leading system messages become ``new`` (keys ``seq << 20 | i``)."""
        if type(new) is not list or not new or any(type(m) is not dict or m.get("role") != "system" for m in new):
            raise TypeError("data.messages is not a non-empty list of system messages")
        n = self.leading_system_count()
        self.pinned.difference_update(self.keys[i] for i in range(n))
        items = self._refs(position, new, range(len(new)), length)
        if n == len(new):  # the usual change: same positions, replaced in place (a lazy list stays lazy)
            for i, m in enumerate(items):
                self.messages[i], self.keys[i], self.tokens[i] = m, make_key(seq, i), None
        else:
            self.messages = self._with_head(items, n)
            self._keys_with_head([make_key(seq, i) for i in range(len(new))], n)
        self.has_history = True

    def _apply_erased(self, seq: int, data: dict[str, Any], position: int | None = None, length: int = 0) -> None:
        """An erasure tombstone (erasure.py) in place of the record that held the erased messages: the record's
        other messages apply as before, the erased ones as if redacted."""
        gone = {e["index"] for e in data["erased"]}
        if any(type(i) is not int for i in gone) or not gone:
            raise TypeError("data.erased does not list the erased message indices")
        of = data["of"]
        if of == ev.MESSAGE_ADDED:
            if gone != {0}:
                raise ValueError(f"an erased message_added lists indices {sorted(gone)}, not [0]")
            self.removed.append((make_key(seq), make_key(seq)))
        elif of in (ev.MESSAGES_REPLACED, ev.SYSTEM_PROMPT_SET):
            msgs = data["messages"]
            if type(msgs) is not list or any((m is None) != (i in gone) or (m is not None and type(m) is not dict)
                                             for i, m in enumerate(msgs)):
                raise TypeError("data.messages is not a list of message objects with null at the erased indices")
            kept = [i for i in range(len(msgs)) if i not in gone]
            self.removed.extend((make_key(seq, i), make_key(seq, i)) for i in sorted(gone))
            if of == ev.SYSTEM_PROMPT_SET:  # the leading system messages become the prompts not erased
                if any(msgs[i].get("role") != "system" for i in kept):
                    raise TypeError("data.messages of an erased system_prompt_set holds a non-system message")
                n = self.leading_system_count()
                self.pinned.difference_update(self.keys[i] for i in range(n))
                self.messages = self._with_head(self._refs(position, msgs, kept, length), n)
                self._keys_with_head([make_key(seq, i) for i in kept], n)
            else:
                self.messages = self._paged(self._refs(position, msgs, kept, length))
                self.keys = new_keys(make_key(seq, i) for i in kept)
                self.tokens = Counts.none(len(kept))
                self.pinned = set()
        elif of == ev.EXPIRED:  # carried copies erased: those messages leave the views with the expired ones
            self._apply_expired(seq, data["expired"], position, length)
            return
        else:
            raise ValueError(f"data.of is {of!r}; a tombstone replaces a message_added, messages_replaced, "
                             "system_prompt_set or expired record")
        self.has_history = True

    def _apply_expired(self, seq: int, data: dict[str, Any], position: int | None = None, length: int = 0) -> None:
        """``expired`` (segment retention, retention.py): the records ``first_seq..last_seq`` left the log. The
        messages they added leave every view, except those it carries (the system prompt and the pinned
        messages when it was written), which stay where they are, from now on read from the copies inside this
        record (a paged history's refs point into this record, never into the expired segments). A replay that
        starts after the expired range begins from :meth:`seeded` (placeholders, negative keys, stand where the
        other messages were, so that the records in between fold as they did); this record then drops the
        placeholders, and both ways end in the same state."""
        lo, hi = expired_range(data, seq)
        copies = {c["key"]: j for j, c in enumerate(data["carried"])}
        if any(type(k) is not int or not 1 <= split_key(k)[0] <= hi for k in copies):
            raise ValueError("data.carried keys must be integers of messages the expired records (or earlier "
                             "expired ones) added")
        erased = {c["key"] for c in data["carried"] if c["message"] is None}  # (erased copies: not carried)
        for k in erased:
            del copies[k]
        low, high = make_key(lo), make_key(hi, MAX_BATCH - 1)

        def stays(k: int) -> bool:
            return k >= 0 and k not in erased and (not low <= k <= high or k in copies)

        messages: Any = self.messages
        if type(messages) is LazyList:
            messages = messages._all()
        items = raw_items(messages)
        keys = self.keys
        keep = [i for i, k in enumerate(keys) if stays(k)]
        new = [items[i] for i in keep]
        pager = self.pager if type(messages) is PagedList else None
        share = max(1, length // max(1, len(copies)))
        for n, i in enumerate(keep):
            j = copies.get(keys[i])
            if j is None:
                continue
            if pager is not None and position is not None:
                ref = (position << INDEX_BITS) | j
                pager.put(ref, data["carried"][j]["message"], share)
                new[n] = ref
            elif pager is None:
                new[n] = data["carried"][j]["message"]
        self.messages = self._paged(new) if pager is not None else new
        if len(keep) != len(keys):
            self.keys = new_keys(keys[i] for i in keep)
            tokens = self.tokens
            self.tokens = Counts(tokens[i] for i in keep)
        self.pinned = {k for k in self.pinned if stays(k)}
        self.removed.append((low, high))
        self.removed.extend((k, k) for k in sorted(erased) if not low <= k <= high)

    @classmethod
    def seeded(cls, data: dict[str, Any], pager: Pager | None = None, position: int | None = None) -> "Projection":
        """The state a replay starts from when the log begins after an ``expired`` record's range: the carried
        messages where they were at the end of the range, a placeholder for each run of the others
        (``layout``), the pins of carried messages then, and the session's ``session_started`` data. With a
        ``pager`` and the record's ``position``, the carried messages are refs into the record."""
        lo, hi = expired_range(data, None)
        carried = {c["key"]: (j, c["message"]) for j, c in enumerate(data["carried"]) if c["message"] is not None}
        erased = {c["key"]: c.get("role") for c in data["carried"] if c["message"] is None}
        p = cls(pager) if pager is not None else cls()
        items: list[Any] = []
        for item in data["layout"]:
            if "key" in item and item["key"] in erased:  # an erased copy: a placeholder, as if not carried
                item = {"run": "system" if erased[item["key"]] == "system" else "other"}
            if "key" in item:
                key = item["key"]
                j, message = carried[key]
                items.append(message if pager is None or position is None else (position << INDEX_BITS) | j)
                p.keys.append(key)
            else:
                run = item["run"]
                if run not in ("system", "other"):
                    raise ValueError(f"data.layout run is {run!r}, not 'system' or 'other'")
                named = item.get("named", -1)  # (a later record removes it by this key)
                if type(named) is not int or named != -1 and not 1 <= split_key(named)[0] <= hi:
                    raise ValueError(f"data.layout names key {named!r}, not a message of the expired records")
                items.append({"role": "system" if run == "system" else "user", "content": None})
                p.keys.append(named)
            p.tokens.append(None)
        placed = [k for k, item in zip(p.keys, data["layout"]) if "key" in item and k >= 0]
        if len(placed) != len(carried) or set(placed) != set(carried):
            raise ValueError("data.layout does not place every carried message exactly once")
        if pager is not None and position is not None:
            for key, (j, message) in carried.items():
                pager.put((position << INDEX_BITS) | j, message, 1)
            p.messages = p._paged(items)
        else:
            p.messages = items
        p.pinned = {k for k in data["pinned"] if k in carried}
        p.head_seq = hi
        p.has_history = bool(data["layout"])
        p.session = dict(data["session"])
        return p

    def index_of(self, key: int) -> int | None:
        keys = self.keys
        if type(keys) is LazyList and not keys.loaded:
            for i in reversed(keys.known_indices()):  # a recent or kept message: no need to load the rest
                if keys.get_known(i) == key:
                    return i
        try:
            return keys.index(key)
        except ValueError:
            return None

    # -- lazy state -----------------------------------------------------------------------------------
    @property
    def is_lazy(self) -> bool:
        """True while part of the history is not in memory yet."""
        return type(self.messages) is LazyList and not self.messages.loaded

    @contextlib.contextmanager
    def loads_refused(self) -> Iterator[None]:
        """Inside, an access that would load the rest of a lazy history raises :class:`LoadRefused` instead:
        for work worth doing only if what is in memory suffices (a checkpoint's front section)."""
        messages = self.messages
        bulk = messages._bulk if type(messages) is LazyList and not messages.loaded else None
        if bulk is None:
            yield
            return
        bulk.refuse = True
        try:
            yield
        finally:
            bulk.refuse = False

    def materialise(self) -> "Projection":
        """Load what a lazy projection does not hold yet (no-op otherwise); returns self."""
        messages = self.messages
        if type(messages) is LazyList:
            messages._all()
        return self

    @classmethod
    def lazy(cls, meta: dict[str, Any], n: int, known: dict[int, tuple[Any, int, int | None]],
             system_indices: list[int], loader: BaseLoader, pager: Pager | None = None) -> "Projection":
        """A projection of ``n`` messages holding only ``known`` (``index -> (message, key, tokens)``) in memory.

        ``system_indices`` must list every system/developer message (the windowed rebuild relies on it);
        ``loader()`` returns the complete ``(messages, keys, tokens)`` lists when something needs the rest.
        """
        p = cls(pager)
        bulk = _Bulk(n, loader, p)
        lists = (LazyList(bulk, {i: v[0] for i, v in known.items()}, list(system_indices), pager,
                          Refs() if pager is not None else None),
                 LazyList(bulk, {i: v[1] for i, v in known.items()}, tail=new_keys()),
                 LazyList(bulk, {i: v[2] for i, v in known.items()}, tail=Counts()))
        bulk.lists = lists
        p.messages, p.keys, p.tokens = lists  # type: ignore[assignment]
        p._set_facts(meta)
        return p

    def _set_facts(self, facts: dict[str, Any]) -> None:
        """Pins, head seq, history flag, session data and event counts from a checkpoint."""
        self.pinned = set(facts["pinned"])
        self.head_seq = int(facts["head_seq"])
        self.has_history = bool(facts["has_history"])
        self.session = dict(facts["session"])
        self.counts = dict(facts.get("counts", {}))

    # -- checkpoint support -------------------------------------------------------------------------
    def to_state(self, refs: bool = False) -> dict[str, Any]:
        """The state as a checkpoint stores it. ``refs``: the per-message lists as held, packed (a paged
        history's messages as refs to the log: what a checkpoint writes; ``orjson.dumps`` them with
        ``default=json_default``); else plain JSON lists, a paged history's messages all read (for comparisons,
        never on a large history)."""
        self.materialise()
        messages: Any = self.messages
        keys: Any = self.keys
        tokens: Any = self.tokens
        if type(messages) is PagedList:
            messages = messages.items if refs else list(messages)
        if not refs:
            keys, tokens = _list_of(keys), _list_of(tokens)
        return {
            "messages": messages,
            "keys": keys,
            "tokens": tokens,
            "pinned": sorted(self.pinned),
            "head_seq": self.head_seq,
            "has_history": self.has_history,
            "session": self.session,
            "counts": self.counts,
        }

    def capture(self) -> dict[str, Any]:
        """:meth:`to_state` (``refs=True``) as of now, unaffected by later changes: the lists are copies.

        A copy of the packed lists of a million messages takes milliseconds (24 MB); messages held as objects
        are shared, which is safe because a stored message is never changed in place (every event that changes
        the history replaces list items or whole lists). A checkpoint serialises this in steps
        (checkpoint/payload.py).
        """
        state = self.to_state(refs=True)
        for key in ("messages", "keys", "tokens"):
            value = state[key]
            state[key] = value.copy() if type(value) in (Refs, Counts) else (
                array("q", value) if type(value) is array else list(value))
        state["session"], state["counts"] = dict(self.session), dict(self.counts)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], pager: Pager | None = None) -> "Projection":
        """The projection a checkpoint's state holds. Its messages may be refs (ints): they need ``pager``.

        Packed lists in ``state`` (checkpoint.payload.parse_state's, :meth:`capture`'s) are taken over, not
        copied: a long history's are never held twice. Lists are copied."""
        p = cls(pager)
        messages = state["messages"]
        p.messages = p._paged(messages if type(messages) is Refs else list(messages))
        keys, tokens = state["keys"], state["tokens"]
        p.keys = keys if type(keys) is array else new_keys(keys)
        p.tokens = tokens if type(tokens) is Counts else Counts(tokens)
        if not (len(p.messages) == len(p.keys) == len(p.tokens)):
            raise ValueError("checkpoint state has lists of different lengths")
        p._set_facts(state)
        return p
