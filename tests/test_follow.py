"""Live tail: ``follow_file`` / ``store.follow`` report every appended record exactly once, in order, across
growth, partial writes, torn tails cut by a restarted writer, rewrites, a log that does not exist yet, and stop
cleanly on cancellation. The big test follows a second process writing 10,000 events through a SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import LogChangedError, LogCorruptedError, PersistentContextManager

from context_persistent.model import codec
from context_persistent.storage.follow import follow_file

WAIT = 20  # seconds: a hang guard only, never a speed assertion


def rec(seq: int, text: str | None = None) -> bytes:
    message = {"role": "user", "content": text or f"m{seq}"}
    return codec.encode(seq, "message_added", orjson.dumps({"message": message}))


class Follower:
    """Runs ``follow_file`` in a task, collecting records; ``until(n)`` waits for ``n`` of them."""

    def __init__(self, path: Path, after_seq: int = 0, **kw: Any) -> None:
        self.records: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(follow_file(path, after_seq, **kw)))

    async def _run(self, it: AsyncIterator[dict[str, Any]]) -> None:
        async with contextlib.aclosing(it) as records:
            async for r in records:
                self.records.append(r)
                self.changed.set()

    async def until(self, n: int) -> list[int]:
        async with asyncio.timeout(WAIT):
            while len(self.records) < n:
                self.changed.clear()
                if self.task.done():
                    self.task.result()
                    raise AssertionError(f"follower ended with {len(self.records)} records")
                waiter = asyncio.ensure_future(self.changed.wait())
                await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
        return [r["seq"] for r in self.records]

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_catch_up_then_live_records_once_each_after_the_given_seq(tmp_path: Path) -> None:
    """Records after after_seq already in the log come first, then appended ones; nothing twice."""
    log = tmp_path / "events.jsonl"
    append(log, b"".join(rec(i) for i in range(1, 6)))
    f = Follower(log, after_seq=2)
    assert await f.until(3) == [3, 4, 5]
    append(log, rec(6) + rec(7))
    assert await f.until(5) == [3, 4, 5, 6, 7]
    await f.stop()


async def test_a_partial_last_line_is_waited_for_not_reported(tmp_path: Path) -> None:
    """A record cut mid-write (no newline yet) is neither reported nor an error; it is reported once complete."""
    log = tmp_path / "events.jsonl"
    line = rec(2, "written in two parts")
    append(log, rec(1) + line[:30])
    f = Follower(log)
    assert await f.until(1) == [1]
    await asyncio.sleep(0.2)
    assert len(f.records) == 1 and not f.task.done()
    append(log, line[30:])
    assert await f.until(2) == [1, 2]
    assert f.records[1]["data"]["message"]["content"] == "written in two parts"
    await f.stop()


async def test_torn_tail_cut_by_a_restarted_writer_then_growth(tmp_path: Path) -> None:
    """A final line failing its checksum is waited on; after the cut (file shrinks) new records follow in order."""
    log = tmp_path / "events.jsonl"
    good = rec(1) + rec(2)
    torn = rec(3)[:-12] + b'"deadbeef"}\n'
    append(log, good + torn)
    f = Follower(log)
    assert await f.until(2) == [1, 2]
    await asyncio.sleep(0.2)
    assert not f.task.done()
    os.truncate(log, len(good))  # what a restarted writer does with a torn tail
    append(log, rec(3, "rewritten") + rec(4))
    assert await f.until(4) == [1, 2, 3, 4]
    assert f.records[2]["data"]["message"]["content"] == "rewritten"
    await f.stop()


async def test_a_bad_record_followed_by_more_data_is_corruption_naming_the_line(tmp_path: Path) -> None:
    """Corruption before the end raises LogCorruptedError with the line number; it is never skipped."""
    log = tmp_path / "events.jsonl"
    bad = rec(2).replace(b"m2", b"mX")
    append(log, rec(1) + bad + rec(3))
    with pytest.raises(LogCorruptedError, match="line 2"):
        async with asyncio.timeout(WAIT):
            async for _ in follow_file(log):
                pass


async def test_log_and_folder_not_existing_yet(tmp_path: Path) -> None:
    """Following a session whose folder does not exist waits, then reports its records once it appears."""
    log = tmp_path / "store" / "later" / "events.jsonl"
    f = Follower(log)
    await asyncio.sleep(0.3)
    log.parent.mkdir(parents=True)
    append(log, rec(1))
    assert await f.until(1) == [1]
    append(log, rec(2))
    assert await f.until(2) == [1, 2]
    await f.stop()


async def test_checkpoint_files_written_beside_the_log_change_nothing(tmp_path: Path) -> None:
    """Temp and checkpoint files written in the session folder neither duplicate nor hide records."""
    log = tmp_path / "events.jsonl"
    f = Follower(log)
    for i in range(1, 41):
        append(log, rec(i))
        tmp = tmp_path / "checkpoint.json.tmp"
        tmp.write_bytes(b"{}" * i)
        os.replace(tmp, tmp_path / "checkpoint.json")
    assert await f.until(40) == list(range(1, 41))
    await asyncio.sleep(0.2)
    assert len(f.records) == 40
    await f.stop()


async def test_a_log_replaced_with_the_same_records_continues_but_a_rewrite_is_an_error(tmp_path: Path) -> None:
    """A new file (inode) holding what was reported resyncs by seq; one that changed a reported record raises."""
    log = tmp_path / "events.jsonl"
    first = rec(1) + rec(2)
    append(log, first)
    f = Follower(log)
    assert await f.until(2) == [1, 2]
    (tmp_path / "new").write_bytes(first + rec(3))
    os.replace(tmp_path / "new", log)  # e.g. a repair that kept every record
    assert await f.until(3) == [1, 2, 3]
    (tmp_path / "new").write_bytes(rec(1) + rec(2) + rec(3, "changed") + rec(4))
    os.replace(tmp_path / "new", log)
    with pytest.raises(LogChangedError, match="seq 3 changed"):
        async with asyncio.timeout(WAIT):
            await f.task
    assert [r["seq"] for r in f.records] == [1, 2, 3]


async def test_cancel_and_stop_event_end_cleanly_without_leftover_threads(tmp_path: Path) -> None:
    """Cancelling a waiting follower, or setting its stop_event, ends it promptly and stops the watcher thread."""
    log = tmp_path / "events.jsonl"
    append(log, rec(1))
    baseline = threading.active_count()
    f = Follower(log)
    assert await f.until(1) == [1]
    await f.stop()
    stop = asyncio.Event()
    g = Follower(log, stop_event=stop)
    assert await g.until(1) == [1]
    append(log, rec(2))
    stop.set()
    async with asyncio.timeout(WAIT):
        await g.task  # ends normally, after a last read
    assert [r["seq"] for r in g.records] == [1, 2]
    for _ in range(100):  # the watcher threads wind down asynchronously (anyio's worker pool may idle)
        if threading.active_count() <= baseline + 1:
            break
        await asyncio.sleep(0.05)
    assert threading.active_count() <= baseline + 1


async def test_store_follow_defaults_to_after_its_own_head(storage: Path) -> None:
    """store.follow() yields only what is appended after the store's head; after_seq=0 yields everything."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "before"})
        records: list[int] = []
        everything: list[int] = []

        async def collect(it: Any, out: list[int], n: int) -> None:
            async with contextlib.aclosing(it) as recs:
                async for r in recs:
                    out.append(r["seq"])
                    if len(out) == n:
                        return

        tasks = [asyncio.ensure_future(collect(store.follow(), records, 1)),
                 asyncio.ensure_future(collect(store.follow(after_seq=0), everything, 3))]
        await asyncio.sleep(0.1)
        await store.add_message({"role": "user", "content": "after"})
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*tasks)
    assert records == [3] and everything == [1, 2, 3]


