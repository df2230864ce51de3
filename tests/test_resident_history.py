"""The history stays in memory while it fits the page cache's budget, and is paged beyond it (pages.keep_read)."""

from __future__ import annotations

from pathlib import Path

from context_persistent.model import codec
from context_persistent.storage.pages import MESSAGE_OVERHEAD, MessageReader, make_ref
from context_persistent.storage.paths import LOG_NAME


def _log(folder: Path, n: int) -> list[int]:
    """A log of ``n`` one-message records; the refs of its messages."""
    folder.mkdir()
    lines = codec.encode_chain([(i + 1, "message_added", {"message": {"role": "user", "content": f"m{i} " * 20}},
                                 None) for i in range(n)], codec.root_crc("s"))
    (folder / LOG_NAME).write_bytes(b"".join(lines))
    refs, at = [], 0
    for line in lines:
        refs.append(make_ref(at))
        at += len(line)
    return refs


def test_a_pass_over_a_history_that_fits_is_kept_and_the_next_reads_nothing(tmp_path: Path) -> None:
    """A second pass over a history that fits the budget is served from memory, without a read."""
    refs = _log(tmp_path / "s", 50)
    reader = MessageReader(tmp_path / "s", cache_bytes=1 << 20)
    first = reader.fetch_many(refs)
    reads = reader.reads
    assert reads == 50 and reader.fetch_many(refs) == first and reader.reads == reads
    assert [m["content"] for m in first] == [f"m{i} " * 20 for i in range(50)]


def test_a_history_beyond_the_budget_is_paged_and_never_evicts_what_is_held(tmp_path: Path) -> None:
    """Past the budget a pass keeps nothing more, and what the cache held before it stays held."""
    refs = _log(tmp_path / "s", 50)
    line = (tmp_path / "s" / LOG_NAME).read_bytes().split(b"\n")[0]
    budget = 10 * (len(line) + 1 + MESSAGE_OVERHEAD) + 100
    reader = MessageReader(tmp_path / "s", cache_bytes=budget)
    newest = reader.fetch(refs[-1])  # (what a request view reads, held first)
    reader.fetch_many(refs)
    assert reader.held_bytes <= budget
    reads = reader.reads
    assert reader.fetch(refs[-1]) is newest and reader.reads == reads  # (not evicted by the pass)
    reader.fetch_many(refs)
    assert reader.reads > reads  # (the rest is read again: paged)


def _seeded(tmp_path: Path, n: int, budget: int) -> tuple[MessageReader, list[int], list[dict]]:
    """A reader whose empty cache was seeded with the ``n`` messages of its log (a checkpoint's message section
    at open), parsed apart from it, each counted as 100 bytes."""
    refs = _log(tmp_path / "s", n)
    messages = [{"role": "user", "content": f"m{i} " * 20} for i in range(n)]
    reader = MessageReader(tmp_path / "s", cache_bytes=budget)
    assert reader.seed(refs, messages, 100) == n
    return reader, refs, messages


def test_a_seeded_history_is_served_from_memory_alone_as_the_cache_serves_it(tmp_path: Path) -> None:
    """The seed of an empty cache (one dict, not an LRU entry per message) serves passes, single reads and the
    checkpoint's dump without a read of the log, and together with what the cache holds besides."""
    reader, refs, messages = _seeded(tmp_path, 40, 1 << 20)
    assert reader.held_bytes == 40 * (100 + MESSAGE_OVERHEAD) and reader.held_messages == 40
    got = reader.fetch_many(refs)
    assert got == messages and all(a is b for a, b in zip(got, messages)) and reader.reads == 0
    assert reader.fetch(refs[3]) is messages[3] and reader.reads == 0
    assert reader.held_messages == 40 and reader.held_bytes == 40 * (100 + MESSAGE_OVERHEAD)
    appended = {"role": "assistant", "content": "new"}
    reader.put(make_ref(10 ** 6), appended, 50)  # (a message appended after the checkpoint)
    mixed = refs + [make_ref(10 ** 6)]
    assert reader.cached(mixed) == messages + [appended] and reader.fetch_many(mixed) == messages + [appended]
    shuffled = [make_ref(10 ** 6), *refs[::-1]]  # (any other order: served one at a time, the same)
    assert reader.cached(shuffled) == [appended, *messages[::-1]] and reader.reads == 0
    assert reader.cached([*refs, make_ref(10 ** 7)]) is None  # (one it does not hold: None, as before)
    reader.keep_read(refs[5], {"role": "user", "content": "other"}, 10)  # (held already: kept as it is)
    assert reader.fetch(refs[5]) is messages[5] and reader.held_messages == 41
    reader.clear()
    assert reader.held_bytes == 0 and reader.held_messages == 0 and reader.cached(refs[:1]) is None
    assert reader.fetch_many(refs) == messages and reader.reads == 40  # (read from the log again)


