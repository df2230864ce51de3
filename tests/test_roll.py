"""Rolling without a stall: the seal uses the writer's running SHA-256 (no re-read of the segment), a prefix
the writer did not write is hashed and checked in the background, compression runs in a worker thread."""

from __future__ import annotations

import builtins
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.storage import segment_store
from context_persistent.operations.repair import verify
from context_persistent.storage.segments import MANIFEST_NAME, SEGMENT_PREFIX, segment_name

SID = "roll"
BODY = "x" * 200


def _segments(storage: Path) -> list[dict[str, Any]]:
    segs: list[dict[str, Any]] = orjson.loads((storage / SID / MANIFEST_NAME).read_bytes())["segments"]
    return segs


def _assert_hashes_hold(storage: Path) -> None:
    folder = storage / SID
    for s in _segments(storage):
        data = (folder / s["name"]).read_bytes()
        assert s["size"] == len(data) and s["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest(), s["name"]


class ReadCounter:
    """Counts bytes read from the log's files (``events.jsonl``, ``segment-*``) through open() and os.pread/read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.folder = str(folder)
        self.reads: list[tuple[str, int]] = []
        real_open, real_pread, real_read = builtins.open, os.pread, os.read

        def is_log(path: str) -> bool:
            name = os.path.basename(path)
            return path.startswith(self.folder) and (name.startswith("events.jsonl") or name.startswith(SEGMENT_PREFIX))

        def fd_path(fd: int) -> str:
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""

        def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, Path)) and "r" in mode and is_log(str(file)):
                self.reads.append((str(file), -1))
            return real_open(file, mode, *args, **kwargs)

        def counting_pread(fd: int, n: int, offset: int) -> bytes:
            data = real_pread(fd, n, offset)
            if is_log(fd_path(fd)):
                self.reads.append((fd_path(fd), len(data)))
            return data

        def counting_read(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            if is_log(fd_path(fd)):
                self.reads.append((fd_path(fd), len(data)))
            return data

        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(os, "pread", counting_pread)
        monkeypatch.setattr(os, "read", counting_read)


@pytest.mark.parametrize("options", [{"fsync": "always"}, {"fsync": "batch"}, {"fsync": "never"},
                                     {"fsync": "always", "reserve_tail": True}])
async def test_the_append_that_rolls_reads_nothing_back(storage: Path, monkeypatch: pytest.MonkeyPatch,
                                                         options: dict[str, Any]) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096, **options)
    counter = ReadCounter(monkeypatch, storage / SID)
    rolls = 0
    for i in range(120):
        before = store._log.base
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
        rolls += store._log.base != before
    assert rolls >= 5
    assert counter.reads == []  # no append, and no roll, read a byte of the log back
    monkeypatch.undo()
    await store.close()
    _assert_hashes_hold(storage)
    assert verify(storage / SID, SID).ok


@pytest.mark.parametrize("options", [{"fsync": "always"}, {"fsync": "never"}, {"fsync": "always", "reserve_tail": True}])
async def test_a_reopened_active_segment_is_hashed_once_in_the_background(storage: Path,
                                                                          options: dict[str, Any]) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0, **options)
    for i in range(30):
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
    await store.close()
    prefix = (storage / SID / "events.jsonl").stat().st_size
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=16384, **options)
    running = store._log._hash
    assert running is not None and running.read_back == 0  # open does not hash the prefix
    i = 30
    while not (storage / SID / MANIFEST_NAME).exists():
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
        i += 1
    # the prefix, read back once (plus any record appended while the catch-up was still behind)
    assert prefix <= running.read_back
    appended_during_catch_up = running.read_back - prefix
    assert store._log._hash is not running and store._log._hash is not None
    assert store._log._hash.read_back == 0
    await store.close()
    _assert_hashes_hold(storage)
    [seg] = _segments(storage)
    records = (storage / SID / seg["name"]).read_bytes().splitlines()
    assert seg["first_seq"] == 1 and seg["last_seq"] == len(records)
    assert appended_during_catch_up <= seg["size"] - prefix
    assert verify(storage / SID, SID).ok


async def test_a_reopened_segment_far_from_its_roll_is_not_read_back(storage: Path) -> None:
    """A writer reads a reopened active segment back (to hash and check it) only once the segment is within
    a quarter of ``segment_bytes`` of its roll: a process that appends a turn to a long session and exits
    (the Amplifier CLI) reads none of it; nearer the roll the catch-up starts, and the seal's hash holds."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0) as store:
        for i in range(30):
            await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
    prefix = (storage / SID / "events.jsonl").stat().st_size
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=prefix * 2)
    running = store._log._hash
    assert running is not None
    for i in range(3):
        await store.add_message({"role": "user", "content": f"later {i}"})
    assert running.read_back == 0 and running._thread is None
    i = 0
    while store._log.size < prefix * 2 * 3 // 4:
        await store.add_message({"role": "user", "content": f"nearer {i} {BODY}"})
        i += 1
    assert running._thread is not None  # (within a quarter of the roll: the prefix is being read back)
    while not (storage / SID / MANIFEST_NAME).exists():
        await store.add_message({"role": "user", "content": f"to the roll {i} {BODY}"})
        i += 1
    assert prefix <= running.read_back
    await store.close()
    _assert_hashes_hold(storage)
    assert verify(storage / SID, SID).ok


