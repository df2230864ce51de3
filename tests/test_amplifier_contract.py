"""Amplifier's own test suites for context modules, run against this package (they must not skip)."""

from __future__ import annotations

from pathlib import Path

import pytest
from amplifier_core.validation import ContextValidator
from amplifier_core.validation.behavioral import ContextBehaviorTests
from amplifier_core.validation.structural import ContextStructuralTests

import context_persistent

PACKAGE_DIR = Path(context_persistent.__file__).parent


@pytest.fixture
def module_path() -> Path:
    """Point Amplifier's fixtures at our package so they really mount it (storage is in tmp via conftest)."""
    return PACKAGE_DIR


class TestAmplifierContextBehavior(ContextBehaviorTests):
    """Amplifier's behavioural contract tests, mounting context_persistent through mount(MockCoordinator(), {})."""


class TestAmplifierContextStructural(ContextStructuralTests):
    """Amplifier's structural validation of the module."""


async def test_context_validator_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ContextValidator accepts the package: importable, mount signature, async protocol methods; and its mount
    leaves nothing in the storage a real session would use (no test-session there, no lock)."""
    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    result = await ContextValidator().validate(PACKAGE_DIR)
    assert result.passed, [f"{c.name}: {c.message}" for c in result.errors]
    assert list(tmp_path.iterdir()) == []


def test_amplifier_suites_did_not_skip(pytestconfig: pytest.Config) -> None:
    """Guard: the inherited Amplifier tests are collected in this module (a skip would hide them)."""
    names = [n for n in dir(TestAmplifierContextBehavior) if n.startswith("test_")]
    assert len(names) >= 9 and "test_clear_removes_messages" in names


async def test_behavioral_fixture_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mount() with the test coordinator and empty config the Amplifier fixtures and validator use writes to a
    private store that its cleanup deletes: nothing under $CONTEXT_PERSISTENT_DIR or the working directory."""
    from amplifier_core.testing import MockCoordinator

    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(tmp_path / "s"))
    monkeypatch.chdir(tmp_path)
    coordinator = MockCoordinator()
    cleanup = await context_persistent.mount(coordinator, {})
    ctx = coordinator.mount_points["context"]
    await ctx.add_message({"role": "user", "content": "hi"})
    private = Path(ctx.path)
    assert private.is_file() and tmp_path not in private.parents
    await cleanup()
    assert not private.exists() and list(tmp_path.iterdir()) == []
