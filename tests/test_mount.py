"""mount(): session id and storage resolution, observability registration, cleanup; validator mounts."""

from __future__ import annotations

import os

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from amplifier_core.testing import MockCoordinator

from context_persistent import mount
from context_persistent.integrations.amplifier import is_validator


class Coordinator:
    """The part of a real session's coordinator that mount() uses (not amplifier_core's test coordinator,
    which mount() recognises as a validator run)."""

    def __init__(self, session_id: str = "test-session") -> None:
        self.session_id = session_id
        self.hooks = None
        self.mount_points: dict[str, Any] = {}
        self.contributors: dict[str, dict[str, Any]] = {}

    async def mount(self, point: str, module: Any) -> None:
        self.mount_points[point] = module

    def register_contributor(self, channel: str, name: str, fn: Any) -> None:
        self.contributors.setdefault(channel, {})[name] = fn


async def test_config_wins_over_coordinator_and_env(tmp_path: Path) -> None:
    """config session_id and storage_path win; the cleanup closes the store and releases the lock."""
    coordinator = Coordinator()
    cleanup = await mount(coordinator, {"session_id": "from-config", "storage_path": str(tmp_path / "cfg")})
    ctx = coordinator.mount_points["context"]
    await ctx.add_message({"role": "user", "content": "x"})
    assert ctx.path == tmp_path / "cfg" / "from-config" / "events.jsonl"
    await cleanup()
    assert ctx.closed
    cleanup2 = await mount(Coordinator(), {"session_id": "from-config", "storage_path": str(tmp_path / "cfg")})
    await cleanup2()


async def test_env_then_home_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without storage_path: $CONTEXT_PERSISTENT_DIR, else ~/.amplifier/context, whatever the working directory."""
    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(tmp_path / "env"))
    c = Coordinator()
    cleanup = await mount(c, {})
    assert c.mount_points["context"].path == tmp_path / "env" / "test-session" / "events.jsonl"
    await cleanup()
    monkeypatch.delenv("CONTEXT_PERSISTENT_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    c = Coordinator()
    cleanup = await mount(c, {})
    assert c.mount_points["context"].path == tmp_path / "home" / ".amplifier" / "context" / "test-session" / "events.jsonl"
    assert not (tmp_path / ".amplifier").exists()
    await cleanup()


async def test_registers_observability_events(tmp_path: Path) -> None:
    """The compaction and recovery events are contributed to observability.events."""
    c = MockCoordinator()
    cleanup = await mount(c, {"storage_path": str(tmp_path)})
    contributed = await c.collect_contributions("observability.events")
    names = {n for group in contributed for n in (group if isinstance(group, list) else [group])}
    assert {"context:pre_compact", "context:post_compact", "context:compaction"} <= names
    await cleanup()


async def test_unknown_keys_are_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Keys meant for other modules (e.g. the reference module's transcript_path) do not break mounting."""
    c = Coordinator()
    cleanup = await mount(c, {"storage_path": str(tmp_path), "transcript_path": "x", "fsync": "batch"})
    assert "transcript_path" in caplog.text
    assert c.mount_points["context"].stats()["fsync"] == "batch"
    await cleanup()


async def test_bad_config_fails_the_mount(tmp_path: Path) -> None:
    """A bad value for a known key fails the mount with a clear error (Amplifier aborts the session)."""
    with pytest.raises(ValueError, match="fsync must be one of"):
        await mount(Coordinator(), {"storage_path": str(tmp_path), "fsync": "maybe"})


async def test_validator_mount_is_ephemeral(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """amplifier_core's test coordinator with no storage configured (the validator's case) gets a private store
    deleted at cleanup: nothing lands in the environment's storage or the working directory."""
    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    c = MockCoordinator()
    assert is_validator(c) and not is_validator(Coordinator())
    cleanup = await mount(c, {})
    ctx = c.mount_points["context"]
    await ctx.add_message({"role": "user", "content": "x"})
    where = Path(ctx.path).parent.parent
    assert where.is_dir() and oct(where.stat().st_mode & 0o777) == "0o700"
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "env").exists()
    await cleanup()
    assert not where.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


