"""The reserved tail: with reserve_tail=True (opt-in) and fsync="always" the writer keeps NUL bytes written
ahead of its data (log.RESERVE..RESERVE_MAX), so a durable append does not change the file's size. By default
(reserve_tail=False) the live file is plain JSONL at every instant, and a crashed reserving writer's log opens.
Every reader ends the log at its data (log.data_end); a crashed writer's NUL tail is free space, not a torn
tail; bytes inside it are; NULs in the middle of the log are still corruption; close leaves exactly the
records."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import LogCorruptedError, PersistentContextManager

from context_persistent.model import codec
from context_persistent.storage import log as log_mod
from context_persistent.cli.inspect import _last_ts
from context_persistent.storage.follow import _Cursor
from context_persistent.storage.log import RESERVE, RESERVE_MAX, FileEventLog, data_size, scan
from context_persistent.storage.paths import LOG_NAME
from context_persistent.operations.repair import TORN_PREFIX, verify

SESSION = "s"


def msg(i: int, size: int = 0) -> dict[str, Any]:
    return {"role": "user", "content": f"m{i}" + "q" * size}


def log_path(storage: Path) -> Path:
    return storage / SESSION / LOG_NAME


def file_messages(path: Path) -> list[dict[str, Any]]:
    """The messages the file holds, read record by record (raises if a record is corrupt)."""
    return [r["data"]["message"] for r, _ in scan(path) if r["type"] == "message_added"]


def torn_side_files(storage: Path) -> list[Path]:
    return sorted((storage / SESSION).glob(TORN_PREFIX + "*"))


def flog(store: PersistentContextManager) -> FileEventLog:
    """The store's file log (its writer state: ``size`` is the data end, ``torn`` a torn tail found on open)."""
    log = store._log
    assert isinstance(log, FileEventLog)
    return log


async def open_store(storage: Path, **kw: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=SESSION, **kw)


async def reopened_messages(storage: Path, **kw: Any) -> list[dict[str, Any]]:
    async with await open_store(storage, **kw) as store:
        return await store.get_messages()


# -- 1. an always-writer reserves ahead, close cuts the reserve --------------------------------------------
async def test_an_open_always_writer_keeps_a_nul_tail_that_close_removes(storage: Path) -> None:
    store = await open_store(storage, fsync="always", reserve_tail=True)
    for i in range(3):
        await store.add_message(msg(i))
    path = log_path(storage)
    raw = path.read_bytes()
    end = data_size(path)
    last_end = list(scan(path))[-1][1]
    assert end == last_end == flog(store).size  # the data ends right after the last record
    assert len(raw) > end and raw.endswith(b"\0")
    assert raw[end:] == bytes(len(raw) - end)  # all of the reserve is NULs
    assert raw[:end].endswith(b"\n") and b"\0" not in raw[:end]
    assert file_messages(path) == [msg(i) for i in range(3)]
    await store.close()
    closed = path.read_bytes()
    assert closed == raw[:end]  # exactly the records
    assert closed.endswith(b"\n") and b"\0" not in closed
    assert await reopened_messages(storage) == [msg(i) for i in range(3)]


async def test_the_reserve_grows_with_the_log(storage: Path) -> None:
    """Past RESERVE bytes of data the file is still reserved ahead; each extension reserves 1/16 of the log
    (at least RESERVE, at most RESERVE_MAX) after the record that triggered it."""
    store = await open_store(storage, fsync="always", reserve_tail=True)
    path = log_path(storage)
    prev = path.stat().st_size
    extensions: list[tuple[int, int]] = []  # (data size, reserve) right after each growth of the file
    i = 0
    while data_size(path) < 1_300_000:  # > 2 * RESERVE, and > 16 * RESERVE so that 1/16 exceeds RESERVE
        await store.add_message(msg(i, 8000 if i < 20 else 40_000))
        i += 1
        size, end = path.stat().st_size, data_size(path)
        assert end == flog(store).size
        assert size > end, f"after {i} appends ({end} bytes of data) the file is not reserved ahead"
        if size != prev:
            assert size > prev
            extensions.append((end, size - end))
        prev = size
    assert len(extensions) >= 3
    for end, reserve in extensions:
        assert reserve == min(max(RESERVE, end >> 4), RESERVE_MAX)
    assert any(end > 2 * RESERVE for end, _ in extensions)  # still reserving after crossing 64 KiB
    assert any(reserve > RESERVE for _, reserve in extensions)  # the 1/16 rule
    await store.close()
    closed = path.read_bytes()
    assert closed.endswith(b"\n") and b"\0" not in closed
    assert file_messages(path) == [msg(k, 8000 if k < 20 else 40_000) for k in range(i)]


