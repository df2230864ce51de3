"""Ways to lose, leak or wedge data around the log: locks, loops, leftovers, symlinks, redactions, secrets."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, SessionLockedError
from context_persistent.errors import LogWriteError
from context_persistent.paths import validate_session_id
from context_persistent.repair import repair


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
