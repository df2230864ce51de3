"""openai-agents' own session tests, run against our PersistentSession.

The archive in ``../shared/peer-suites/`` (openai-agents-python ``tests/memory/`` at 7f7a44f, the
openai-agents 0.22.0 release, the version the test extra pins) is extracted into the test's temporary folder
and run with pytest in a child process. The one change to their suite is a ``tests/memory/conftest.py``
(``tests/peer_openai_agents/conftest_store.py``) that makes every test module's ``SQLiteSession`` our
session with the same constructor; ``tests/test_responses.py`` and ``tests/utils/simple_session.py``, which
the archive does not hold, are stood in for by our own small files (the latter is the session their
compaction tests wrap: ours too). A ``pytest.ini`` gives their asyncio settings.

Tests that cannot apply to a store that is not SQLite are deselected by name, each with its reason
(:data:`DESELECTED`); everything else in the three files must pass. The same copy is also run against the
stock ``SQLiteSession`` (``CP_PEER_STORE=sqlite``), where all of them, the deselected ones included, pass:
the harness itself changes nothing.

Where ``../shared/peer-suites/`` is absent (override: ``$CONTEXT_PERSISTENT_PEER_SUITES``) the tests skip,
saying so; ``$CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "peer_openai_agents"
ARCHIVE = "openai-agents-session-tests-7f7a44f.tar.gz"
VERSION = "0.22.0"

#: The files run: the ones whose tests construct a session store.
FILES = ("tests/memory/test_session.py", "tests/memory/test_session_limit.py",
         "tests/memory/test_openai_responses_compaction_session.py")

#: Files of the archive not run, and why.
NOT_RUN = {
    "tests/memory/test_openai_conversations_session.py":
        "tests OpenAIConversationsSession, which keeps the history in OpenAI's Conversations API (a mocked "
        "client); it constructs no local store to swap",
    "tests/memory/test_session_context_wrapper.py":
        "tests how the Runner passes RunContextWrapper to sessions whose methods take a `wrapper` argument, "
        "with session classes the test file defines itself; no store is constructed",
    "tests/memory/test_session_persistence_sanitize.py":
        "tests a pure function (_sanitize_openai_conversation_item); no store is involved",
}

_SQLITE_CORRUPT = ("writes undecodable rows into SQLite's tables through _locked_connection and expects "
                   "them skipped; our log never skips a corrupt record silently: it refuses to open and names "
                   "the file, line and offset (tests/test_corruption.py)")

#: Test ids deselected against our store, with the reason. Each passes against the stock SQLiteSession.
DESELECTED = {
    "tests/memory/test_session.py::test_sqlite_session_close_closes_worker_thread_connections":
        "inspects SQLiteSession's per-thread sqlite3 connections (_connections)",
    "tests/memory/test_session.py::test_sqlite_session_closed_rejects_empty_add_items":
        "matches SQLiteSession's error text 'SQLiteSession is closed'; ours raises StoreClosedError for the "
        "same call (tests/test_openai_agents.py::test_closed_session_refuses_every_call)",
    "tests/memory/test_session.py::test_sqlite_session_pop_item_skips_corrupt_most_recent": _SQLITE_CORRUPT,
    "tests/memory/test_session.py::test_sqlite_session_pop_item_returns_none_after_dropping_only_corrupt_rows":
        _SQLITE_CORRUPT,
    "tests/memory/test_session.py::test_sqlite_session_get_items_limit_skips_corrupt_newest_rows": _SQLITE_CORRUPT,
    "tests/memory/test_session.py::test_sqlite_session_get_items_session_settings_limit_skips_corrupt_rows":
        _SQLITE_CORRUPT,
    "tests/memory/test_session.py::test_sqlite_session_file_lock_is_shared_across_instances":
        "checks SQLiteSession's per-database-file threading lock registry (_file_lock_counts, _file_locks)",
    "tests/memory/test_session.py::test_sqlite_session_failed_add_items_releases_write_lock":
        "opens the SQLite file to probe its write lock and tables after a failed add; our failed add "
        "(a ValueError, nothing stored, the session still usable) is tested in "
        "tests/test_openai_agents.py::test_bad_item_stores_nothing",
    "tests/memory/test_session.py::test_sqlite_session_failed_clear_session_rolls_back":
        "makes clear fail by dropping a SQLite table, then checks the SQL rollback",
    "tests/memory/test_session.py::test_sqlite_session_failed_pop_item_releases_write_lock":
        "makes pop fail by dropping a SQLite table, then probes the SQLite write lock",
    "tests/memory/test_session.py::test_sqlite_session_rollback_failure_evicts_connection":
        "fakes a failing sqlite3 rollback and checks SQLiteSession's connection eviction (_connections_lock)",
    "tests/memory/test_session.py::test_sqlite_session_close_retries_quarantined_connection":
        "checks SQLiteSession's quarantine of sqlite3 connections that failed to close",
    **{f"tests/memory/test_session.py::test_sqlite_session_post_commit_cancellation_propagates_after_known_"
       f"outcome[{op}]":
       "pauses inside sqlite3.Connection.commit through SQLiteSession._get_connection; the behaviour "
       "(cancelled after the write: the cancellation propagates, the write stands) is tested in "
       "tests/test_openai_agents.py::test_cancelled_call_completes_then_propagates"
       for op in ("add", "pop", "clear")},
    "tests/memory/test_openai_responses_compaction_session.py::TestOpenAIResponsesCompactionSession::"
    "test_run_compaction_restores_history_when_cancelled_again_during_restore":
        "reads the private list (_items) of the in-memory SimpleListSession it subclasses",
}


def peer_suites() -> Path:
    """The peer-suites folder, or a skip (a failure under CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1)."""
    folder = Path(os.environ.get("CONTEXT_PERSISTENT_PEER_SUITES") or ROOT.parent / "shared" / "peer-suites")
    if not (folder / ARCHIVE).is_file():
        reason = f"openai-agents' session tests not found: {folder / ARCHIVE} does not exist"
        if os.environ.get("CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES") == "1":
            pytest.fail(f"the peer suites are required (CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1) but {reason}",
                        pytrace=False)
        pytest.skip(reason)
    return folder


def prepare(tmp_path: Path) -> Path:
    """Extract the archive into ``tmp_path`` and add our files; returns the copy's root."""
    with tarfile.open(peer_suites() / ARCHIVE) as tar:
        tar.extractall(tmp_path / "peer", filter="data")
    root = tmp_path / "peer" / "openai-agents-python"
    for package in ("tests", "tests/memory", "tests/utils"):
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    shutil.copy(SUPPORT / "responses_helpers.py", root / "tests" / "test_responses.py")
    shutil.copy(SUPPORT / "simple_session.py", root / "tests" / "utils" / "simple_session.py")
    shutil.copy(SUPPORT / "conftest_store.py", root / "tests" / "memory" / "conftest.py")
    (root / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    return root


def run_suite(tmp_path: Path, store: str, deselect: dict[str, str]
              ) -> tuple[subprocess.CompletedProcess[str], dict[str, int], int]:
    """Run the copy; the process, the summary counts, and how many event logs the run left in its scratch."""
    installed = metadata.version("openai-agents")
    assert installed == VERSION, (f"the peer suite is from openai-agents {VERSION} (the test extra pins it); "
                                  f"{installed} is installed: pip install -e '.[test]'")
    root = prepare(tmp_path)
    scratch = tmp_path / "stores"
    scratch.mkdir()
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(root), str(ROOT)]), "HOME": str(tmp_path / "home"),
                "CP_PEER_STORE": store, "CP_PEER_TMP": str(scratch), "TMPDIR": str(scratch),
                "OPENAI_API_KEY": "sk-offline-tests", "OPENAI_AGENTS_DISABLE_TRACING": "1"})
    env.pop("PYTEST_ADDOPTS", None)
    # (langsmith's pytest plug-in, installed with LangGraph, plays no part in their tests: ~1.5 s of import left out)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-rfE",
            "--timeout=120", *FILES]
    for nodeid in deselect:
        args += ["--deselect", nodeid]
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|deselected|skipped|errors?|xfailed|xpassed)",
                                                     proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")}
    return proc, counts, len(list(scratch.rglob("events.jsonl")))


