"""The fold (pure): how each record of the log changes the state a session's events fold into.

``Fold.apply(record)`` is the one fold function: replay on open, the incremental update after each append,
and checkpoint restore all go through it. :class:`~context_persistent.model.projection.Projection` is this state
plus how it is held in memory and restored from, or captured for, a checkpoint (projection.py).
"""

from __future__ import annotations

from typing import Any, Self

from . import events as ev
from .codec import FORMAT_VERSION
from .history_lists import Counts, LazyList, PagedList, Pager, Refs, _list_of, raw_items
from .keys import INDEX_BITS, MAX_BATCH, make_key, new_keys, split_key
from ..errors import InvalidRecordError


def expired_range(data: dict[str, Any], seq: int | None) -> tuple[int, int]:
    """``(first_seq, last_seq)`` of an ``expired`` record's data, checked (before the record's own ``seq``)."""
    lo, hi = data["first_seq"], data["last_seq"]
    if type(lo) is not int or type(hi) is not int or not 1 <= lo <= hi or (seq is not None and hi >= seq):
        raise ValueError(f"data.first_seq..last_seq is {lo!r}..{hi!r}: it must be a range of earlier seqs")
    return lo, hi


class Fold:
    """Full history plus pins, as of ``head_seq``, and the fold that changes them: mutated only by
    :meth:`apply`. (The base of :class:`~context_persistent.model.projection.Projection`.)"""

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
    def seeded(cls, data: dict[str, Any], pager: Pager | None = None, position: int | None = None) -> Self:
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
