"""mount(): session id and storage resolution, observability registration, cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest
from amplifier_core.testing import MockCoordinator

from context_persistent import mount


async def test_config_wins_over_coordinator_and_env(tmp_path: Path) -> None:
    """config session_id and storage_path win; the cleanup closes the store and releases the lock."""
    coordinator = MockCoordinator()
    cleanup = await mount(coordinator, {"session_id": "from-config", "storage_path": str(tmp_path / "cfg")})
    ctx = coordinator.mount_points["context"]
    await ctx.add_message({"role": "user", "content": "x"})
    assert ctx.path == tmp_path / "cfg" / "from-config" / "events.jsonl"
    await cleanup()
    assert ctx.closed
    cleanup2 = await mount(MockCoordinator(), {"session_id": "from-config", "storage_path": str(tmp_path / "cfg")})
    await cleanup2()


async def test_env_then_cwd_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without storage_path: $CONTEXT_PERSISTENT_DIR, else .amplifier/context under the working directory."""
    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(tmp_path / "env"))
    c = MockCoordinator()
    cleanup = await mount(c, {})
    assert c.mount_points["context"].path == tmp_path / "env" / "test-session" / "events.jsonl"
    await cleanup()
    monkeypatch.delenv("CONTEXT_PERSISTENT_DIR")
    monkeypatch.chdir(tmp_path)
    c = MockCoordinator()
    cleanup = await mount(c, {})
    assert c.mount_points["context"].path == tmp_path / ".amplifier" / "context" / "test-session" / "events.jsonl"
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
    c = MockCoordinator()
    cleanup = await mount(c, {"storage_path": str(tmp_path), "transcript_path": "x", "fsync": "batch"})
    assert "transcript_path" in caplog.text
    assert c.mount_points["context"].stats()["fsync"] == "batch"
    await cleanup()


async def test_bad_config_fails_the_mount(tmp_path: Path) -> None:
    """A bad value for a known key fails the mount with a clear error (Amplifier aborts the session)."""
    with pytest.raises(ValueError, match="fsync must be one of"):
        await mount(MockCoordinator(), {"storage_path": str(tmp_path), "fsync": "maybe"})