async def test_a_failed_write_leaves_the_running_hash_consistent(storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from context_persistent.errors import LogWriteError

    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    for i in range(5):
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
    real = os.fdatasync
    calls = {"n": 0}

    def failing(fd: int) -> None:
        calls["n"] += 1
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(LogWriteError):
        await store.add_message({"role": "user", "content": "never acknowledged " + BODY})
    monkeypatch.setattr(os, "fdatasync", real)
    assert calls["n"] == 1
    for i in range(5, 60):
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
    await store.close()
    assert len(_segments(storage)) >= 2
    _assert_hashes_hold(storage)
    assert all(b"never acknowledged" not in p.read_bytes() for p in (storage / SID).glob(SEGMENT_PREFIX + "*"))
    assert verify(storage / SID, SID).ok


async def test_compression_runs_in_a_worker_thread_after_the_seal(storage: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import context_persistent.storage.log as log_module

    threads: list[str] = []
    real = segment_store.compress_segment
    release = threading.Event()

    def slow_compress(directory: Path, manifest: Any, index: int) -> Any:
        threads.append(threading.current_thread().name)
        assert release.wait(30), "the appends did not go on while the compression ran"
        return real(directory, manifest, index)

    monkeypatch.setattr(log_module, "compress_segment", slow_compress)
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                compress_sealed=True)
    i = 0
    while not threads:
        await store.add_message({"role": "user", "content": f"message {i} {BODY}"})
        i += 1
    for j in range(i, i + 5):  # appends go on while the compression is held up
        await store.add_message({"role": "user", "content": f"message {j} {BODY}"})
    assert threads == ["context-persistent-compress"]
    assert (storage / SID / segment_name(1)).exists()  # sealed and committed; not compressed yet
    release.set()
    for j in range(i + 5, i + 60):  # the next roll waits for the compression before it seals
        await store.add_message({"role": "user", "content": f"message {j} {BODY}"})
    await store.close()  # waits for the last compression
    assert len(threads) >= 2 and set(threads) == {"context-persistent-compress"}
    doc = orjson.loads((storage / SID / MANIFEST_NAME).read_bytes())
    assert doc["pending"] == [] and all(s["compressed"] for s in doc["segments"])
    assert not list((storage / SID).glob(SEGMENT_PREFIX + "*.jsonl")) and not list((storage / SID).glob("*.tmp"))
    assert verify(storage / SID, SID).ok
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    assert len(await store.get_messages()) == i + 60
    await store.close()
