"""Time travel on a long session without replaying its log: the session as it was at a seq, cut from the
state the viewer already holds, when nothing after that seq changed the history but appends.

``store.at(seq)`` (transfer/time_travel.py) folds the log from its start up to ``seq``: 20 s at the middle of a
million messages, 40 s near its end. Most of a long session's records are ``message_added``, and the others
after a given seq are often only audit records (``compacted``, ``usage_reported``, ...) that leave every view
as it is. Then the state at ``seq`` is the state at the head with the messages added after ``seq`` taken off
the end: the history's first ``n`` refs, keys and token counts (packed lists: a copy of 24 bytes a message)
and the event counts less the records after ``seq``. The index of notable events (timeline.py) says which
records came after ``seq`` (a session whose event counts hold nothing but appends needs no index: building
it reads the whole log once); anything else there (a replacement, a pin, a system prompt change, a replay,
an erasure, retention), a redaction anywhere in the session (time travel also hides copies of a redacted
message) or an index that does not reach that far back makes the viewer replay the log as ``at`` does.

A cut state for the request view is lazy, as a store opened from a checkpoint is (docs/architecture.md,
"Lazy open"): it holds the newest messages' refs and lists its system messages, so the request view is
built from its newest part instead of scanning the history. The system messages come from the head's
request store when it still lists them (a lazily opened store whose rest was never loaded).
"""

from __future__ import annotations

from typing import Any

from ..model import events as ev
from ..model.projection import Counts, PagedList, Projection, Refs, make_key

#: Record types whose fold changes nothing of the history, its pins or its session (fold.py ``_apply``).
NO_OP_TYPES = frozenset(ev.EVENT_TYPES) - {
    ev.MESSAGE_ADDED, ev.MESSAGES_REPLACED, ev.CLEARED, ev.PINNED, ev.UNPINNED, ev.REDACTED,
    ev.REPLAY_RECOGNISED, ev.SYSTEM_PROMPT_SET, ev.ERASED, ev.EXPIRED, ev.SESSION_STARTED}
#: The newest and the first messages a lazy cut state holds refs to: what the request view's walk back and its
#: look at the session's start read (more loads the rest: slower, never wrong).
LAZY_RECENT, LAZY_HEAD = 8192, 256


def appends_only(state: Any) -> bool:
    """Whether every record of the session but its first (``session_started``) added a message, with no seq
    gap and nothing erased: then any past state is a cut of this one, and no index is needed to know it."""
    return set(state.counts) <= {ev.SESSION_STARTED, ev.MESSAGE_ADDED} and not state.removed


def records_after(state: Any, at_seq: int, marks: Any) -> dict[str, int] | None:
    """The records other than ``message_added`` after ``at_seq`` up to the state's head, by type, when they
    are all audit records and the index (``marks``; None: no index, enough for a session of appends only)
    knows every one of them; else None (the log must be replayed)."""
    head = state.head_seq
    if marks is None:
        return {} if appends_only(state) else None
    if state.counts.get(ev.REDACTED) or marks.last_seq < head:
        return None
    events = marks.events
    if marks.omitted and (not events or events[0]["seq"] > at_seq + 1):
        return None  # (the index kept only the newest notable events: it cannot vouch for older ones)
    found: dict[str, int] = {}
    for e in reversed(events):
        seq = e["seq"]
        if seq <= at_seq:
            break
        if seq > head:
            continue
        if e["type"] not in NO_OP_TYPES:
            return None
        found[e["type"]] = found.get(e["type"], 0) + 1
    usage = marks.usage.records_between(at_seq, head)
    if usage:
        found[ev.USAGE_REPORTED] = usage
    return found


def _lists(state: Any, n: int) -> tuple[Any, Any, Any]:
    """The first ``n`` items of the state's messages (as held: refs), keys and token counts, copied packed."""
    state.materialise()
    messages, keys, tokens = state.messages, state.keys, state.tokens
    if type(messages) is PagedList:
        refs = Refs()
        refs.a, refs.extras = messages.items.a[:n], list(messages.items.extras)
        items: Any = refs
    else:
        items = list(messages[:n])
    counts = Counts()
    if type(tokens) is Counts:
        counts.a = tokens.a[:n]
    else:
        counts.extend(tokens[:n])
    return items, keys[:n], counts