def test_seeded_messages_are_the_least_recently_used_and_evicted_first_in_their_order(tmp_path: Path) -> None:
    """Messages put beyond the budget evict the seeded ones first, oldest first in the section's order (a read
    of one leaves it there: they count as older than anything else), then the cache's own LRU order; the
    budget holds throughout."""
    cost = 100 + MESSAGE_OVERHEAD
    reader, refs, messages = _seeded(tmp_path, 20, 20 * cost)
    assert reader.fetch(refs[0]) is messages[0] and reader.reads == 0
    for k in range(3):
        reader.put(make_ref(10 ** 6 + k), {"role": "user", "content": f"new {k}"}, cost)
        assert reader.held_bytes <= 20 * cost
    held = reader.cached([make_ref(10 ** 6 + k) for k in range(3)])
    assert held is not None and [m["content"] for m in held] == ["new 0", "new 1", "new 2"]
    assert reader.cached(refs[0:3]) is None and reader.cached(refs[3:]) == messages[3:]  # (0, 1, 2 evicted)
    assert reader.held_messages == 20
    for k in range(3, 40):  # (every seeded message evicted, then the cache's own LRU order)
        reader.put(make_ref(10 ** 6 + k), {"role": "user", "content": f"new {k}"}, cost)
        assert reader.held_bytes <= 20 * cost
    assert reader.held_messages == 20 and reader.cached(refs[-1:]) is None
    assert reader.cached([make_ref(10 ** 6 + k) for k in range(20, 40)]) is not None
    reader.fetch(make_ref(10 ** 6 + 20))  # (now the most recently used: "new 21" goes first)
    reader.put(make_ref(10 ** 6 + 40), {"role": "user", "content": "new 40"}, cost)
    assert reader.cached([make_ref(10 ** 6 + 20)]) is not None and reader.cached([make_ref(10 ** 6 + 21)]) is None
    reader.put(refs[7], messages[7], cost)  # (put again after its eviction: an entry like any other)
    assert reader.fetch(refs[7]) is messages[7] and reader.held_bytes <= 20 * cost


def test_a_seed_fills_the_budget_only_and_a_second_seed_adds_to_what_is_held(tmp_path: Path) -> None:
    """A seed beyond the room left keeps only what fits (the rest is read from the log when used); a seed of a
    cache that holds messages already keeps those and adds the others."""
    cost = 100 + MESSAGE_OVERHEAD
    refs = _log(tmp_path / "s", 30)
    messages = [{"role": "user", "content": f"m{i} " * 20} for i in range(30)]
    reader = MessageReader(tmp_path / "s", cache_bytes=10 * cost + 5)
    assert reader.seed(refs, messages, 100) == 10 and reader.held_bytes == 10 * cost
    assert reader.fetch_many(refs) == messages and reader.reads == 20 and reader.held_bytes <= 10 * cost + 5
    reader = MessageReader(tmp_path / "s", cache_bytes=1 << 20)
    assert reader.seed(refs[:10], messages[:10], 100) == 10
    assert reader.seed(refs, messages, 100) == 20 and reader.held_messages == 30
    assert reader.fetch_many(refs) == messages and reader.reads == 0
