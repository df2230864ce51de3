"""Token counts of the history: counted once per message and cached in the projection, only the new ones
counted after appends, large texts counted in a worker thread so the event loop stays responsive."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

from ..model.history_lists import LazyList, PagedList, _resolve
from .session import Session
from ..model.tokens import PIECE, message_text

#: Messages with at least this many characters of text are tokenised in a worker thread (see
#: ``TokenLedger.count_large_off_loop``): about 10-50 ms of tiktoken at this size, and seconds for megabytes.
LARGE_TEXT = PIECE
#: Uncounted messages read from the log per run when a whole history is counted (``TokenLedger.counts``).
COUNT_RUN = 1024


def _count_all(count: Callable[[Any], int], messages: list[Any]) -> list[int]:
    return [count(m) for m in messages]


class TokenLedger:
    """Per-message token counts of one session under its active counter."""

    def __init__(self, session: Session) -> None:
        self._s = session
        #: (epoch, n, token list): the first n counts of that list were complete at that epoch.
        self._hint: tuple[int, int, Any] = (-1, 0, None)
        #: (token list, n): messages below n of that list were looked at by count_large_off_loop.
        self._large_seen: tuple[Any, int] = (None, 0)
        self._large_busy: asyncio.Future[None] | None = None

    def forget(self) -> None:
        """The history was rebuilt from the log (an erase): search the counts from the start next time."""
        self._hint = (-1, 0, None)
        self._s.token_total_hint = None

    def _estimator_replaced_encoding(self) -> bool:
        """The requested encoding did not load (estimator instead): counts restored from a checkpoint were
        made with the real encoding and must be made again with the active counter."""
        counter = self._s.counter
        return self._hint[2] is None and counter.current != counter.requested

    def _load_counter(self) -> None:
        """Load the encoding before counting, so that a failed load (the estimator instead) is seen by
        ``_estimator_replaced_encoding`` before any count is mixed with the restored ones."""
        self._s.counter.name  # noqa: B018

    def counts(self) -> list[int]:
        """Per-message counts, tokenising only messages not counted before (cached in the projection).

        Between epochs (only appends) uncounted messages can only be at the end, so the search for them
        starts where the last one stopped: a request after one new message does not scan the history.
        """
        s = self._s
        state = s.full()
        tokens = state.tokens
        if state.counted_version != state.version or self._hint[2] is None:
            self._load_counter()
            if self._estimator_replaced_encoding():
                tokens[:] = [None] * len(tokens)
                s.token_total_hint = None
                state = s.full()  # (a lazy list that loaded for the assignment is a plain list now)
                tokens = state.tokens
            hint = self._hint
            start = hint[1] if hint[0] == s.epoch and hint[2] is tokens and hint[1] <= len(tokens) else 0
            try:
                first = tokens.index(None, start)
            except ValueError:
                first = -1
            if first >= 0:
                count = s.counter.count_message
                for idx, messages in self._uncounted_runs(state, first):
                    for i, m in zip(idx, messages):
                        tokens[i] = count(m)
            self._hint = (s.epoch, len(tokens), tokens)
            state.counted_version = state.version
            s.token_total_hint = (s.epoch, len(tokens), tokens, sum(tokens))  # type: ignore[arg-type]
        return tokens  # type: ignore[return-value]

    def summed(self) -> tuple[int, int] | None:
        """``(n, total)``: the first ``n`` messages' counts sum to ``total``, known without reading the history
        (``Session.token_total_hint``, advanced over the counts made since; nothing is counted here). None
        when the history changed other than by appends since the sum was made."""
        s = self._s
        hint = s.token_total_hint
        if hint is None:
            return None
        epoch, n, tokens, total = hint
        cur = s.state.tokens
        if tokens is not cur or epoch != s.epoch or n > len(cur):
            return None
        end = len(cur)
        while n < end:
            t = cur[n]
            if t is None:
                break
            total += t
            n += 1
        s.token_total_hint = (epoch, n, tokens, total)
        return n, total

    def prefix_total(self, n: int) -> int | None:
        """The tokens of the first ``n`` messages if their counts are all made (:meth:`summed`): nothing is counted
        and the encoding is not loaded. None otherwise."""
        summed = self.summed()
        if summed is None or summed[0] < n:
            return None
        m, total = summed
        tokens = self._s.state.tokens
        for i in range(n, m):  # (the newest few: known, in memory even for a lazily opened history)
            total -= tokens[i]  # type: ignore[operator]
        return total

    def known_total(self) -> int | None:
        """The whole history's token count if the counts of all but the newest messages are summed already
        (:meth:`summed`): the newest are counted now (those appended since). None otherwise."""
        summed = self.summed()
        if summed is None:
            return None
        n, total = summed
        tokens = self._s.state.tokens
        for i in range(n, len(tokens)):
            t = tokens[i]
            total += t if t is not None else self.count_one(i)
        return total

    def total(self) -> int:
        """The whole history's token count (counting what is not counted yet)."""
        known = self.known_total()
        return known if known is not None else sum(self.counts())

    @staticmethod
    def _uncounted_runs(state: Any, first: int) -> Iterator[tuple[list[int], list[Any]]]:
        """The uncounted messages from index ``first`` on, ``COUNT_RUN`` at a time: ``(indices, messages)``.

        A paged history's messages are read from the log together, a run per read (``MessageReader.fetch_many``)
        and not kept in its cache: counting a whole history holds one run in memory, not the history, and
        does not evict what the request view reads."""
        tokens, msgs = state.tokens, state.messages
        paged = type(msgs) is PagedList
        n = len(tokens)
        i = first
        while i < n:
            idx: list[int] = []
            while i < n and len(idx) < COUNT_RUN:
                if tokens[i] is None:
                    idx.append(i)
                i += 1
            if idx:
                yield idx, (_resolve([msgs.items[j] for j in idx], msgs.pager) if paged else [msgs[j] for j in idx])

    def count_indices(self, indices: Any) -> list[int | None]:
        """Count only the messages at ``indices`` (cached in the projection); the others stay as they are.

        For rebuilds that must not tokenise the whole history (windowed rebuilds, view extensions).
        """
        s = self._s
        state = s.state
        tokens = state.tokens
        if not self._estimator_replaced_encoding() and all(tokens[i] is not None for i in indices):
            return tokens  # (nothing to count: the encoding need not load)
        self._load_counter()
        if self._estimator_replaced_encoding():
            tokens[:] = [None] * len(tokens)
            s.token_total_hint = None
            tokens = state.tokens
            self._hint = (s.epoch, 0, tokens)
        count = s.counter.count_message
        msgs = state.messages
        for i in indices:
            if tokens[i] is None:
                tokens[i] = count(msgs[i])
        return tokens

    def count_one(self, i: int) -> int:
        return self.count_indices((i,))[i]  # type: ignore[return-value]

    def _large_uncounted(self, first: int) -> Iterator[list[tuple[int, Any, Any]]]:
        """The uncounted messages from index ``first`` on whose text is ``LARGE_TEXT`` characters or more, as
        ``(index, item, message)`` (``item``: what the history holds there, the message or its ref), a run of
        the history at a time: a paged history's messages are read in runs and not kept (a lazy history's
        unloaded part is never read)."""
        state = self._s.state
        tokens = state.tokens
        messages = state.messages
        if not (type(tokens) is LazyList and not tokens.loaded):
            items = messages.items if type(messages) is PagedList else messages
            for idx, run in self._uncounted_runs(state, first):
                yield [(i, items[i], m) for i, m in zip(idx, run) if len(message_text(m)) >= LARGE_TEXT]
            return
        large = []
        for i in tokens.known_indices():  # type: ignore[attr-defined]
            if i < first or tokens.get_known(i, 0) is not None:  # type: ignore[attr-defined]
                continue
            message = messages.get_known(i)  # type: ignore[attr-defined]
            if message is not None and len(message_text(message)) >= LARGE_TEXT:
                large.append((i, message, message))
        yield large

    async def count_missing_off_loop(self) -> None:
        """Count every message not counted yet (a history replayed or opened without counts), a run of
        ``COUNT_RUN`` messages at a time, each run tokenised in a worker thread: the event loop runs between
        and during runs, and memory holds one run. Nothing to do when the total is known (:meth:`summed`): the
        checkpoint the store opened from recorded it, or the history was counted since. The counts are kept
        in the history; the next checkpoint records them and their total, so this is paid once."""
        s = self._s
        if self.summed() is not None or self._estimator_replaced_encoding():
            return  # (the total is known; or counts() is about to count everything again with the estimator)
        state = s.full()
        tokens, messages = state.tokens, state.messages
        if None not in tokens:
            return
        counter = s.counter
        counter.name  # noqa: B018 (load the encoding on the loop: a first load in a thread races its counts)
        count = counter.count_message
        paged = type(messages) is PagedList
        for idx, run in self._uncounted_runs(state, 0):
            items = [messages.items[i] if paged else messages[i] for i in idx]  # type: ignore[attr-defined]
            counted = await asyncio.to_thread(_count_all, count, run)
            if s.state is not state or state.tokens is not tokens or state.messages is not messages:
                return  # (the history was rebuilt meanwhile: what is left is counted when asked)
            now = messages.items if paged else messages  # type: ignore[attr-defined]
            for i, item, n in zip(idx, items, counted):  # (a ref names one record: equal means the same message)
                if i < len(now) and _same(now[i], item) and tokens[i] is None:
                    tokens[i] = n

    async def count_large_off_loop(self) -> None:
        """Count the uncounted messages whose text is long (``LARGE_TEXT`` characters or more) in a worker
        thread, before a request view or a token count needs them: tokenising megabytes takes seconds, and
        tiktoken releases the GIL, so the event loop stays responsive meanwhile. Each message is looked at
        once, when it is new (``_large_seen``). A second caller waits for a count in progress (else it would
        count the same message on the loop)."""
        while self._large_busy is not None:
            await asyncio.shield(self._large_busy)
        s = self._s
        state = s.state
        tokens = state.tokens
        seen, seen_n = self._large_seen
        n = len(tokens)
        first = seen_n if seen is tokens and seen_n <= n else 0
        if first >= n:
            return
        self._large_seen = (tokens, n)
        if self._estimator_replaced_encoding():
            return  # (counts() is about to count everything again with the estimator)
        counter = s.counter
        busy = self._large_busy = asyncio.get_running_loop().create_future()
        try:
            for large in self._large_uncounted(first):
                if large:
                    counter.name  # noqa: B018 (load the encoding on the loop: a first load in a thread races its counts)
                for i, item, message in large:
                    counted = await asyncio.to_thread(counter.count_message, message)
                    messages = state.messages
                    now = messages.items if type(messages) is PagedList else messages
                    if s.state is state and i < len(now) and _same(now[i], item):
                        state.tokens[i] = counted  # (unless the history changed meanwhile)
        finally:
            self._large_busy = None
            busy.set_result(None)


def _same(now: Any, item: Any) -> bool:
    """Whether a history item is still the one read before: the same message object, or the same ref (a ref
    names one record; refs read out of a packed list are new int objects each time)."""
    return now is item or (type(item) is int and now == item)