# -- 2. batch and never reserve nothing; batch after a crashed always-writer writes at the data end ------
@pytest.mark.parametrize("fsync", ["batch", "never"])
async def test_batch_and_never_writers_reserve_nothing(storage: Path, fsync: str) -> None:
    store = await open_store(storage, fsync=fsync)
    path = log_path(storage)
    for i in range(3):
        await store.add_message(msg(i))
        assert path.stat().st_size == data_size(path) == flog(store).size
    await asyncio.gather(*(store.add_message(msg(i)) for i in range(3, 10)))  # a group in batch mode
    assert path.stat().st_size == data_size(path) == flog(store).size
    await store.add_message(msg(10, 100_000))  # larger than RESERVE
    raw = path.read_bytes()
    assert len(raw) == data_size(path) and raw.endswith(b"\n") and b"\0" not in raw
    await store.close()
    assert await reopened_messages(storage) == [msg(i) for i in range(10)] + [msg(10, 100_000)]


async def _crashed_always_log(storage: Path, n: int) -> bytes:
    """The bytes an fsync="always" writer leaves when it dies after ``n`` messages (a copy of its open log,
    put back after it closed): the records followed by its NUL reserve."""
    store = await open_store(storage, fsync="always", reserve_tail=True)
    for i in range(n):
        await store.add_message(msg(i))
    snapshot = log_path(storage).read_bytes()
    await store.close()
    assert snapshot.endswith(b"\0") and len(snapshot) >= data_size(log_path(storage)) + 1
    log_path(storage).write_bytes(snapshot)
    return snapshot


async def test_a_batch_writer_after_a_crashed_always_writer_writes_at_the_data_end(storage: Path) -> None:
    snapshot = await _crashed_always_log(storage, 3)
    path = log_path(storage)
    end = len(snapshot.rstrip(b"\0"))
    store = await open_store(storage, fsync="batch")
    assert flog(store).torn is None and store.recovered is None  # the NUL tail is no torn tail
    assert await store.get_messages() == [msg(i) for i in range(3)]
    await asyncio.gather(*(store.add_message(msg(i)) for i in range(3, 9)))  # groups: several records a write
    raw = path.read_bytes()
    assert raw[:end] == snapshot[:end]
    assert len(raw) == data_size(path) and b"\0" not in raw  # written at the data end, the reserve dropped
    await store.add_message(msg(9))  # a single record too
    raw = path.read_bytes()
    assert len(raw) == data_size(path) and b"\0" not in raw
    await store.close()
    assert b"\0" not in path.read_bytes()
    assert torn_side_files(storage) == []
    assert await reopened_messages(storage) == [msg(i) for i in range(10)]


