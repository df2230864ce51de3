"""The per-message lists a projection's history is held in (pure).

- :class:`Counts` and :class:`Refs` pack token counts and refs to the log as 8-byte ints (``array('q')``).
- :class:`PagedList` is a history held as refs to its records, read through a :class:`Pager`.
- :class:`LazyList` is a list of which only some items are in memory until the rest is needed (a projection
  restored from a checkpoint's front section, see docs/architecture.md, "Lazy open").

They compare equal to each other and to plain lists holding the same items (:func:`same_items`), so code written
for lists works on any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .projection import Projection


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

    def __getitem__(self, i: Any) -> Any:
        if type(i) is slice and not self.extras:  # (every item a ref: the ints as they are packed)
            return self.a[i].tolist()
        return super().__getitem__(i)

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
        known = self._known  # newer than the bulk (token counts made since it was written)
        if type(base) is PagedList:  # (a message the front section held, which the bulk refers to: keep the ref)
            items = base.items
            if type(items) is Refs:  # (a ref is held as itself, >= 0; anything else negative)
                a = items.a
                known = {i: v for i, v in known.items() if not (type(v) is dict and a[i] >= 0)}
            else:
                known = {i: v for i, v in known.items() if not (type(v) is dict and type(items[i]) is int)}
        if isinstance(base, _Packed):  # (the packed ints written directly: no call per item)
            a, enc = base.a, base._enc
            for i, v in known.items():
                a[i] = enc(v)
        else:
            for i, v in known.items():
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
            if type(items) is Refs and not items.extras:  # (every item a ref: no item decoded one by one)
                yield from pager.fetch_many(items.a[start:start + ITER_CHUNK].tolist())
            else:
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
    if type(items) is list and set(map(type, items)) == {int}:  # (a history of refs alone: one C-level check)
        return list(pager.fetch_many(items))
    refs = [v for v in items if type(v) is int]
    if not refs:
        return list(items)
    if len(refs) == len(items):  # (a history of refs alone: the messages in their order)
        return list(pager.fetch_many(refs))
    got = iter(pager.fetch_many(refs))
    return [next(got) if type(v) is int else v for v in items]


def raw_items(messages: Any) -> Any:
    """The items of a history as stored: messages, or refs where the history is paged (never reads); a
    paged history's are its :class:`Refs` (not a copy)."""
    return messages.items if type(messages) is PagedList else list(messages)
