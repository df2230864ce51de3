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


async def _unanswered_call(storage: Path) -> None:
    async with PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.add_message({"role": "user", "content": "list files"})
        await store.add_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]})


async def test_verify_and_repair_point_an_unanswered_call_to_repair_semantic(
        tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A sound log with an unanswered tool call: verify's verdict names `repair --semantic` (not plain repair),
    and a plain repair, after "needs no repair", says the same; `repair --semantic` then fixes it."""
    await _unanswered_call(tmp_path)
    proc = _cli("--storage", str(tmp_path), "verify", "s", env=subprocess_env)
    assert proc.returncode == 1 and "`context-persistent repair --semantic s`" in proc.stdout, proc.stdout
    assert "`context-persistent repair s`" not in proc.stdout
    proc = _cli("--storage", str(tmp_path), "repair", "s", env=subprocess_env)
    assert proc.returncode == 0 and "needs no repair" in proc.stdout, proc
    assert "`context-persistent repair --semantic s` records the fixes" in proc.stdout, proc.stdout
    assert _cli("--storage", str(tmp_path), "repair", "--semantic", "s", env=subprocess_env).returncode == 0
    assert _cli("--storage", str(tmp_path), "verify", "s", env=subprocess_env).returncode == 0


async def test_a_copied_session_folder_points_to_its_name_or_export_and_import(
        tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A session folder copied under another name: show, verify and repair all say it holds another session's
    log and how to keep it (its name back, or export + import / fork), and none of them suggests repair."""
    import shutil

    await _two_sessions(tmp_path)
    shutil.copytree(tmp_path / "my-session", tmp_path / "copy")
    for command in (("show", "copy"), ("verify", "copy"), ("repair", "copy")):
        proc = _cli("--storage", str(tmp_path), *command, env=subprocess_env)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 1, (command, said)
        assert "holds the log of another session id" in said and "import copy.jsonl NEW" in said, (command, said)
        assert "to quarantine bad records" not in said and "verdict: problems found; `context-persistent repair" \
            not in said, (command, said)


async def test_show_and_markdown_export_print_openai_agents_replies_as_text(
        tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """An openai-agents assistant reply (``output_text`` blocks) is shown and exported to Markdown as its text,
    not as ``[output_text]`` or a JSON block; a refusal says so."""
    from context_persistent.integrations.openai_agents import PersistentSession

    session = PersistentSession("agent", tmp_path)
    await session.add_items([
        {"role": "user", "content": "what is 2+2?"},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is four.", "annotations": []}]},
        {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "refusal", "refusal": "I cannot help with that."}]}])
    await session.aclose()
    shown = _cli("--storage", str(tmp_path), "show", "agent", env=subprocess_env)
    assert shown.returncode == 0 and "It is four." in shown.stdout and "[output_text]" not in shown.stdout
    assert "(refusal) I cannot help with that." in shown.stdout
    out = tmp_path / "agent.md"
    assert _cli("--storage", str(tmp_path), "export", "agent", str(out), env=subprocess_env).returncode == 0
    text = out.read_text()
    assert "\nIt is four.\n" in text and '"output_text"' not in text


@pytest.mark.parametrize("view", ["full", "conversation", "reasoning"])
async def test_a_markdown_export_counts_the_messages_of_its_view(tmp_path: Path, subprocess_env: dict[str, str],
                                                                  view: str) -> None:
    """The Markdown export of every view says how many messages it holds, in its header and in what the
    command prints (the conversation and reasoning views once said 0)."""
    async with PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "list files"})
        await store.add_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]})
        await store.add_message({"role": "tool", "tool_call_id": "c1", "content": "a.txt"})
        await store.add_message({"role": "assistant", "content": "one file: a.txt"})
    expected = {"full": 4, "conversation": 2, "reasoning": 4}[view]
    out = tmp_path / f"{view}.md"
    proc = _cli("--storage", str(tmp_path), "export", "s", str(out), "--view", view, env=subprocess_env)
    assert proc.returncode == 0 and f"exported {expected} messages" in proc.stdout, proc
    assert f"{expected} messages" in out.read_text()