WRITER = r"""
import asyncio, os, signal, sys
from context_persistent import PersistentContextManager
async def main(storage, start, stop, tear):
    # fsync="never": each record is still one write() the follower can see, and a SIGKILL keeps what was
    # written (the page cache survives the process); only the disk's fsync latency is left out of this test.
    store = await PersistentContextManager.open(storage_path=storage, session_id="live", fsync="never")
    for i in range(start, stop):
        await store.add_message({"role": "user", "content": f"m{i}"})
    if tear:  # die mid-record: half a line on disk, no newline
        with open(store.path, "ab") as f:
            f.write(b'{"v":1,"seq":%d,"ts":"2026-01-01T00:00:00+00:00","type":"message_added","data":{"mes'
                    % (store.head_seq + 1))
        os.kill(os.getpid(), signal.SIGKILL)
    await store.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "tear"))
"""


async def _writer(env: dict[str, str], storage: Path, start: int, stop: int, tear: bool) -> int:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(storage), str(start), str(stop),
                                                "tear" if tear else "clean", env=env)
    return await proc.wait()


async def test_second_process_writing_10000_events_through_a_sigkill_is_followed_exactly_once(
        storage: Path, subprocess_env: dict[str, str]) -> None:
    """Another process writes 5,000 messages, dies mid-record (SIGKILL); a restarted writer cuts the torn tail and
    writes 5,000 more; the follower, started before the log existed, sees seqs 1..10001 once each, in order."""
    f = Follower(storage / "live" / "events.jsonl", after_seq=0)
    assert await _writer(subprocess_env, storage, 0, 5000, tear=True) == -9
    assert await _writer(subprocess_env, storage, 5000, 10000, tear=False) == 0
    seqs = await f.until(10001)
    await asyncio.sleep(0.2)
    await f.stop()
    assert seqs == list(range(1, 10002)) and len(f.records) == 10001
    assert f.records[0]["type"] == "session_started"
    assert [r["data"]["message"]["content"] for r in f.records[1:]] == [f"m{i}" for i in range(10000)]
    assert list((storage / "live").glob("events.jsonl.torn-*"))  # the restarted writer kept the torn bytes


async def test_follow_waits_on_a_multi_line_torn_tail(tmp_path) -> None:
    """Several garbage lines at the end (a torn tail by the log's rule) make the follower wait, not fail;
    a valid record after garbage is corruption."""
    import asyncio

    from context_persistent import LogCorruptedError, PersistentContextManager
    from context_persistent.storage.follow import follow_file

    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="t") as s:
        await s.add_message({"role": "user", "content": "a"})
    log = tmp_path / "t" / "events.jsonl"
    good = log.read_bytes()
    log.write_bytes(good + b"garbage one\n\x00\x00\x00garbage two\n")
    seen: list[int] = []

    async def collect() -> None:
        async for rec in follow_file(log, 0, poll_interval=0.05):
            seen.append(rec["seq"])

    task = asyncio.ensure_future(collect())
    await asyncio.sleep(0.5)
    assert not task.done() and seen == [1, 2]  # waiting at the torn tail
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    lines = good.splitlines(keepends=True)
    log.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(LogCorruptedError, match="line 2"):
        async for _ in follow_file(log, 0, poll_interval=0.05):
            pass
