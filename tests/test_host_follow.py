"""Retention's follow_host rule (docs/amplifier.md, "Sessions the host deletes"): the Amplifier mount links a
session to the CLI's folder of it once that folder exists; a linked session whose folder the host deleted goes
to the trash (undone by ``trash restore``, and not followed again); nothing else is ever selected."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON
from context_persistent import PersistentContextManager
from context_persistent.integrations.amplifier import mount
from context_persistent.model.codec import decode
from context_persistent.model.retention import RetentionPolicy, SessionInfo, plan
from context_persistent.operations import trash

SLUG = "-work-project"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class _Coordinator:
    hooks = None

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.context: Any = None

    async def mount(self, point: str, instance: Any) -> None:
        self.context = instance


@pytest.fixture
def cli_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process looks like the Amplifier CLI: its ``amplifier_app_cli`` is loaded (a stand-in naming the
    project by a fixed slug)."""
    app = types.ModuleType("amplifier_app_cli")
    utils = types.ModuleType("amplifier_app_cli.project_utils")
    utils.get_project_slug = lambda: SLUG  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "amplifier_app_cli", app)
    monkeypatch.setitem(sys.modules, "amplifier_app_cli.project_utils", utils)


def _cli_folder(sid: str) -> Path:
    return Path.home() / ".amplifier" / "projects" / SLUG / "sessions" / sid


async def _run(storage: Path, sid: str, *, cli_saves: bool = True) -> None:
    """One CLI session: mount, a turn, the CLI saves its folder (when ``cli_saves``), cleanup."""
    coordinator = _Coordinator(sid)
    cleanup = await mount(coordinator, {"storage_path": str(storage)})
    await coordinator.context.add_message({"role": "user", "content": f"hello from {sid}"})
    if cli_saves:
        _cli_folder(sid).mkdir(parents=True, exist_ok=True)
        (_cli_folder(sid) / "transcript.jsonl").write_text("{}\n")
    await cleanup()


def _types(storage: Path, sid: str) -> list[str]:
    lines = (storage / sid / "events.jsonl").read_bytes().rstrip(b"\0").splitlines()
    return [decode(x)["type"] for x in lines]


FOLLOW = RetentionPolicy(follow_host=True)


async def test_a_session_the_cli_deleted_goes_to_the_trash_and_comes_back(storage: Path, cli_process: None) -> None:
    """Linked at the cleanup (the CLI saved its folder during the turn) and once only; after the CLI's folder is
    deleted the session is trashed, an unlinked session and a linked one whose folder remains stay; restored,
    it is not followed again."""
    await _run(storage, "deleted")
    await _run(storage, "deleted")  # (a resume: the link is not written again)
    await _run(storage, "kept")
    await _run(storage, "never-saved", cli_saves=False)  # killed before the CLI saved anything, say
    async with await PersistentContextManager.open(storage_path=storage, session_id="library") as s:
        await s.add_message({"role": "user", "content": "not the CLI's"})
    assert _types(storage, "deleted").count("host_linked") == 1
    link = json.loads((storage / "deleted" / "host.json").read_text())
    assert link["folder"] == str(_cli_folder("deleted")) and link["project"] == SLUG
    assert (storage / "deleted" / "host.json").stat().st_mode & 0o777 == 0o600
    assert not (storage / "never-saved" / "host.json").exists()

    shutil.rmtree(_cli_folder("deleted"))  # amplifier session delete
    planned = await trash.plan_file(storage, FOLLOW)
    assert [e.session_id for e in planned.expire] == ["deleted"]
    assert "amplifier session delete" in planned.expire[0].reason
    report = await trash.apply_file(storage, FOLLOW)
    assert [(t["session_id"], t["rule"]) for t in report["trashed"]] == [("deleted", "follow_host")]
    assert sorted(p.name for p in storage.iterdir() if not p.name.startswith(".")) == ["kept", "library",
                                                                                      "never-saved"]
    await trash.restore(storage, "deleted")
    async with await PersistentContextManager.open(storage_path=storage, session_id="deleted", readonly=True) as s:
        assert [m["content"] for m in await s.get_messages()] == ["hello from deleted"] * 2
    assert (await trash.apply_file(storage, FOLLOW))["trashed"] == []  # restored: kept from now on


