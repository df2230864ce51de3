"""What a newcomer types first works or explains itself (issue #28, "Found by a newcomer")."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from context_persistent import PersistentContextManager


async def test_open_is_an_async_context_manager_without_await(tmp_path: Path) -> None:
    """`async with PersistentContextManager.open(...) as store:` opens the store and closes it on leaving the
    block; `await ...open(...)` and `async with await ...open(...)` still work."""
    async with PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "hi"})
    assert store.closed
    again = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert [m["content"] for m in await again.get_messages()] == ["hi"]
    await again.close()
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as third:
        assert third.head_seq == 2


def test_constructing_the_store_says_how_to_open_it(tmp_path: Path) -> None:
    """`PersistentContextManager(storage_path=..., session_id=...)` is a TypeError naming the spelling that
    works, not Python's "missing 2 required keyword-only arguments"."""
    with pytest.raises(TypeError, match=r"opened, not constructed: use `store = await PersistentContextManager.open"):
        PersistentContextManager(storage_path=tmp_path, session_id="s")  # type: ignore[call-arg]
    assert not (tmp_path / "s").exists()


def test_an_opening_never_awaited_can_be_dropped_quietly(tmp_path: Path) -> None:
    """An opening that is closed without being awaited opens nothing and warns nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opening = PersistentContextManager.open(storage_path=tmp_path, session_id="s")
        opening.close()
    assert not (tmp_path / "s").exists()


def _cli(*args: str, env: dict[str, str]) -> "subprocess.CompletedProcess[str]":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "context_persistent", *args], env=env, capture_output=True,
                          text=True, timeout=60)


async def _two_sessions(storage: Path) -> None:
    for sid in ("my-session", "other"):
        async with PersistentContextManager.open(storage_path=storage, session_id=sid) as store:
            for i in range(3):
                await store.add_message({"role": "user", "content": f"m{i}"})


async def test_huge_numbers_on_the_command_line_are_all_or_a_one_line_error(
        tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """`tail -n`/`show -n` with a count beyond 64 bits print everything (as tail does); a seq beyond 64 bits and
    `--grace-days 1e10` are one-line usage errors (exit 2), never an OverflowError traceback."""
    await _two_sessions(tmp_path)
    huge = "99999999999999999999"
    for args in (("tail", "my-session", "-n", huge), ("show", "my-session", "-n", huge)):
        proc = _cli("--storage", str(tmp_path), *args, env=subprocess_env)
        assert proc.returncode == 0 and proc.stdout.count("m") >= 3 and "Traceback" not in proc.stderr, proc
    for args, says in ((("tail", "my-session", "--after", huge), "an integer from 0 to 9223372036854775807"),
                       (("retention", "apply", "--max-age-days", "1", "--grace-days", "1e10"),
                        "expected a number of days from 0 to 1,000,000"),
                       (("retention", "plan", "--max-bytes", "1" + "0" * 30), "expected a whole number from 0 to")):
        proc = _cli("--storage", str(tmp_path), *args, env=subprocess_env)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc


def test_a_policy_of_1e10_days_is_a_value_error() -> None:
    """The API refuses a day count no date can hold, naming the key and the range."""
    from context_persistent.model.retention import RetentionPolicy

    with pytest.raises(ValueError, match=r"retention.grace_days must be a number from 0 to 1,000,000"):
        RetentionPolicy.from_config({"max_age_days": 1, "grace_days": 1e10})


async def test_a_mistyped_session_id_gets_a_did_you_mean(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Every command that reads a session answers an unknown id with the closest stored ids, or with where to
    list them when none is close (exit 1)."""
    await _two_sessions(tmp_path)
    for command in (("show", "my-sesion"), ("stats", "my-sesion"), ("tail", "my-sesion"), ("verify", "my-sesion"),
                    ("export", "my-sesion", str(tmp_path / "out.jsonl"))):
        proc = _cli("--storage", str(tmp_path), *command, env=subprocess_env)
        assert proc.returncode == 1 and "did you mean 'my-session'?" in proc.stderr, proc
    proc = _cli("--storage", str(tmp_path), "show", "zzz", env=subprocess_env)
    assert proc.returncode == 1 and "did you mean" not in proc.stderr and "context-persistent ls" in proc.stderr


def test_a_refused_file_in_a_session_folder_is_named_with_its_path(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """When the system refuses a file of the session folder (a read-only folder: `repair`, `migrate` take the
    writer lock), the error names the whole path, not just `'lock'`."""
    import os

    from context_persistent.storage.lockfile import FileLock

    (tmp_path / "s").mkdir(mode=0o700)
    real_open = os.open

    def refuse(path: object, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "lock" and dir_fd is not None:  # (root ignores modes: refuse the way a read-only folder does)
            raise PermissionError(13, "Permission denied", "lock")
        return real_open(path, flags, mode, dir_fd=dir_fd)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(PermissionError) as caught:
        FileLock(tmp_path / "s" / "lock", "s")
    assert caught.value.filename == str(tmp_path / "s" / "lock")
    assert str(tmp_path / "s" / "lock") in str(caught.value)