def cut(state: Any, at_seq: int, marks: Any, pager: Any, system_indices: list[int] | None = None) -> Projection | None:
    """The projection of the session right after ``at_seq``, cut from ``state`` (a later one); None when it
    cannot be (see the module's docstring). With ``system_indices`` (every system message of ``state``'s
    history, by index) the result is lazy, holding the first :data:`LAZY_HEAD` and the newest :data:`LAZY_RECENT`
    messages."""
    if not 1 <= at_seq < state.head_seq:
        return None
    after = records_after(state, at_seq, marks)
    if after is None:
        return None
    keys, limit = state.keys, make_key(at_seq + 1)
    n = len(keys)
    while n and keys[n - 1] >= limit:  # (the messages appended after at_seq: the end of the history)
        n -= 1
    dropped = len(keys) - n
    if n == 0:
        return None  # (no history yet at at_seq: whether there was one is the replay's to say)
    counts = dict(state.counts)
    after[ev.MESSAGE_ADDED] = dropped
    for kind, k in after.items():
        left = counts.get(kind, 0) - k
        if left < 0:
            return None  # (the index and the state disagree: replay instead of guessing)
        if left:
            counts[kind] = left
        else:
            counts.pop(kind, None)
    facts = {"pinned": sorted(state.pinned), "head_seq": at_seq, "has_history": True,
             "session": state.session, "counts": counts}
    items, keys, tokens = _lists(state, n)
    if system_indices is not None:
        wanted = [*(i for i in system_indices if i < n), *range(min(n, LAZY_HEAD)), *range(max(0, n - LAZY_RECENT), n)]
        known = {i: (items[i], keys[i], tokens[i]) for i in wanted}
        paged = pager is not None and type(items) is Refs

        def load() -> Any:
            return (PagedList(items, pager) if paged else list(items)), keys, tokens

        past = Projection.lazy(facts, n, known, [i for i in system_indices if i < n], load,
                               pager if paged else None)
    else:
        past = Projection.from_state({**facts, "messages": items, "keys": keys, "tokens": tokens},
                                     pager if type(items) is Refs else None)
    past.removed = [r for r in state.removed if r[0] < make_key(at_seq + 1)]
    past.version = max(0, state.version - dropped)
    return past


async def open_cut(head: Any, at_seq: int, marks: Any, system_indices: list[int] | None = None) -> Any | None:
    """A read-only store of the session as it was right after ``at_seq``, cut from ``head`` (a store at the
    head, whose history may load in full for it); None when the log must be replayed instead."""
    from ..storage.backends import open_log

    if not 1 <= at_seq < head.head_seq or records_after(head._state, at_seq, marks) is None:
        return None
    log = await open_log(head.storage_path, head.session_id, head.config, readonly=True)
    past = None
    try:
        past = type(head)(storage_path=head.storage_path, session_id=head.session_id, log=log, config=head.config)
        state = cut(head._state, at_seq, marks, past._s.pager, system_indices)
        if state is not None:
            past._state = state
            past._loaded_from_file = True
            return past
    except BaseException:
        _discard(past, log)
        await log.close()
        raise
    _discard(past, log)
    await log.close()
    return None


def _discard(past: Any, log: Any) -> None:
    if past is not None and past._s.pager is not None:
        past._s.pager.close()


def listed_system_indices(store: Any) -> list[int] | None:
    """The indices of every system message of a lazily opened store's history, if it still lists them."""
    messages = store._state.messages
    listed = getattr(messages, "system_indices", None)
    return list(listed) if listed is not None and not getattr(messages, "loaded", True) else None


__all__ = ["NO_OP_TYPES", "appends_only", "cut", "listed_system_indices", "open_cut", "records_after"]
