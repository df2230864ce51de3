"""The state a session's events fold into (pure): :class:`Projection`.

``Projection.apply(record)`` is the one fold function (fold.py): replay on open, the incremental update after
each append, and checkpoint restore all go through it (a checkpoint is this state, serialised). This module adds
how the state is held and moved: restored lazily from a checkpoint's front section (only part of the history in
memory, :class:`~context_persistent.model.history_lists.LazyList`), captured for a checkpoint and restored from
one.

Every message has a key (keys.py): ``seq << 20 | index``. The lists the history is held in are in
history_lists.py; their names stay importable from here.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from typing import Any, Self

from .fold import Fold, expired_range
from .history_lists import (SYSTEM_ROLES, BaseLoader, Counts, LazyList, LoadRefused, PagedList, Pager, Refs,
                            _Bulk, _list_of, json_default, raw_items, same_items)
from .keys import INDEX_BITS, MAX_BATCH, make_key, new_keys, split_key


class Projection(Fold):
    """Full history plus pins, as of ``head_seq``. Mutated only by :meth:`apply`.

    A projection restored from a checkpoint's front section (:meth:`lazy`) holds only part of the history
    in memory (``messages``, ``keys`` and ``tokens`` are :class:`LazyList`); it loads the rest on first need,
    or when :meth:`materialise` is called, and is from then on an ordinary projection.
    """

    __slots__ = ()

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

    def materialise(self) -> Self:
        """Load what a lazy projection does not hold yet (no-op otherwise); returns self."""
        messages = self.messages
        if type(messages) is LazyList:
            messages._all()
        return self

    @classmethod
    def lazy(cls, meta: dict[str, Any], n: int, known: dict[int, tuple[Any, int, int | None]],
             system_indices: list[int], loader: BaseLoader, pager: Pager | None = None) -> Self:
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
    def from_state(cls, state: dict[str, Any], pager: Pager | None = None) -> Self:
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


__all__ = ["INDEX_BITS", "MAX_BATCH", "SYSTEM_ROLES", "BaseLoader", "Counts", "LazyList", "LoadRefused", "PagedList",
           "Pager", "Projection", "Refs", "expired_range", "json_default", "make_key", "new_keys", "raw_items",
           "same_items", "split_key"]