def test_their_session_tests_pass_against_our_session(tmp_path: Path) -> None:
    proc, counts, logs = run_suite(tmp_path, "ours", DESELECTED)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    # Every deselected id named a real test (pytest ignores an unknown --deselect), and nothing else was left out.
    assert counts.get("deselected") == len(DESELECTED), report
    assert set(counts) == {"passed", "deselected"}, report
    assert counts["passed"] >= 100, report
    assert logs >= 10, "their sessions did not go to our store"


@pytest.mark.slow
def test_the_harness_changes_nothing_for_the_stock_sqlite_session(tmp_path: Path) -> None:
    """The same copy against the stock SQLiteSession: all pass, the tests deselected for ours included."""
    proc, counts, logs = run_suite(tmp_path, "sqlite", {})
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert set(counts) == {"passed"}, report
    assert counts["passed"] >= 100 + len(DESELECTED), report
    assert logs == 0


def test_every_archived_file_is_run_or_said_why_not(tmp_path: Path) -> None:
    with tarfile.open(peer_suites() / ARCHIVE) as tar:
        names = {n.removeprefix("openai-agents-python/") for n in tar.getnames()}
    tests = {n for n in names if re.fullmatch(r"tests/memory/test_\w+\.py", n)}
    assert tests == set(FILES) | set(NOT_RUN)
