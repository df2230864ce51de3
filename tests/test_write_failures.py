"""Write failures (ENOSPC, EACCES, EIO): a clear error, nothing half-stored, the log stays valid and continues."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from context_persistent import ContextPersistentError, LogWriteError, PersistentContextManager
from context_persistent.storage.log import scan
from context_persistent.storage.paths import LOG_NAME


def msg(i: int, size: int = 0) -> dict[str, Any]:
    return {"role": "user", "content": f"m{i}" + "z" * size}


def _log_messages(path: Path) -> list[dict[str, Any]]:
    """What the file itself holds, read record by record (raises if any record is bad)."""
    return [r["data"]["message"] for r, _ in scan(path) if r["type"] == "message_added"]


class Faults:
    """Makes os.write (and os.pwrite) / os.fdatasync / os.ftruncate fail for one file descriptor only (others
    pass through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fd = -1
        self.fail: dict[str, int] = {}
        self.partial = False
        real = {name: getattr(os, name) for name in ("write", "pwrite", "fdatasync", "ftruncate")}

        def wrap(name: str) -> Any:
            op = "write" if name == "pwrite" else name  # a "write" fault fails both ways of writing

            def fake(fd: int, *args: Any) -> Any:
                if fd == self.fd and op in self.fail:
                    if op == "write" and self.partial:
                        self.partial = False  # half of it lands, then the disk is full
                        return real[name](fd, bytes(args[0])[: max(1, len(args[0]) // 2)], *args[1:])
                    code = self.fail[op]
                    raise OSError(code, os.strerror(code))
                return real[name](fd, *args)
            return fake

        for name in real:
            monkeypatch.setattr(os, name, wrap(name))


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    return Faults(monkeypatch)


CASES = [("write", errno.ENOSPC), ("write", errno.EACCES), ("write", errno.EIO), ("fdatasync", errno.EIO),
         ("fdatasync", errno.ENOSPC)]


@pytest.mark.parametrize("fsync", ["always", "batch"])
@pytest.mark.parametrize(("op", "code"), CASES, ids=[f"{o}-{errno.errorcode[c]}" for o, c in CASES])
async def test_a_failed_append_raises_stores_nothing_and_the_next_append_continues(
        storage: Path, faults: Faults, op: str, code: int, fsync: str) -> None:
    """A write or sync failure raises LogWriteError (a ContextPersistentError) with the errno; memory and file
    exclude the message; the next append succeeds; reopening shows exactly the acknowledged messages."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync=fsync)
    for i in range(3):
        await store.add_message(msg(i))
    faults.fd = store._log._fd
    faults.fail = {op: code}
    with pytest.raises(LogWriteError) as info:
        await store.add_message(msg(3))
    assert isinstance(info.value, ContextPersistentError)
    assert info.value.errno == code and str(store.path) in str(info.value)
    assert await store.get_messages() == [msg(i) for i in range(3)]
    assert _log_messages(store.path) == [msg(i) for i in range(3)]
    faults.fail = {}
    await store.add_message(msg(4))
    assert await store.get_messages() == [msg(0), msg(1), msg(2), msg(4)]
    await store.close()
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as again:
        assert await again.get_messages() == [msg(0), msg(1), msg(2), msg(4)]
        assert again.head_seq == 5  # session_started + 4: the failed message left no seq behind


@pytest.mark.parametrize("op", ["write", "fdatasync"])
async def test_batch_mode_a_failed_group_fails_each_of_its_callers_and_the_next_group_commits(
        storage: Path, faults: Faults, op: str) -> None:
    """fsync=batch: when a group commit's write or sync fails, every caller in that group gets the LogWriteError
    and none of their messages is kept; the next group commits normally, with contiguous seqs."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="batch")
    await store.add_message(msg(0))
    faults.fd, faults.fail = store._log._fd, {op: errno.EIO}
    failed = await asyncio.gather(*(store.add_message(msg(i)) for i in range(1, 6)), return_exceptions=True)
    assert [type(r) for r in failed] == [LogWriteError] * 5
    assert await store.get_messages() == [msg(0)]
    assert _log_messages(store.path) == [msg(0)]
    faults.fail = {}
    await asyncio.gather(*(store.add_message(msg(i)) for i in range(6, 9)))
    assert await store.get_messages() == [msg(0), msg(6), msg(7), msg(8)]
    await store.close()
    seqs = [r["seq"] for r, _ in scan(store.path)]
    assert seqs == list(range(1, len(seqs) + 1)) and store.head_seq == 5  # session_started + 4 messages
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as again:
        assert await again.get_messages() == [msg(0), msg(6), msg(7), msg(8)]


async def test_a_partial_write_before_disk_full_is_rolled_back(storage: Path, faults: Faults) -> None:
    """Half a record written before ENOSPC is truncated away, so the log never holds a torn record mid-file."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s")
    await store.add_message(msg(0))
    before = store.path.read_bytes().rstrip(b"\0")  # (the writer's reserved tail is NUL bytes)
    faults.fd, faults.fail, faults.partial = store._log._fd, {"write": errno.ENOSPC}, True
    with pytest.raises(LogWriteError, match="No space left"):
        await store.add_message(msg(1, 5000))
    assert store.path.read_bytes().rstrip(b"\0") == before
    faults.fail = {}
    await store.add_message(msg(2))
    await store.close()
    assert _log_messages(store.path) == [msg(0), msg(2)]


async def test_when_the_rollback_itself_fails_the_store_refuses_appends_and_reopen_recovers(
        storage: Path, faults: Faults) -> None:
    """If the failed bytes cannot be truncated, further appends are refused; the next open cuts them as a torn tail."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s")
    await store.add_message(msg(0))
    faults.fd, faults.fail, faults.partial = store._log._fd, {"write": errno.EIO, "ftruncate": errno.EIO}, True
    with pytest.raises(LogWriteError, match="could not be rolled back"):
        await store.add_message(msg(1, 5000))
    faults.fail = {}
    with pytest.raises(LogWriteError, match="refuses"):
        await store.add_message(msg(2))
    assert await store.get_messages() == [msg(0)]
    await store.close()
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as again:
        assert await again.get_messages() == [msg(0)]
        assert again.recovered is not None  # the half record was cut to a side file
        await again.add_message(msg(3))
    assert _log_messages(store.path) == [msg(0), msg(3)]


async def test_a_failed_flush_on_close_raises_and_still_releases_the_lock(storage: Path, faults: Faults) -> None:
    """With fsync=never, an EIO from the final flush raises LogWriteError, and the session can be opened again."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never")
    await store.add_message(msg(0))
    faults.fd, faults.fail = store._log._fd, {"fdatasync": errno.EIO}
    with pytest.raises(LogWriteError, match="may not all be durable"):
        await store.close()
    faults.fail = {}
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as again:
        assert await again.get_messages() == [msg(0)]


async def test_opening_where_the_log_cannot_be_created_is_a_clear_error(storage: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES creating the log raises LogWriteError (not a bare OSError) and leaves the session unlocked."""
    real_open = os.open

    def deny(path: Any, *args: Any, **kw: Any) -> int:
        if str(path).endswith(LOG_NAME):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(LogWriteError, match="Permission denied.*nothing was written"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    monkeypatch.setattr(os, "open", real_open)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message(msg(0))


async def test_a_failed_checkpoint_write_is_logged_and_never_breaks_the_store(
        storage: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint that cannot be written is a warning; appends go on and the next open replays the log."""
    from context_persistent.storage.checkpoint import FileCheckpointStore

    def full(self: Any, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileCheckpointStore, "save_sync", full)
    with caplog.at_level(logging.WARNING, logger="context_persistent"):
        async with await PersistentContextManager.open(storage_path=storage, session_id="s",
                                                       checkpoint_every=2) as store:
            for i in range(6):
                await store.add_message(msg(i))
    assert "could not write a checkpoint" in caplog.text
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as again:
        assert await again.get_messages() == [msg(i) for i in range(6)]


# -- a real full disk --------------------------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for this test (needs root); skipped with the reason when mounting is not allowed."""
    where = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(where)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}); the fault-injecting tests cover ENOSPC")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=30)


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_real_full_disk_raises_keeps_the_log_valid_and_continues(tiny_fs: Path, fsync: str) -> None:
    """On a full tmpfs a large message fails with ENOSPC, nothing of it remains, and small appends continue."""
    store = await PersistentContextManager.open(storage_path=tiny_fs, session_id="s", fsync=fsync,
                                                checkpoint_every=3)  # checkpoints also hit the full disk
    acked = []
    for i in range(5):
        await store.add_message(msg(i, 1000))
        acked.append(msg(i, 1000))
    with pytest.raises(LogWriteError) as info:
        await store.add_message(msg(99, 400_000))
    assert info.value.errno == errno.ENOSPC and "No space left" in str(info.value)
    assert await store.get_messages() == acked
    assert _log_messages(store.path) == acked
    await store.add_message(msg(5))
    acked.append(msg(5))
    await store.close()
    async with await PersistentContextManager.open(storage_path=tiny_fs, session_id="s") as again:
        assert await again.get_messages() == acked


async def test_opening_a_new_session_on_a_full_disk_is_a_clear_error(tiny_fs: Path) -> None:
    """When the disk is full before the session exists, open raises LogWriteError naming the problem."""
    filler = tiny_fs / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(LogWriteError, match="No space left"):
        async with await PersistentContextManager.open(storage_path=tiny_fs, session_id="new") as store:
            await store.add_message(msg(0))
