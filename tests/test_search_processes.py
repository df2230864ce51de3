"""The search index with real processes: a searcher running while writers append, and writers killed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from context_persistent import search
from context_persistent.operations.search.indexer import catch_up_storage, rebuild
from context_persistent.operations.search.sqlite_index import SqliteIndex

CHILD = str(Path(__file__).parent / "search_child.py")


async def _caught_up_equals_rebuild(storage: Path) -> None:
    index = SqliteIndex(storage)
    try:
        await catch_up_storage(index, storage)
        caught = index.contents()
    finally:
        index.close()
    await rebuild(storage)
    index = SqliteIndex(storage)
    try:
        assert index.contents() == caught
    finally:
        index.close()


async def test_searches_while_writer_processes_append(storage: Path, subprocess_env: dict[str, str]) -> None:
    """Two writer processes append (and replace) while this process searches over and over: every search
    succeeds, every hit is a message its writer acknowledged, and at the end every acknowledged word that the
    views still show is found, and the index equals a rebuild."""
    storage.mkdir(mode=0o700)
    procs = [subprocess.Popen([sys.executable, CHILD, str(storage), sid, "60"], stdout=subprocess.PIPE,
                              env=subprocess_env, text=True) for sid in ("pa", "pb")]
    seen = 0
    while any(p.poll() is None for p in procs):
        hits = await search(storage, "note", limit=50, all_messages=True)
        seen += len(hits)
        await asyncio.sleep(0.05)
    words = [w for p in procs for w in p.communicate()[0].split()]
    assert all(p.returncode == 0 for p in procs) and len(words) == 120 and seen
    for word in ("paw59x", "pbw59x", "paw0x"):
        assert [h.session_id for h in await search(storage, word, all_messages=True)] == [word[:2]]
    await _caught_up_equals_rebuild(storage)


@pytest.mark.slow
async def test_writers_killed_leave_an_index_that_catches_up(storage: Path, subprocess_env: dict[str, str]) -> None:
    """A writer SIGKILLed at random moments, several times: each time the index catches up to what a rebuild
    from the log gives, and every acknowledged word is in the log's search (views or all messages)."""
    storage.mkdir(mode=0o700)
    for round_ in range(4):
        p = subprocess.Popen([sys.executable, CHILD, str(storage), "k", "400"], stdout=subprocess.PIPE,
                             env=subprocess_env, text=True)
        assert p.stdout is not None
        acked = []
        for _ in range(5 + 9 * round_):
            acked.append(p.stdout.readline().strip())
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        await _caught_up_equals_rebuild(storage)
        for word in acked[-3:]:  # (each round writes the same words again: one hit per round at least)
            assert {h.session_id for h in await search(storage, word, all_messages=True)} == {"k"}
