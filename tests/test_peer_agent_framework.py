"""Agent Framework's own history-provider tests, run against our PersistentHistoryProvider.

The archive in ../shared/peer-suites/ (its README names the commit) holds Agent Framework's test_sessions.py,
test_compaction.py and conftest.py. They are unpacked into the pytest tmp dir and run in a subprocess,
unchanged but for one thing: a fixture appended to the copy of their conftest.py makes the names
``InMemoryHistoryProvider`` and ``FileHistoryProvider`` of the test module construct our provider. Tests that do
not exercise a history store are deselected by name, each group with its reason (DESELECTED); the ones that do
(APPLICABLE) must all pass, and every collected test must be in one list or the other.

Version: the archive's test_sessions.py imports ``_RunPersistenceGate`` and friends from
``agent_framework._sessions``, which first shipped in agent-framework-core 1.14.0 (1.13.0 cannot import the
module), so the test extra pins 1.14.0; with it all 224 of the archive's tests pass against Agent Framework's own
classes.

No peer suites (``../shared/peer-suites`` beside the repo, or ``$CONTEXT_PERSISTENT_PEER_SUITES``): skipped with
the reason, or failed when ``CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1`` (CI sets it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = "agent-framework-core-tests-5eb3eb7.tar.gz"
TESTS_IN_ARCHIVE = "agent-framework/python/packages/core/tests/core"

#: Tests that construct a history store (through the swapped names) and check what a store must do.
APPLICABLE = {
    "test_sessions.py::TestInMemoryHistoryProvider::test_empty_state_returns_no_messages",
    "test_sessions.py::TestInMemoryHistoryProvider::test_stores_and_loads_messages",
    "test_sessions.py::TestInMemoryHistoryProvider::test_source_id_attribution",
    "test_sessions.py::TestFileHistoryProvider::test_preserves_non_finite_json_values[nan]",
    "test_sessions.py::TestFileHistoryProvider::test_preserves_non_finite_json_values[inf]",
    "test_sessions.py::TestFileHistoryProvider::test_preserves_non_finite_json_values[-inf]",
    "test_sessions.py::TestFileHistoryProvider::test_creates_storage_directory",
    "test_sessions.py::TestFileHistoryProvider::test_missing_session_file_returns_empty_messages",
    "test_sessions.py::TestFileHistoryProvider::test_skip_excluded_omits_excluded_messages",
}

_F = "test_sessions.py::TestFileHistoryProvider::"
_C = "test_compaction.py::"
#: (node id prefixes, why they cannot apply to a store). Every prefix must match at least one collected test.
DESELECTED: list[tuple[list[str], str]] = [
    (["test_sessions.py::TestSessionContext", "test_sessions.py::TestContextProvider",
      "test_sessions.py::test_filter_approval_controls", "test_sessions.py::TestAgentSession",
      "test_sessions.py::TestStateTypeRegistry", "test_sessions.py::TestRunPersistenceGate"],
     "Agent Framework's per-run context, provider base, approval filter, AgentSession serialisation, state-type "
     "registry and run-persistence gate: no history store is constructed"),
    (["test_sessions.py::TestHistoryProviderBase"],
     "the HistoryProvider base class, through a test double defined in the file (ConcreteHistoryProvider); our "
     "provider inherits that base's before_run and after_run (after_run only adds the optional compaction)"),
    (["test_sessions.py::TestSessionStore", "test_sessions.py::TestFileSessionStore"],
     "SessionStore / FileSessionStore persist AgentSession objects (session state), not chat history"),
    (["test_sessions.py::TestInMemoryHistoryProvider::test_state_is_serializable"],
     "asserts the messages live in session.state (the in-memory provider's design); ours keeps them in the log "
     "and leaves session.state alone"),
    ([_F + "test_is_marked_experimental"], "checks Agent Framework's experimental-feature marker on its class"),
    ([_F + "test_uses_msgspec_json_by_default", _F + "test_custom_json_codecs_are_deprecated",
      _F + "test_allows_custom_serializers_returning_bytes", _F + "test_serializer_must_return_single_line_json",
      _F + "test_msgpack_rejects_custom_json_codecs"],
     "its file codec options (msgspec dumps/loads, custom serializers, msgpack); the store has its own format"),
    ([_F + "test_stores_and_loads_length_prefixed_msgpack", _F + "test_truncated_msgpack_record_raises",
      _F + "test_reads_existing_stdlib_non_finite_json", _F + "test_invalid_jsonl_line_raises",
      _F + "test_non_mapping_jsonl_line_raises", _F + "test_stores_and_loads_messages"],
     "read or write its JSONL/msgpack file directly through _session_file_path (its file layout); store-and-load "
     "itself runs against ours in TestInMemoryHistoryProvider::test_stores_and_loads_messages"),
    ([_F + "test_uses_encoded_filename_for_unsafe_session_id", _F + "test_none_session_id_uses_default_jsonl_file"],
     "assert its file names (_session_file_path); our session-id mapping (unsafe ids, None) is tested in "
     "tests/test_integration_agent_framework.py"),
    ([_F + "test_concurrent_writes_for_same_session_are_locked"],
     "instruments Path.open on its JSONL file; the store does not write through Path.open (one writer per "
     "session is its lock; concurrent saves are tested in tests/test_integration_agent_framework.py)"),
    ([_C + "test_group_annotations", _C + "test_sliding_window", _C + "test_annotate_message_groups",
      _C + "test_extend_compaction_messages", _C + "test_append_compaction_message", _C + "test_incremental",
      _C + "test_ensure_message_ids", _C + "test_truncation_strategy", _C + "test_selective_tool_call_strategy",
      _C + "test_summarization_strategy", _C + "test_summary_input_selection", _C + "test_token_budget_composed",
      _C + "test_apply_compaction", _C + "test_tool_result_compaction", _C + "test_context_window_strategy",
      _C + "test_serialize_message"],
     "compaction strategies and annotations on in-memory message lists: no store is involved (our "
     "compact_storage runs these same strategies on stored history: tests/test_integration_agent_framework.py)"),
    ([_C + "test_compaction_provider"],
     "CompactionProvider on a mock SessionContext and a mock session's state dict, not on a history provider"),
    ([_C + "test_in_memory_history_provider_skip_excluded", _C + "test_in_memory_history_provider_default_loads_all"],
     "seed the in-memory provider's messages through the state argument; a store's messages come from its log "
     "(skip_excluded runs against ours in TestFileHistoryProvider::test_skip_excluded_omits_excluded_messages)"),
]

#: Appended to the copy of their conftest.py: the only change. The module-level names the tests construct
#: providers with are pointed at factories that build ours (storage in the test's own tmp dir).
FACTORY = '''

# --- context-persistent: construct our history store where the tests construct Agent Framework's ---
import pytest as _cp_pytest
from context_persistent.integrations.agent_framework import PersistentHistoryProvider as _CPProvider


@_cp_pytest.fixture(autouse=True)
async def _context_persistent_store(request, monkeypatch, tmp_path_factory):
    made = []

    def in_memory(source_id=None, **options):
        made.append(_CPProvider(tmp_path_factory.mktemp("store"), source_id=source_id or "in_memory", **options))
        return made[-1]

    def file_backed(storage_path, *, source_id="file_history", **options):
        made.append(_CPProvider(storage_path, source_id=source_id, **options))
        return made[-1]

    for name, factory in (("InMemoryHistoryProvider", in_memory), ("FileHistoryProvider", file_backed)):
        if hasattr(request.module, name):
            monkeypatch.setattr(request.module, name, factory)
    yield
    for provider in made:
        await provider.aclose()
'''


def peer_suites_dir() -> Path | None:
    env = os.environ.get("CONTEXT_PERSISTENT_PEER_SUITES")
    path = Path(env) if env else ROOT.parent / "shared" / "peer-suites"
    return path if (path / ARCHIVE).is_file() else None


def _require_archive() -> Path:
    found = peer_suites_dir()
    if found is None:
        reason = (f"peer suites not found ({ARCHIVE} in ../shared/peer-suites beside the repo, or "
                  "$CONTEXT_PERSISTENT_PEER_SUITES)")
        if os.environ.get("CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES") == "1":
            pytest.fail(f"CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return found / ARCHIVE


def unpack(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    tests = dest / TESTS_IN_ARCHIVE
    with open(tests / "conftest.py", "a", encoding="utf-8") as f:
        f.write(FACTORY)
    (tests / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    return tests


def run_pytest(tests: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOME"] = str(tmp / "home")
    env.pop("PYTEST_ADDOPTS", None)
    # (langsmith's pytest plug-in, installed with LangGraph, plays no part in their tests: ~1.5 s of import left out)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin",
           "-c", str(tests / "pytest.ini"), "--rootdir", str(tests), "--basetemp", str(tmp / "basetemp"),
           "test_sessions.py", "test_compaction.py", *args]
    return subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=240)


def test_agent_framework_history_tests_pass_against_our_store(tmp_path: Path) -> None:
    archive = _require_archive()
    tests = unpack(archive, tmp_path / "peer")

    collected = run_pytest(tests, tmp_path, "--collect-only", "-q")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    ids = {line.strip() for line in collected.stdout.splitlines() if "::" in line}
    prefixes = [p for group, _ in DESELECTED for p in group]
    for prefix in prefixes:
        assert any(i.startswith(prefix) for i in ids), f"deselect prefix {prefix!r} matches no collected test"
    deselected = {i for i in ids if any(i.startswith(p) for p in prefixes)}
    assert not deselected & APPLICABLE
    unlisted = ids - deselected - APPLICABLE
    assert not unlisted, f"collected tests in neither APPLICABLE nor DESELECTED: {sorted(unlisted)}"
    assert APPLICABLE <= ids, f"applicable tests not collected: {sorted(APPLICABLE - ids)}"

    report = tmp_path / "report.xml"
    args = [f"--deselect={p}" for p in prefixes]
    result = run_pytest(tests, tmp_path, "-q", "-rA", f"--junitxml={report}", *args)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[0] + ".py"
        cls = case.get("classname", "").split(".")[1:]
        node = "::".join([file, *cls, case.get("name", "")])
        bad = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[node] = bad[0] if bad else "passed"
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert outcomes == {test: "passed" for test in APPLICABLE}, result.stdout[-6000:]
    assert f"{len(deselected)} deselected" in result.stdout


def test_the_factory_really_builds_our_store(tmp_path: Path) -> None:
    """The swap is not a no-op: with our provider's save_messages broken, the applicable tests fail."""
    archive = _require_archive()
    tests = unpack(archive, tmp_path / "peer")
    with open(tests / "conftest.py", "a", encoding="utf-8") as f:
        f.write("\n_CPProvider.save_messages = lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError('broken'))\n")
    result = run_pytest(tests, tmp_path, "-q", "-k", "TestInMemoryHistoryProvider and test_stores_and_loads_messages")
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-3000:]


def test_missing_peer_suites_skip_or_fail_as_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXT_PERSISTENT_PEER_SUITES", str(tmp_path / "nowhere"))
    monkeypatch.delenv("CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES", raising=False)
    with pytest.raises(pytest.skip.Exception, match="peer suites not found"):
        _require_archive()
    monkeypatch.setenv("CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES", "1")
    with pytest.raises(pytest.fail.Exception, match="CONTEXT_PERSISTENT_REQUIRE_PEER_SUITES=1 but peer suites"):
        _require_archive()
