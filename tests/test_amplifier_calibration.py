"""The request view fits the provider's own count, measured in the real Amplifier command line.

A scripted provider (tests/amplifier_host/modules/provider-claudelike) counts like a Claude-class model:
``ratio`` x cl100k_base of what it is sent, plus a fixed ``overhead`` (tool schemas, framing) the context
module never sees; it reports that count as ``Usage.input_tokens``, advertises a small context window through
``get_info()`` and rejects a request over it as Anthropic does ("prompt is too long: N tokens > M maximum").
loop-basic emits each response's usage in ``provider:response``; the mount records it and the budget is
calibrated from it. A long session (history several times the window, large tool outputs, several
``amplifier run --resume`` processes) must then never be rejected, and must use the window: the largest
request after the first compaction is at least 60% of it. With ``calibrate: false`` the same session is
rejected (so the first test can fail), and with a ratio below 1 the uncalibrated view wastes the window.

Every session here needs about ten processes of the CLI, each a few seconds: the tests are marked slow (CI
runs them). docs/tokens.md ("Measured in the real host") has the figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from realhost import (Cli, Host, HostUnavailable, build_host, find_archives, host_dir, host_exit_crash, session_id_of,
                      unavailable)

pytestmark = pytest.mark.timeout(600)

#: The provider's window and output reserve, and the store's safety margin: small, so a few turns overflow it.
WINDOW = 8000
MAX_OUTPUT = 200
SAFETY_MARGIN = 200
#: How much of the real window the largest request after the first compaction must fill.
MIN_USE = 0.6
#: Each ``amplifier run`` is one turn of CALLS tool calls with WORDS words of output each (about 560 cl100k
#: tokens: the smart strategy masks old outputs of 500 or more); RUNS turns make a history of about
#: RUNS x CALLS x 560 x ratio tokens, several times the window.
RUNS = 4
CALLS = 9
WORDS = 450


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    try:
        find_archives(host_dir())
    except HostUnavailable as e:  # a skip, or a failure where CI requires the host
        unavailable(str(e))
    return build_host(tmp_path_factory.mktemp("amplifier-host"))


def bundle(cli: Cli, *, ratio: float, overhead: int, context: dict[str, Any]) -> None:
    """A bundle with the Claude-like provider, the bulk tool and this package as context module."""
    provider = json.dumps({"ratio": ratio, "overhead": overhead, "context_window": WINDOW,
                           "max_output_tokens": MAX_OUTPUT})
    context_config = json.dumps({"storage_path": str(cli.storage), "safety_margin": SAFETY_MARGIN, **context})
    mods = cli.host.modules
    cli.bundle.write_text(
        "---\n"
        "bundle:\n  name: cp-calibration\n  version: 0.1.0\n"
        "session:\n"
        "  orchestrator:\n    module: loop-basic\n"
        f"  context:\n    module: context-persistent\n    source: {cli.host.package}\n"
        f"    config: {context_config}\n"
        f"providers:\n  - module: provider-claudelike\n    source: {mods / 'provider-claudelike'}\n"
        f"    config: {provider}\n"
        f"hooks:\n  - module: hooks-session-dir\n    source: {mods / 'hooks-session-dir'}\n"
        f"tools:\n  - module: tool-bulk\n    source: {mods / 'tool-bulk'}\n"
        "---\n"
        "You are the test agent.\n")
    # The CLI's settings name the provider too (as a user's would after `amplifier provider use`).
    (cli.home / ".amplifier" / "settings.yaml").write_text(
        "config:\n  providers:\n"
        f"    - module: provider-claudelike\n      source: {mods / 'provider-claudelike'}\n"
        f"      config: {provider}\n")


def work(turn: int, calls: int = CALLS, words: int = WORDS) -> str:
    return f"work {calls} x {words} #{turn}"


@dataclass
class Session:
    """What the provider saw of one session: its counts, in order, and whether it rejected one."""

    id: str
    requests: list[dict[str, Any]]
    failed_output: str = ""

    @property
    def counts(self) -> list[int]:
        return [r["input_tokens"] for r in self.requests]

    @property
    def rejected(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["rejected"]]

    def first_compaction(self) -> int:
        """The index of the first request smaller than the one before it: history only grows otherwise."""
        return next((i for i in range(1, len(self.counts)) if self.counts[i] < self.counts[i - 1]), -1)

    def compactions(self) -> int:
        return sum(1 for a, b in zip(self.counts, self.counts[1:]) if b < a)

    def largest_after_first_compaction(self) -> int:
        start = self.first_compaction()
        assert start > 0, f"the view was never compacted: counts {self.counts}"
        return max(self.counts[start:])


def provider_log(cli: Cli) -> list[dict[str, Any]]:
    if not cli.requests_path.exists():
        return []
    return [json.loads(line) for line in cli.requests_path.read_text().splitlines()]


def long_session(cli: Cli, *, runs: int = RUNS, stop_on_failure: bool = False) -> Session:
    """``runs`` turns, each its own ``amplifier run`` (the first starts the session, the others resume it).

    A turn the provider rejects fails the run (non-zero exit, the provider's message in the output); with
    ``stop_on_failure`` the session stops there, otherwise that is a test failure."""
    sid = ""
    failed = ""
    for turn in range(runs):
        args = ["run", "-B", cli.bundle_uri, work(turn)] if turn == 0 else ["run", "--resume", sid, work(turn)]
        proc = cli.run(*args, check=not stop_on_failure)
        if turn == 0:
            sid = session_id_of(proc.stdout + proc.stderr)
        if proc.returncode != 0 and not host_exit_crash(proc):  # (a crash at exit: the turn was done)
            failed = proc.stdout + proc.stderr
            break
    s = Session(sid, [r for r in provider_log(cli) if r["session_id"] == sid], failed)
    return s


def describe(session: Session) -> str:
    return (f"counts {session.counts} (window {WINDOW}); first compaction at request "
            f"{session.first_compaction()}; {session.compactions()} compactions")


@pytest.mark.slow
def test_a_claude_counting_provider_never_rejects_a_calibrated_session_and_its_window_is_used(
        host: Host, tmp_path: Path) -> None:
    """Calibrated on the provider's reports, a long session of large tool outputs across four processes is
    never rejected, and after the first compaction its largest request fills at least 60% of the window."""
    cli = Cli(host, tmp_path)
    bundle(cli, ratio=1.4, overhead=300, context={})
    session = long_session(cli)

    assert not session.rejected, describe(session)
    assert len(session.requests) == RUNS * (CALLS + 1)
    # the history is several times the window, so the view was compacted again and again
    assert history_tokens(cli, session.id) * 1.4 >= 3 * WINDOW
    assert session.compactions() >= 3, describe(session)
    assert session.largest_after_first_compaction() >= MIN_USE * WINDOW, describe(session)
    # every report reached the store's log
    usage = usage_records(cli, session.id)
    assert [u["input_tokens"] for u in usage] == session.counts


@pytest.mark.slow
def test_the_same_session_uncalibrated_is_rejected_as_anthropic_rejects_it(host: Host, tmp_path: Path) -> None:
    """With ``calibrate: false`` the view is fitted to cl100k_base alone: the provider counts 1.4x that and
    rejects the request ("prompt is too long"), and the turn fails."""
    cli = Cli(host, tmp_path)
    bundle(cli, ratio=1.4, overhead=300, context={"calibrate": False})
    session = long_session(cli, stop_on_failure=True)

    assert session.rejected, describe(session)
    assert "prompt is too long" in session.failed_output, session.failed_output[-3000:]
    assert f"tokens > {WINDOW} maximum" in session.failed_output


@pytest.mark.slow
@pytest.mark.parametrize("calibrate", [True, False])
def test_a_provider_that_counts_fewer_tokens_gets_its_window_used(host: Host, tmp_path: Path,
                                                                  calibrate: bool) -> None:
    """A provider counting 0.6x cl100k_base: calibrated, the largest request after the first compaction fills
    at least 60% of the window; uncalibrated it fills less (the waste calibration removes)."""
    cli = Cli(host, tmp_path)
    bundle(cli, ratio=0.6, overhead=300, context={} if calibrate else {"calibrate": False})
    session = long_session(cli, runs=RUNS + 2)

    assert not session.rejected, describe(session)
    assert session.compactions() >= 2, describe(session)
    if calibrate:
        assert session.largest_after_first_compaction() >= MIN_USE * WINDOW, describe(session)
    else:
        assert session.largest_after_first_compaction() < MIN_USE * WINDOW, describe(session)


def usage_records(cli: Cli, session_id: str) -> list[dict[str, Any]]:
    return [r["data"] for r in cli.log_records(session_id) if r["type"] == "usage_reported"]


def history_tokens(cli: Cli, session_id: str) -> int:
    """cl100k_base tokens of every message the session's log holds (what an uncompacted view would need)."""
    from context_persistent.model.tokens import TokenCounter

    counter = TokenCounter()
    return sum(counter.count_message(r["data"]["message"]) for r in cli.log_records(session_id)
               if r["type"] == "message_added")


def ledger(cli: Cli, session_id: str) -> Any:
    """``context-persistent usage SESSION --json`` on the test's storage, as a user would read the ledger."""
    import sys

    proc = subprocess.run([sys.executable, "-m", "context_persistent", "usage", session_id, "--json",
                           "--storage", str(cli.storage)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(cli.home)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_usage_ledger_after_sigkill_between_turns_holds_exactly_what_the_provider_reported(
        host: Host, tmp_path: Path) -> None:
    """A CLI process killed at its prompt between two turns, then resumed: the log holds one usage record per
    report the provider made, in order, with its figures, and the ledger's totals are their sums."""
    from test_amplifier_cli import Pty

    cli = Cli(host, tmp_path)
    bundle(cli, ratio=1.4, overhead=300, context={})
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, work(0, 2, 40)).stdout)
    term = Pty(cli, "continue", "--no-history")
    try:
        term.read_until(r"Resuming[\s\S]*\n\s*>")
        term.send(work(1, 1, 40) + "\r")
        term.read_until(r"worked 1[\s\S]*\n\s*>")  # the turn is done and the prompt is back
    finally:
        os.kill(term.pid, signal.SIGKILL)
        status = term.close(timeout=30)
    assert status == -signal.SIGKILL
    cli.run("run", "--resume", sid, work(2, 1, 40))
    cli.run("run", "--resume", sid, "and a plain turn")

    reports = [r for r in provider_log(cli) if r["session_id"] == sid and not r["rejected"]]
    assert len(reports) == 3 + 2 + 2 + 1
    assert len({r["pid"] for r in reports}) == 4
    recorded = usage_records(cli, sid)
    assert [(u["input_tokens"], u["output_tokens"]) for u in recorded] == \
        [(r["input_tokens"], r["output_tokens"]) for r in reports]
    assert {u["provider"] for u in recorded} == {"mimic"}
    assert {u["model"] for u in recorded} == {"mimic-1"}
    totals = ledger(cli, sid)
    text = json.dumps(totals)
    assert str(sum(r["input_tokens"] for r in reports)) in text, text
    assert str(sum(r["output_tokens"] for r in reports)) in text, text
