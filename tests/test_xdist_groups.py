"""The test files that share a costly module- or session-scoped fixture are the ones conftest groups for
pytest-xdist (each such file runs whole in one worker, so the fixture is built once per run)."""

from __future__ import annotations

import re
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
        "tests/test_amplifier_cli.py"  # type: ignore[arg-type]
    assert split(None, "tests/test_cli_streaming.py::test_command[one plain segment-verify]") == \
        "tests/test_cli_streaming.py"  # type: ignore[arg-type]
    assert split(None, "tests/test_store.py::test_open[a::b]") == "tests/test_store.py::test_open[a::b]"  # type: ignore[arg-type]