# -- 3. a real SIGKILL ---------------------------------------------------------------------------------
CHILD = """
import asyncio, os, sys, time
from context_persistent import PersistentContextManager
async def main(storage, n):
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="always",
                                                reserve_tail=True)
    for i in range(n):
        await store.add_message({"role": "user", "content": f"m{i}"})
        os.write(1, b"ACK %d\\n" % i)
    os.write(1, b"IDLE\\n")
    time.sleep(3600)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def kill_writer(storage: Path, env: dict[str, str], n: int) -> list[int]:
    """Run a child that appends ``n`` messages with fsync="always", SIGKILL it once idle; its acks."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(storage), str(n)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line == b"IDLE\n":
                break
            assert line.startswith(b"ACK "), line
            acked.append(int(line.split()[1]))
        else:
            err = proc.stderr.read() if proc.stderr else b""
            raise AssertionError(f"the writer exited early ({proc.wait(30)}): {err!r}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # (only this child, by its pid)
        proc.wait(30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


N_KILLED = 6


async def test_a_killed_always_writer_leaves_a_nul_tail_that_the_next_writer_reuses(
        storage: Path, subprocess_env: dict[str, str]) -> None:
    acked = kill_writer(storage, subprocess_env, N_KILLED)
    assert acked == list(range(N_KILLED))
    path = log_path(storage)
    raw = path.read_bytes()
    end = data_size(path)
    assert raw.endswith(b"\0") and len(raw) > end and raw[:end].endswith(b"\n")
    expected = [{"role": "user", "content": f"m{i}"} for i in acked]
    async with await open_store(storage, readonly=True) as reader:
        assert flog(reader).torn is None  # the NUL tail is not reported as a torn tail
        assert await reader.get_messages() == expected
    assert path.read_bytes() == raw  # the reader changed nothing
    store = await open_store(storage, fsync="always", reserve_tail=True)
    assert flog(store).torn is None and store.recovered is None
    assert torn_side_files(storage) == []
    assert await store.get_messages() == expected
    assert flog(store).size == end  # appends continue at the data end, inside the old reserve
    await store.add_message(msg(100))
    await store.add_message(msg(101))
    raw2 = path.read_bytes()
    assert raw2[:end] == raw[:end] and data_size(path) > end
    await store.close()
    closed = path.read_bytes()
    assert closed.endswith(b"\n") and b"\0" not in closed
    assert torn_side_files(storage) == []
    assert await reopened_messages(storage) == expected + [msg(100), msg(101)]


# -- 4. a torn record inside the reserved tail ------------------------------------------------------------
async def test_a_torn_record_inside_the_reserved_tail_is_cut(storage: Path, subprocess_env: dict[str, str]) -> None:
    acked = kill_writer(storage, subprocess_env, N_KILLED)
    path = log_path(storage)
    end = data_size(path)
    before = path.read_bytes()
    last_seq = list(scan(path))[-1][0]["seq"]
    line = codec.encode(last_seq + 1, "message_added", orjson.dumps({"message": msg(99)}))
    half = line[: len(line) // 2]
    assert b"\0" not in half and len(before) >= end + len(half)
    with open(path, "r+b") as f:  # the dying writer got half a record into its reserve
        f.seek(end)
        f.write(half)
    assert path.stat().st_size == len(before)  # still NULs after the half record
    store = await open_store(storage, fsync="always", reserve_tail=True)
    assert store.recovered is not None and store.recovered.offset == end
    sides = torn_side_files(storage)
    assert len(sides) == 1
    assert sides[0].read_bytes() == half  # exactly the torn bytes, none of the NULs
    assert path.read_bytes() == before[:end]  # the log ends at the last valid record
    expected = [{"role": "user", "content": f"m{i}"} for i in acked]
    assert await store.get_messages() == expected
    await store.add_message(msg(7))
    await store.close()
    assert b"\0" not in path.read_bytes()
    assert await reopened_messages(storage) == expected + [msg(7)]


# -- 5. NULs in the middle are corruption; NULs after the data are not ---------------------------------
async def _closed_log(storage: Path, n: int) -> list[bytes]:
    async with await open_store(storage, fsync="batch") as store:
        for i in range(n):
            await store.add_message(msg(i))
    return log_path(storage).read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize("readonly", [False, True])
async def test_nul_bytes_before_a_valid_record_are_corruption(storage: Path, readonly: bool) -> None:
    lines = await _closed_log(storage, 4)
    path = log_path(storage)
    path.write_bytes(b"".join(lines[:3]) + bytes(RESERVE) + b"".join(lines[3:]))
    with pytest.raises(LogCorruptedError):
        await open_store(storage, readonly=readonly)
    assert torn_side_files(storage) == []


async def test_nul_bytes_between_records_on_their_own_line_are_corruption(storage: Path) -> None:
    lines = await _closed_log(storage, 4)
    path = log_path(storage)
    path.write_bytes(b"".join(lines[:3]) + bytes(100) + b"\n" + b"".join(lines[3:]))
    with pytest.raises(LogCorruptedError):
        await open_store(storage)


async def test_a_log_that_is_all_nul_after_a_valid_prefix_opens_clean(storage: Path) -> None:
    lines = await _closed_log(storage, 4)
    path = log_path(storage)
    prefix = b"".join(lines)
    path.write_bytes(prefix + bytes(3 * RESERVE + 17))
    assert data_size(path) == len(prefix)
    async with await open_store(storage, readonly=True) as reader:
        assert flog(reader).torn is None
        assert await reader.get_messages() == [msg(i) for i in range(4)]
    store = await open_store(storage, fsync="batch")
    assert flog(store).torn is None and store.recovered is None
    assert await store.get_messages() == [msg(i) for i in range(4)]
    await store.add_message(msg(4))
    await store.close()
    assert torn_side_files(storage) == []
    assert path.read_bytes().startswith(prefix) and b"\0" not in path.read_bytes()
    assert await reopened_messages(storage) == [msg(i) for i in range(5)]


# -- 6. follow -------------------------------------------------------------------------------------------
async def test_a_follow_cursor_ends_at_the_data_of_a_log_with_a_reserved_tail(storage: Path) -> None:
    store = await open_store(storage, fsync="always", reserve_tail=True)
    for i in range(4):
        await store.add_message(msg(i))
    path = log_path(storage)
    assert path.read_bytes().endswith(b"\0")
    want = [r["seq"] for r, _ in scan(path)]
    cursor = _Cursor(path, 0)
    records, more = cursor.read()
    assert [r["seq"] for r in records] == want and more is False
    assert cursor.read() == ([], False)  # nothing new: no busy loop over the NULs
    assert cursor.offset == data_size(path)
    await store.add_message(msg(4))
    await store.add_message(msg(5))
    assert path.read_bytes().endswith(b"\0")
    records, more = cursor.read()
    assert [r["data"]["message"] for r in records] == [msg(4), msg(5)] and more is False
    assert [r["seq"] for r in records] == [want[-1] + 1, want[-1] + 2]
    assert cursor.read() == ([], False)
    await store.close()
    assert cursor.read() == ([], False)  # the reserve cut on close: nothing new, no restart


async def test_a_follow_cursor_waits_on_a_bad_last_line_inside_the_reserved_tail(storage: Path) -> None:
    """A final line that does not verify, with only NULs after it, is a torn tail the next writer will cut:
    the cursor waits on it (as at the end of the file) instead of reporting corruption, then continues."""
    snapshot = await _crashed_always_log(storage, 3)
    path = log_path(storage)
    end = len(snapshot.rstrip(b"\0"))
    want = [r["seq"] for r, _ in scan(path)]
    line = codec.encode(want[-1] + 1, "message_added", orjson.dumps({"message": msg(99)}))
    bad = line[: len(line) // 2] + b"\n"
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(bad)
    assert path.read_bytes().endswith(b"\0")
    cursor = _Cursor(path, 0)
    records, more = cursor.read()
    assert [r["seq"] for r in records] == want and more is False
    assert cursor.read() == ([], False)
    # A complete bad line is corruption where records were synced (docs/format.md); with fsync="never" the
    # writer cuts it as a torn tail, then appends in its place.
    store = await open_store(storage, fsync="never")
    assert store.recovered is not None and [p.read_bytes() for p in torn_side_files(storage)] == [bad]
    await store.add_message(msg(3))
    records, more = cursor.read()
    assert [r["data"]["message"] for r in records] == [msg(3)] and more is False
    await store.close()


# -- 7. verify and the ls timestamp ---------------------------------------------------------------------
def test_verify_finds_no_problem_in_a_killed_log_with_a_nul_tail(storage: Path,
                                                                 subprocess_env: dict[str, str]) -> None:
    acked = kill_writer(storage, subprocess_env, N_KILLED)
    path = log_path(storage)
    assert path.read_bytes().endswith(b"\0")
    records = list(scan(path))
    report = verify(storage / SESSION, SESSION)
    assert report.problems == [] and report.gaps == []
    assert report.ok
    assert report.size == data_size(path) == records[-1][1]
    assert report.records == len(records) == len(acked) + 1  # session_started + the messages
    assert report.last_seq == records[-1][0]["seq"]
    assert report.side_files == []


def test_last_ts_reads_the_last_record_before_a_nul_tail(tmp_path: Path) -> None:
    path = tmp_path / LOG_NAME
    stamps = [f"2024-05-01T12:00:0{i}.000000+00:00" for i in range(1, 6)]
    data = b"".join(codec.encode(i, "message_added", orjson.dumps({"message": msg(i)}), ts)
                    for i, ts in enumerate(stamps, 1))
    path.write_bytes(data + bytes(RESERVE))
    assert _last_ts(path) == stamps[-1]
    path.write_bytes(data + bytes(RESERVE + 12345))  # data and NULs across a 64 KiB read boundary
    assert _last_ts(path) == stamps[-1]


# -- 8. a failed reserve write does not fail the append ----------------------------------------------------
async def test_a_failed_reserve_write_does_not_fail_the_append(storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await open_store(storage, fsync="always", reserve_tail=True)
    await store.add_message(msg(0))
    path = log_path(storage)
    fd = flog(store)._fd
    real = os.pwrite
    refused: list[int] = []

    def pwrite(f: int, data: Any, offset: int) -> int:
        data = bytes(data)
        if f == fd and len(data) >= log_mod.RESERVE and not data.strip(b"\0"):
            refused.append(len(data))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(f, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    big = msg(1, 2 * RESERVE)  # past the current reserve: the writer must reserve more
    await store.add_message(big)
    assert refused, "the reserve write was never attempted"
    assert file_messages(path) == [msg(0), big]
    assert path.stat().st_size == data_size(path)  # no reserve, no half-written zeros
    await store.add_message(msg(2, 2 * RESERVE))
    assert len(refused) >= 2
    assert file_messages(path) == [msg(0), big, msg(2, 2 * RESERVE)]
    monkeypatch.undo()
    # durable: a copy taken now (as a crash would leave it) holds every acknowledged record
    snapshot = path.read_bytes()
    await store.close()
    path.write_bytes(snapshot)
    assert await reopened_messages(storage) == [msg(0), big, msg(2, 2 * RESERVE)]


# -- 9. the default: no reserve, the live file is plain JSONL at every instant -----------------------------
def _jsonl_lines(raw: bytes) -> list[dict[str, Any]]:
    """Parse ``raw`` as JSONL the way any line-by-line tool does (json.loads on every line, no NUL anywhere)."""
    import json

    assert b"\0" not in raw
    assert raw == b"" or raw.endswith(b"\n")
    return [json.loads(line) for line in raw.decode().splitlines()]


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_the_default_live_log_is_plain_jsonl_after_every_append(storage: Path, fsync: str) -> None:
    store = await open_store(storage, fsync=fsync)
    assert store.stats()["reserve_tail"] is False
    path = log_path(storage)
    for i in range(40):
        await store.add_message(msg(i, 3000 if i % 7 == 0 else 0))
        raw = path.read_bytes()
        recs = _jsonl_lines(raw)  # while the writer has it open
        assert path.stat().st_size == flog(store).size == len(raw)
        assert recs[-1]["data"]["message"] == msg(i, 3000 if i % 7 == 0 else 0)
    await store.close()
    assert [r["data"]["message"] for r in _jsonl_lines(path.read_bytes()) if r["type"] == "message_added"] == \
        [msg(i, 3000 if i % 7 == 0 else 0) for i in range(40)]


def test_gnu_tail_reads_the_last_records_of_a_live_default_log(storage: Path, subprocess_env: dict[str, str]) -> None:
    async def write() -> PersistentContextManager:
        store = await open_store(storage)
        for i in range(5):
            await store.add_message(msg(i))
        return store

    store = asyncio.run(write())
    try:
        out = subprocess.run(["tail", "-n", "2", str(log_path(storage))], capture_output=True, check=True,
                             env=subprocess_env).stdout
        assert [r["data"]["message"] for r in _jsonl_lines(out)] == [msg(3), msg(4)]
    finally:
        asyncio.run(store.close())


async def test_a_default_writer_opens_a_killed_reserving_writers_log_and_drops_its_nul_tail(
        storage: Path, subprocess_env: dict[str, str]) -> None:
    acked = kill_writer(storage, subprocess_env, N_KILLED)
    path = log_path(storage)
    raw = path.read_bytes()
    end = data_size(path)
    assert raw.endswith(b"\0") and len(raw) > end  # what the reserving writer left
    expected = [{"role": "user", "content": f"m{i}"} for i in acked]
    store = await open_store(storage)  # the default: no reserve
    assert flog(store).torn is None and store.recovered is None and torn_side_files(storage) == []
    assert await store.get_messages() == expected
    assert path.read_bytes() == raw[:end]  # plain JSONL from the moment it opened
    _jsonl_lines(path.read_bytes())
    await store.add_message(msg(100))
    _jsonl_lines(path.read_bytes())
    await store.close()
    assert await reopened_messages(storage) == expected + [msg(100)]


async def test_reserve_tail_must_be_a_bool_and_needs_fsync_always_on_files(storage: Path) -> None:
    with pytest.raises(ValueError, match="reserve_tail must be true or false"):
        await open_store(storage, reserve_tail="yes")
    for kw in ({"fsync": "batch"}, {"fsync": "never"}, {"backend": "postgres", "dsn": "postgresql://x@h/d"}):
        with pytest.raises(ValueError, match="reserve_tail applies to the file backend with fsync='always' only"):
            await open_store(storage, reserve_tail=True, **kw)
    assert not log_path(storage).exists()
