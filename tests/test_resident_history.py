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
