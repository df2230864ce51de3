"""A checkpoint's message section put to use (pure but for the pager it fills): the history's messages, aligned
with the state section's refs, parsed in one call and kept in the pager's cache, so that the first pass over a
history that fits the cache's budget (``get_messages()``) reads nothing from the log (docs/format.md,
"Checkpoints"; docs/architecture.md, "Bounded memory")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...model.projection import PagedList, Refs
from ..pages import MESSAGE_OVERHEAD
from .payload import _TRAILER, Checkpoint, CheckpointError, dump_messages, parse_messages

logger = logging.getLogger("context_persistent.storage.checkpoint")


def keeps_sections(pager: Any) -> bool:
    """Whether ``pager`` can write and keep a message section (a file log's: refs are positions)."""
    return hasattr(pager, "seed") and not getattr(pager, "refs_are_keys", False)


async def dump_section(pager: Any, items: Any) -> list[bytes] | None:
    """The message section of a captured history (``items``: its refs) from ``pager``'s cache, or None: no
    pager that keeps one, an empty history, or a history not all in the cache (payload.dump_messages)."""
    if not len(items) or not keeps_sections(pager):
        return None
    return await dump_messages(items, pager.cached, _budget(pager, len(items)))


def _budget(pager: Any, n: int) -> int:
    """The most bytes a message section of ``n`` messages may have: what ``pager``'s cache counts for them
    (their JSON bytes plus ``MESSAGE_OVERHEAD`` each) fits its budget, so that loading one never holds more
    than a pass over the history keeps (docs/architecture.md, "Bounded memory")."""
    return int(pager.cache_bytes) - MESSAGE_OVERHEAD * n


def wants_section(pager: Any, cp: Checkpoint, n: int, session_id: str) -> bool:
    """Whether to read ``cp``'s message section (for a state of ``n`` messages): it has one, ``pager`` can keep
    it, and it fits the pager's budget (a budget lowered since it was written: the messages are read from the
    log, as without one)."""
    if not cp.messages_bytes or not keeps_sections(pager):
        return False
    if cp.messages_bytes > _budget(pager, n):
        logger.debug("session %s: the checkpoint's message section (%d bytes) does not fit the page cache's budget "
                     "(%d bytes); reading the messages from the log", session_id, cp.messages_bytes, pager.cache_bytes)
        return False
    return True


def load_section(read: Callable[[int, int], bytes], start: int, cp: Checkpoint, n: int, keep: bool = False
                 ) -> tuple[list[Any] | None, str | None, bytes | None]:
    """``cp``'s message section at ``start`` (``read(offset, count)`` reads it) parsed for a state of ``n``
    messages: ``(its items, None, None)``, or ``(None, why, None)`` if it is damaged or malformed
    (payload.parse_messages). ``keep`` (for :func:`defer_section`): its bytes (with its trailer) are read in
    one call and returned third, for a second parse."""
    try:
        if not keep:
            return parse_messages(read, start, cp.messages_bytes, n), None, None
        data = read(start, cp.messages_bytes + 1 + _TRAILER)
        return parse_messages(_reader(data, start), start, cp.messages_bytes, n), None, data
    except (CheckpointError, OSError) as e:
        return None, str(e), None


def _reader(data: bytes, start: int) -> Callable[[int, int], bytes]:
    return lambda offset, count: data[offset - start:offset - start + count]


class HandOff:
    """What the checkpointer and the first ``get_messages()`` of a lazy open share (store/session.py)."""

    #: Set while that call loads the history: the message section's messages are handed to it (``handed``:
    #: the section's refs and its messages) and seeded in the pager's cache later (:func:`defer_section`).
    hand_off = False
    handed: tuple[list[int], list[Any]] | None = None


def use_section(pager: Any, refs: list[int], loaded: tuple[list[Any] | None, str | None, Any], cp: Checkpoint,
                session_id: str) -> tuple[int, str | None]:
    """Keep a message section's items (``loaded``: :func:`load_section`'s) in ``pager``'s cache: ``(messages
    kept, None)``, or ``(0, why)`` when it failed verification or does not match its state section, which is
    logged as a warning (the messages are then read from the log; the checkpointer shows why in ``stats()`` and
    writes a new checkpoint at close)."""
    messages, error, _ = loaded
    if messages is not None:
        try:
            return seed_messages(pager, refs, messages, cp.messages_bytes), None
        except CheckpointError as e:
            error = str(e)
    logger.warning("session %s: the checkpoint's message section cannot be used (%s); reading the messages from "
                   "the log instead (the next close writes a new checkpoint)", session_id, error)
    return 0, error


def section_refs(state: Any) -> list[int]:
    """The refs of a state as restored from its state section, in order (an item that is not a ref: -1), taken
    before anything is applied to it: the message section is aligned with them."""
    items = state.messages.items if type(state.messages) is PagedList else state.messages
    if type(items) is Refs:
        return items.a.tolist()  # (an item that is not a ref is held negative: never a ref)
    return [v if type(v) is int else -1 for v in items]


def seed_messages(pager: Any, refs: list[int], messages: list[Any], length: int) -> int:
    """Keep the items of a message section of ``length`` bytes (``messages``, parsed) in ``pager``'s cache for
    a state whose refs are ``refs`` (``PageCache.seed``); returns how many it kept. CheckpointError if they do
    not match the refs: nothing is kept then."""
    present = check_aligned(refs, messages)
    if not present:
        return 0
    return int(pager.seed(refs, messages, length // present))


def defer_section(checkpointer: Any, refs: list[int], loaded: tuple[list[Any] | None, str | None, bytes | None],
                  cp: Checkpoint) -> tuple[list[int], list[Any]] | None:
    """Put a message section's items (``loaded``: :func:`load_section`'s) in the pager's cache, as
    :func:`use_section` does, or, while ``checkpointer.hand_off``, hand them to the first ``get_messages()``
    (store/session.py: ``(refs, messages)``) instead: the caller owns them, so no copy is made; the cache is
    seeded from a second parse of the section's bytes, kept meanwhile (at most the cache's budget), when it is
    first used (``PageCache.defer_seed``; an erasure's ``clear`` drops them). None: nothing handed (a section
    that does not match its state or failed verification is reported as :func:`use_section` does)."""
    messages, error, data = loaded
    pager = checkpointer.pager
    if not checkpointer.hand_off:
        checkpointer._seed(refs, loaded, cp)
        return None
    if messages is not None and data is not None:
        try:
            checkpointer.section_messages = check_aligned(refs, messages)  # (handed out now, cached later)
        except CheckpointError as e:
            error = str(e)
        else:
            n = len(messages)

            def settle() -> None:  # (the bytes were verified: a failure here is reported as at the open)
                checkpointer._seed(refs, load_section(_reader(data, 0), 0, cp, n), cp)

            pager.defer_seed(settle)
            return refs, messages
    checkpointer._seed(refs, (None, error, None), cp)
    return None


def check_aligned(refs: list[int], messages: list[Any]) -> int:
    """How many items of a message section (``messages``) are messages; CheckpointError if they do not match the
    state's ``refs`` (a message where the state holds no ref, or none where it holds one)."""
    absent = messages.count(None)
    present = len(messages) - absent
    if absent != (sum(1 for r in refs if r < 0) if refs and min(refs) < 0 else 0):
        raise CheckpointError("the message section does not match the state section (a message where the state "
                              "holds no ref, or none where it holds one)")
    if absent and any((r < 0) != (m is None) for r, m in zip(refs, messages)):
        raise CheckpointError("the message section does not match the state section (a message where the state "
                              "holds no ref, or none where it holds one)")
    return present


__all__ = ["HandOff", "check_aligned", "defer_section", "dump_section", "keeps_sections", "load_section", "section_refs", "seed_messages", "use_section", "wants_section"]