async def test_nothing_is_followed_when_the_hosts_sessions_folder_is_gone_too(storage: Path,
                                                                             cli_process: None) -> None:
    """A missing project folder (another HOME, an unmounted disk) is not taken for a deletion."""
    await _run(storage, "s1")
    shutil.rmtree(Path.home() / ".amplifier" / "projects" / SLUG)
    assert (await trash.plan_file(storage, FOLLOW)).expire == []


async def test_home_names_where_the_hosts_folders_are_now(storage: Path, cli_process: None, tmp_path: Path) -> None:
    """With a home given, the project's folder is looked for under it instead of the recorded one."""
    await _run(storage, "s1")
    moved = tmp_path / "moved-home"
    shutil.copytree(Path.home() / ".amplifier", moved / ".amplifier")
    shutil.rmtree(_cli_folder("s1"))
    assert (await trash.plan_file(storage, FOLLOW, host_home=moved)).expire == []
    shutil.rmtree(moved / ".amplifier" / "projects" / SLUG / "sessions" / "s1")
    assert [e.session_id for e in (await trash.plan_file(storage, FOLLOW, host_home=moved)).expire] == ["s1"]


async def test_outside_the_cli_nothing_is_linked(storage: Path) -> None:
    """Without the CLI loaded, the mount links nothing, even where a folder of that name exists."""
    _cli_folder("s1").mkdir(parents=True)
    await _run(storage, "s1")
    assert "host_linked" not in _types(storage, "s1") and not (storage / "s1" / "host.json").exists()


async def test_a_link_that_is_not_one_is_not_followed(storage: Path, cli_process: None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A damaged host.json, or one naming another session (a copied folder), selects nothing."""
    await _run(storage, "s1")
    await _run(storage, "s2")
    (storage / "s1" / "host.json").write_text("{not json")
    link = json.loads((storage / "s2" / "host.json").read_text())
    (storage / "s2" / "host.json").write_text(json.dumps({**link, "session_id": "other"}))
    shutil.rmtree(_cli_folder("s1"))
    shutil.rmtree(_cli_folder("s2"))
    assert (await trash.plan_file(storage, FOLLOW)).expire == []
    assert any("s1 is not followed" in r.getMessage() for r in caplog.records)


async def test_apply_on_open_follows_the_host(storage: Path, cli_process: None) -> None:
    """``retention: {follow_host: true, apply_on_open: true}`` in the mount plan trashes the deleted sessions
    of the storage when another session is mounted (never the one being mounted)."""
    await _run(storage, "gone")
    shutil.rmtree(_cli_folder("gone"))
    coordinator = _Coordinator("new")
    cleanup = await mount(coordinator, {"storage_path": str(storage),
                                        "retention": {"follow_host": True, "apply_on_open": True}})
    await cleanup()
    assert [e["session_id"] for e in await trash.list_trash(storage)] == ["gone"]


def test_the_policy_and_its_plan() -> None:
    """follow_host is a flag that counts as a limit, checked first; postgres refuses it."""
    assert RetentionPolicy.from_config({"follow_host": True, "apply_on_open": True}).limits() == {"follow_host": True}
    with pytest.raises(ValueError, match="retention.follow_host must be true or false"):
        RetentionPolicy.from_config({"follow_host": "yes"})
    with pytest.raises(ValueError, match="follow_host applies to the file backend only"):
        PersistentContextManager.check_config({"backend": "postgres", "dsn": "postgresql://x/y",
                                               "retention": {"follow_host": True}})
    gone = SessionInfo("a", T0 - timedelta(days=100), 10, host_gone="its folder is gone")
    p = plan(RetentionPolicy(follow_host=True, max_age_days=30), [gone, SessionInfo("b", T0, 10)], T0)
    assert [(e.session_id, e.rule) for e in p.expire] == [("a", "follow_host")]
    assert plan(RetentionPolicy(max_age_days=300), [gone], T0).expire == []  # (not following: kept)


def test_the_cli_flag(storage: Path, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """``retention apply --follow-amplifier`` needs no other limit; with --dsn it is a usage error."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "context_persistent", *args], env=subprocess_env, capture_output=True,
                              text=True, timeout=60)

    storage.mkdir()
    done = run("retention", "plan", "--storage", str(storage), "--follow-amplifier", str(tmp_path))
    assert done.returncode == 0 and "0 session(s) to expire" in done.stdout, done.stderr
    bad = run("retention", "apply", "--dsn", "postgresql://127.0.0.1:1/x", "--follow-amplifier")
    assert bad.returncode == 2 and "--follow-amplifier applies to a storage folder only" in bad.stderr
