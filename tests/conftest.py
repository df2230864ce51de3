"""Shared fixtures. Tests never write outside a temporary directory: HOME and the storage default are
pointed into tmp for every test, so nothing can land in the real home directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CONTEXT_PERSISTENT_DIR", str(home / "context-store"))
    return home


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    return path


@pytest.fixture
def lazy_fronts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints keep a lazy front section however much of the history it holds (never written whole,
    storage/checkpoint/front.py ``slim_front``): for tests of the lazy open on sessions that a budget's front
    covers whole."""
    from context_persistent.storage.checkpoint import front

    monkeypatch.setattr(front, "WHOLE_SHARE", 2.0)


@pytest.fixture
def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """Environment for child processes: this checkout importable, HOME in tmp."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOME"] = str(tmp_path / "child-home")
    return env


PYTHON = sys.executable


class _Counter:
    count = 0


@pytest.fixture
def rebuilds(monkeypatch: pytest.MonkeyPatch) -> _Counter:
    """Counts the store's full request-view builds (calls of compaction.build_request_view)."""
    import context_persistent.model.compaction as compaction

    real = compaction.build_request_view
    counter = _Counter()

    async def spy(*args: object, **kwargs: object) -> object:
        counter.count += 1
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compaction, "build_request_view", spy)
    return counter


_SKIP_GUARDED = ("test_amplifier_contract.py",)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Amplifier's inherited suites must run here: a skip of one of them is turned into a failure."""
    if report.skipped and any(name in report.nodeid for name in _SKIP_GUARDED):
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} was skipped; Amplifier's suites must run against this package"


#: Test files whose tests share a module- or session-scoped fixture that is costly to build (the real Amplifier
#: host, large logs): with pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) each runs whole in one worker,
#: so the fixture is built once. Every other test is scheduled on its own. (xdist's own ``xdist_group`` mark
#: does not group under pytest 9.2, so the groups are named here; test_xdist_groups.py keeps the list whole.)
SHARED_FIXTURE_FILES = ("test_amplifier_calibration.py", "test_amplifier_cli.py", "test_bounded_memory.py", "test_cli_streaming.py",
                        "test_foundation_host.py", "test_record_chain.py", "test_retention_crash.py",
                        "test_segment_expiry_crash.py", "test_turn_imports.py", "test_viewer_api.py", "test_viewer_browser.py",
                        "test_viewer_postgres.py", "test_viewer_usage.py")

#: Grouped files that share one fixture between them run as one unit (in one worker, one after the other): the
#: two files of the real Amplifier host use the host the run installs once (realhost.shared_host).
SHARED_UNITS = {"test_amplifier_calibration.py": "amplifier-host", "test_amplifier_cli.py": "amplifier-host"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, the slow tests of the ungrouped files come first (they are handed out one by
    one in this order, after the grouped units): the long tests start early and the run ends with short ones,
    so that both workers finish together. (Only the order changes: a grouped file's tests keep theirs.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def later(item: pytest.Item) -> bool:
        return item.path.name in SHARED_FIXTURE_FILES or item.get_closest_marker("slow") is None

    items[:] = sorted(items, key=later)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # (without pytest-xdist the suite runs in one process)
    pass
else:
    class _FileGroups(LoadScopeScheduling):
        """``--dist loadgroup``: the tests of SHARED_FIXTURE_FILES as one unit per file (per SHARED_UNITS name for
        the files named there), the rest one by one (units of several tests are handed out first, largest
        first, then the rest in collection order)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            folder, _, name = path.rpartition("/")
            if name in SHARED_UNITS:
                return f"{folder}/{SHARED_UNITS[name]}"
            return path if name in SHARED_FIXTURE_FILES else nodeid

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
        return _FileGroups(config, log) if config.getvalue("dist") == "loadgroup" else None
