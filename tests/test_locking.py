"""One writer per session (flock), readers without a lock, safe session ids and private file modes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, SessionLockedError
from context_persistent.errors import SessionNotFoundError
from context_persistent.storage.log import scan
from context_persistent.storage.paths import LOCK_NAME, LOG_NAME, MAX_SESSION_ID
from context_persistent.operations.repair import repair
from conftest import PYTHON

CHILD = Path(__file__).with_name("crash_child.py")


def _child(env: dict[str, str], mode: str, storage: Path, session: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([PYTHON, str(CHILD), mode, str(storage), session], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()


async def test_a_second_store_in_the_same_process_is_refused_naming_our_pid(storage: Path) -> None:
    """Two writable stores on one session in one process: the second gets SessionLockedError with the pid."""
    first = await PersistentContextManager.open(storage_path=storage, session_id="s")
    await first.add_message({"role": "user", "content": "hi"})
    before = first.path.read_bytes()
    with pytest.raises(SessionLockedError, match=f"locked by pid {os.getpid()}") as info:
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    assert info.value.pid == os.getpid()
    assert first.path.read_bytes() == before
    await first.add_message({"role": "user", "content": "still the writer"})  # the first store is unaffected
    await first.close()
    second = await PersistentContextManager.open(storage_path=storage, session_id="s")  # free after close
    assert len(await second.get_messages()) == 2
    await second.close()


async def test_a_second_writer_process_is_refused_naming_the_holder_pid(storage: Path,
                                                                       subprocess_env: dict[str, str]) -> None:
    """While another process holds the session, open fails at once naming that pid; the log is untouched."""
    holder = _child(subprocess_env, "hold", storage, "s")
    try:
        log = storage / "s" / LOG_NAME
        before = log.read_bytes()
        with pytest.raises(SessionLockedError) as info:
            await PersistentContextManager.open(storage_path=storage, session_id="s")
        assert info.value.pid == holder.pid and f"pid {holder.pid}" in str(info.value)
        with pytest.raises(SessionLockedError):
            repair(storage / "s", "s")  # repair needs the writer lock too
        assert log.read_bytes() == before
        async with await PersistentContextManager.open(storage_path=storage, session_id="s", readonly=True) as ro:
            assert await ro.get_messages() == [{"role": "user", "content": "m0:"}]  # readers need no lock
    finally:
        _kill(holder)


async def test_a_stale_lock_from_a_killed_process_is_taken_over(storage: Path,
                                                               subprocess_env: dict[str, str]) -> None:
    """After the holder is SIGKILLed its lock file still names it, yet the next writer opens at once."""
    holder = _child(subprocess_env, "hold", storage, "s")
    _kill(holder)
    lock = storage / "s" / LOCK_NAME
    assert lock.read_text() == str(holder.pid)  # the stale pid is still written there
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        assert lock.read_text() == str(os.getpid())
        await store.add_message({"role": "user", "content": "after the crash"})
        assert len(await store.get_messages()) == 2
    assert lock.read_text() == ""  # released on close


async def test_readonly_opens_see_a_consistent_prefix_while_a_writer_appends(storage: Path,
                                                                            subprocess_env: dict[str, str]) -> None:
    """Read-only opens during another process's appends each see m0..mK in order, never an error or a torn record."""
    writer = _child(subprocess_env, "append", storage, "s")
    try:
        counts: list[int] = []
        while len(set(counts)) < 5 and len(counts) < 5000:  # until we have seen it grow a few times
            async with await PersistentContextManager.open(storage_path=storage, session_id="s",
                                                           readonly=True) as ro:
                numbers = [int(m["content"][1:].split(":")[0]) for m in await ro.get_messages()]
            assert numbers == list(range(len(numbers)))
            counts.append(len(numbers))
        assert counts == sorted(counts) and counts[-1] > counts[0], counts  # it really was appending
    finally:
        _kill(writer)
    assert [r["seq"] for r, _ in scan(storage / "s" / LOG_NAME)][-1] >= counts[-1]


async def test_readonly_open_of_a_missing_session_fails_and_creates_nothing(storage: Path) -> None:
    """Read-only open of an unknown session raises SessionNotFoundError without creating a folder."""
    with pytest.raises(SessionNotFoundError):
        await PersistentContextManager.open(storage_path=storage, session_id="ghost", readonly=True)
    assert not (storage / "ghost").exists()


BAD_IDS: list[Any] = ["", ".", "..", ".hidden", "a/b", "../escape", "a\\b", "a..b", "x\x00y", "a b", "ü",
                      "x" * (MAX_SESSION_ID + 1), None, 7]


@pytest.mark.parametrize("session_id", BAD_IDS, ids=repr)
async def test_bad_session_ids_are_refused_before_touching_any_path(storage: Path, session_id: Any) -> None:
    """Path separators, '..', a leading dot, odd characters, overlong or non-string ids raise ValueError; no folder appears."""
    with pytest.raises(ValueError, match="session_id"):
        await PersistentContextManager.open(storage_path=storage, session_id=session_id)
    assert not storage.exists()


@pytest.mark.parametrize("session_id", ["a", "A-b_c.d:e@f+g=h", "x" * MAX_SESSION_ID, "0"])
async def test_good_session_ids_are_accepted(storage: Path, session_id: str) -> None:
    """Letters, digits and _ . : @ + = - up to the length limit are accepted."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=session_id) as store:
        assert store.path == storage / session_id / LOG_NAME


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def test_files_are_0600_and_folders_0700_even_with_a_permissive_umask(storage: Path) -> None:
    """Every file the store writes (log, lock, checkpoint, torn side file, quarantine) is 0600, folders 0700."""
    old = os.umask(0)
    try:
        nested = storage / "deep" / "er"
        async with await PersistentContextManager.open(storage_path=nested, session_id="s",
                                                       checkpoint_every=2) as store:
            for i in range(5):
                await store.add_message({"role": "user", "content": f"m{i}"})
        log = nested / "s" / LOG_NAME
        with open(log, "ab") as f:
            f.write(b'{"v":1,"seq":')  # a torn tail: the next open saves it to a side file
        async with await PersistentContextManager.open(storage_path=nested, session_id="s"):
            pass
        data = log.read_bytes()
        lines = data.splitlines(keepends=True)
        bad = bytearray(lines[2])
        bad[10] ^= 1
        log.write_bytes(b"".join(lines[:2]) + bytes(bad) + b"".join(lines[3:]))
        repair(nested / "s", "s")  # writes a quarantine file and a new log
        async with await PersistentContextManager.open(storage_path=nested, session_id="s",
                                                       checkpoint_every=1) as store:
            await store.add_message({"role": "user", "content": "again"})
    finally:
        os.umask(old)
    folder = nested / "s"
    names = {p.name.split("-")[0] for p in folder.iterdir()}
    assert {"events.jsonl", "lock", "checkpoint.json", "events.jsonl.torn", "events.jsonl.quarantine"} <= names
    for p in folder.iterdir():
        assert _mode(p) == 0o600, p
    for d in (storage, storage / "deep", nested, folder):
        assert _mode(d) == 0o700, d