async def test_a_test_coordinator_given_a_storage_persists_there(tmp_path: Path) -> None:
    """An app's test that mounts with amplifier_core's test coordinator and an explicit ``storage_path`` gets a
    real store there: what it adds is on disk after the cleanup and a second mount reads it back."""
    c = MockCoordinator()
    cleanup = await mount(c, {"storage_path": str(tmp_path / "cfg")})
    await c.mount_points["context"].add_message({"role": "user", "content": "kept"})
    await cleanup()
    assert (tmp_path / "cfg" / "test-session" / "events.jsonl").is_file()
    again = MockCoordinator()
    cleanup = await mount(again, {"storage_path": str(tmp_path / "cfg")})
    assert [m["content"] for m in await again.mount_points["context"].get_messages()] == ["kept"]
    await cleanup()


VALIDATOR_CHILD = """
import asyncio, os, sys, pathlib
from amplifier_core.testing import MockCoordinator
from context_persistent import mount
async def main():
    c = MockCoordinator()
    cleanup = await mount(c, {})
    await c.mount_points["context"].add_message({"role": "user", "content": "hi"})
    print("mounted", flush=True)
    go = pathlib.Path(sys.argv[2])
    while not go.exists():
        await asyncio.sleep(0.02)
    await cleanup()
    print("done", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_two_validator_processes_do_not_collide(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Two processes mounting the validator's way at the same time both succeed (no shared writer lock), and
    neither writes under $CONTEXT_PERSISTENT_DIR or the working directory."""
    env = {**subprocess_env, "CONTEXT_PERSISTENT_DIR": str(tmp_path / "env")}
    work = tmp_path / "cwd"
    work.mkdir()
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", VALIDATOR_CHILD, str(tmp_path / "cfg"), str(go)], cwd=work,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:  # both hold their store at once before either lets go
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line == "mounted\n", (line, p.stderr.read() if p.stderr else "")
        go.touch()
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0 and out == "done\n", err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "env").exists()
    assert list(work.iterdir()) == []
    assert not (Path(env["HOME"]) / ".amplifier").exists()


async def test_amplifier_cores_validation_with_the_mount_plans_storage_is_ephemeral(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """amplifier_core's ContextValidator mounts with the mount plan's config (a storage included), as the
    kernel's loader does at load: that run still writes nothing to the configured storage."""
    from amplifier_core.validation import ContextValidator

    import context_persistent

    from context_persistent.store.manager import PersistentContextManager

    opened: list[dict] = []
    real_open = PersistentContextManager.open.__func__  # type: ignore[attr-defined]

    def spy(cls: type, **kwargs: object) -> object:
        opened.append(dict(kwargs))
        return real_open(cls, **kwargs)

    monkeypatch.setattr(PersistentContextManager, "open", classmethod(spy))
    result = await ContextValidator().validate(str(Path(context_persistent.__file__).parent),
                                               config={"storage_path": str(tmp_path / "cfg")})
    assert result.passed, result
    assert not (tmp_path / "cfg").exists() or not any((tmp_path / "cfg").iterdir())
    # (the kernel's load-time check in every CLI process calls no method: its throwaway store syncs and indexes
    # nothing, #23)
    assert len(opened) == 1 and opened[0]["fsync"] == "never" and opened[0]["search_index"] is False
    scratch = Path("/dev/shm")  # (a memory file system, where there is one: the creation's syncs cost nothing)
    if scratch.is_dir() and os.access(scratch, os.W_OK | os.X_OK):
        assert Path(str(opened[0]["storage_path"])).parent == scratch
    assert not Path(str(opened[0]["storage_path"])).exists()  # (deleted at the cleanup)


async def test_validation_through_a_wrapper_module_is_ephemeral_too(tmp_path: Path) -> None:
    """A wrapper module between amplifier_core's validation and this mount (the benchmark's ``context-timed``,
    which mounts the inner module with a coordinator of its own) hides the test coordinator's class: the
    validation is still recognised, by its frames, and writes nothing to the configured storage (it used to
    open a real ``test-session`` there, synced, in every CLI process)."""
    from amplifier_core.validation import ContextValidator

    wrapper = Path(__file__).parent / "amplifier_host" / "modules" / "context-timed" / "amplifier_module_context_timed"
    storage = tmp_path / "cfg"
    result = await ContextValidator().validate(str(wrapper), config={
        "inner": "context-persistent", "inner_config": {"storage_path": str(storage)}})
    assert result.passed, result
    assert not storage.exists() or not any(storage.iterdir())
