"""The test files that share a costly module- or session-scoped fixture are the ones conftest groups for
pytest-xdist (each such file runs whole in one worker, so the fixture is built once per run)."""

from __future__ import annotations

import re

import pytest
from pathlib import Path

from conftest import SHARED_FIXTURE_FILES

TESTS = Path(__file__).resolve().parent
SHARED = re.compile(r"@pytest\.fixture\([^)]*scope=\"(module|session)\"")


def test_every_file_with_a_shared_fixture_is_grouped() -> None:
    found = {p.name for p in TESTS.glob("test_*.py") if SHARED.search(p.read_text(encoding="utf-8"))}
    assert found == set(SHARED_FIXTURE_FILES)


def test_a_grouped_file_is_one_unit_and_any_other_test_its_own() -> None:
    from conftest import _FileGroups

    split = _FileGroups._split_scope
    assert split(None, "tests/test_amplifier_cli.py::test_session_fork_then_resume_the_fork") == \
        split(None, "tests/test_amplifier_calibration.py::test_x") == "tests/amplifier-host"  # type: ignore[arg-type]
    assert split(None, "tests/test_viewer_api.py::test_x[a]") == "tests/test_viewer_api.py"  # type: ignore[arg-type]
    assert split(None, "tests/test_cli_streaming.py::test_command[one plain segment-verify]") == \
        "tests/test_cli_streaming.py"  # type: ignore[arg-type]
    assert split(None, "tests/test_store.py::test_open[a::b]") == "tests/test_store.py::test_open[a::b]"  # type: ignore[arg-type]


def test_the_files_of_a_shared_unit_are_grouped_files() -> None:
    from conftest import SHARED_UNITS

    assert set(SHARED_UNITS) <= set(SHARED_FIXTURE_FILES)


def test_in_a_worker_the_slow_ungrouped_tests_come_first_and_the_rest_keep_their_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, file: str, slow: bool) -> None:
            self.path, self.slow = Path("tests") / file, slow

        def get_closest_marker(self, name: str) -> object:
            return object() if name == "slow" and self.slow else None

    items = [Item("test_a.py", False), Item("test_cli_streaming.py", True), Item("test_cli_streaming.py", False),
             Item("test_b.py", True), Item("test_c.py", False), Item("test_d.py", True)]
    got = list(items)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytest_collection_modifyitems(None, got)  # type: ignore[arg-type]
    assert got == items  # (without xdist nothing moves)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytest_collection_modifyitems(None, got)  # type: ignore[arg-type]
    assert got == [items[3], items[5], items[0], items[1], items[2], items[4]]
