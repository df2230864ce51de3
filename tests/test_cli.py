"""The command line, through real subprocesses: ls, show, stats, tail (-f), export, import, fork; human and
--json output, exit codes (0 ok, 1 problem, 2 usage), one-line errors, colour only on a terminal."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, import_
from context_persistent.cli import build_parser
from context_persistent.model.views import conversation_view

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TRANSCRIPT = FIXTURES / "amplifier-cli" / "transcript.jsonl"
REFERENCE = FIXTURES / "reference" / "context-messages.jsonl"
COMMANDS = ("ls", "show", "stats", "tail", "export", "import", "fork")


def cli(env: dict[str, str], *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "context_persistent", *args], env=env, capture_output=True,
                          text=True, timeout=60, **kw)


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


@pytest.fixture
def env(subprocess_env: dict[str, str], storage: Path) -> dict[str, str]:
    return {**subprocess_env, "CONTEXT_PERSISTENT_DIR": str(storage), "NO_COLOR": ""}


@pytest.fixture
async def sessions(storage: Path) -> Path:
    await import_(REFERENCE, session_id="ref", storage_path=storage)
    await import_(TRANSCRIPT, session_id="cli", storage_path=storage)
    return storage


def test_every_command_has_help_with_examples() -> None:
    """--help of the program and of each command lists examples."""
    parser = build_parser()
    assert "examples:" in parser.format_help()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in COMMANDS:
        assert "examples:" in sub.choices[name].format_help(), name  # type: ignore[attr-defined]


def test_help_through_the_console_entry(env: dict[str, str]) -> None:
    """`context-persistent show --help` exits 0 and prints the examples."""
    p = cli(env, "show", "--help")
    assert p.returncode == 0 and "examples:" in p.stdout and "--at SEQ" in p.stdout


def test_ls_empty_then_with_sessions_table_and_json(env: dict[str, str], storage: Path, sessions: Path) -> None:
    """ls lists sessions (from $CONTEXT_PERSISTENT_DIR) with messages, events, size and last activity."""
    (storage / "nothing").mkdir()
    p = cli({**env, "CONTEXT_PERSISTENT_DIR": str(storage / "nothing")}, "ls")
    assert p.returncode == 0 and "no sessions" in p.stdout
    p = cli(env, "ls")
    assert p.returncode == 0, p.stderr
    where, header, *rows = p.stdout.strip().splitlines()
    assert where == f"storage {storage} (from $CONTEXT_PERSISTENT_DIR)"
    assert header.split()[:3] == ["SESSION", "MESSAGES", "EVENTS"]
    assert [r.split()[:3] for r in rows] == [["cli", "13", "14"], ["ref", "15", "16"]]
    data = json.loads(cli(env, "ls", "--json").stdout)
    assert {s["session_id"]: s["messages"] for s in data["sessions"]} == {"cli": 13, "ref": 15}
    assert all(s["bytes"] > 0 and s["last_activity"] for s in data["sessions"])


def test_ls_reports_an_unreadable_session_and_exits_1(env: dict[str, str], sessions: Path) -> None:
    """A corrupt session shows as an error row (others still listed) and the exit code is 1."""
    log = sessions / "cli" / "events.jsonl"
    data = log.read_bytes()
    log.write_bytes(data.replace(b"Receipt", b"Receipx", 1))
    p = cli(env, "ls")
    assert p.returncode == 1
    assert "error:" in p.stdout and "line" in p.stdout and "ref" in p.stdout


async def test_show_views_time_travel_and_budget(env: dict[str, str], sessions: Path) -> None:
    """show prints roles and text; --json carries the view's messages; --at and --budget select past/request."""
    p = cli(env, "show", "ref")
    assert p.returncode == 0 and "system" in p.stdout and "« Zoë Ångström »" in p.stdout
    assert "\x1b[" not in p.stdout  # not a terminal: no colour
    async with await PersistentContextManager.open(storage_path=sessions, session_id="ref", readonly=True) as s:
        full = await s.get_messages()
    conv = json.loads(cli(env, "show", "ref", "--view", "conversation", "--json").stdout)
    assert conv["messages"] == conversation_view(full) and conv["view"] == "conversation"
    past = json.loads(cli(env, "show", "ref", "--at", "4", "--json").stdout)
    assert past["messages"] == full[:3] and past["seq"] == 4 and past["head_seq"] == 16
    req = json.loads(cli(env, "show", "ref", "--budget", "100000", "--json").stdout)
    assert req["view"] == "request" and req["token_budget"] == 100000 and req["messages"]


def test_show_errors_exit_codes_and_debug(env: dict[str, str], sessions: Path) -> None:
    """Unknown session → 1; bad --at / --budget combination / bad seq → 2; one line unless --debug."""
    p = cli(env, "show", "nope")
    assert p.returncode == 1 and "not found" in one_line_error(p)
    p = cli(env, "show", "ref", "--at", "999")
    assert p.returncode == 2 and "beyond the last event" in one_line_error(p)
    p = cli(env, "show", "ref", "--view", "full", "--budget", "10")
    assert p.returncode == 2 and "--budget applies to --view request" in one_line_error(p)
    p = cli(env, "show", "ref", "--at", "zero")
    assert p.returncode == 2 and "expected an event seq" in p.stderr
    p = cli(env, "show", "nope", "--debug")
    assert p.returncode == 1 and "Traceback" in p.stderr and "SessionNotFoundError" in p.stderr


def test_stats_json_and_human(env: dict[str, str], sessions: Path) -> None:
    """stats reports events, bytes, tokens per view, tokenizer, provenance and the last compaction (none)."""
    data = json.loads(cli(env, "stats", "ref", "--json", "--tokens").stdout)
    assert data["head_seq"] == 16 and data["events"] == {"session_started": 1, "message_added": 15}
    assert set(data["tokens_per_view"]) == {"full", "conversation", "reasoning", "request"}
    assert data["tokens_per_view"]["conversation"] < data["tokens_per_view"]["full"]
    assert data["tokenizer"] and data["last_compaction"] is None and data["imported"]["source"] == "reference"
    p = cli(env, "stats", "ref", "--tokens")
    assert p.returncode == 0 and "tokens: conversation" in p.stdout and "last compaction" in p.stdout
    # Without --tokens only the full history's total (kept with the counts) and the request view's are counted.
    plain = json.loads(cli(env, "stats", "ref", "--json").stdout)
    assert plain["tokens_per_view"] == {k: data["tokens_per_view"][k] for k in ("full", "request")}
    p = cli(env, "stats", "ref")
    assert p.returncode == 0 and "tokens: conversation" not in p.stdout and "--tokens counts" in p.stdout


def test_tail_last_events_and_after(env: dict[str, str], sessions: Path) -> None:
    """tail prints the last N events (default 10); --after SEQ --json prints every later record as JSON lines."""
    p = cli(env, "tail", "ref", "-n", "3")
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and [ln.split()[0] for ln in lines] == ["14", "15", "16"]
    p = cli(env, "tail", "ref", "--after", "10", "--json")
    assert [json.loads(ln)["seq"] for ln in p.stdout.splitlines()] == [11, 12, 13, 14, 15, 16]


async def test_tail_follow_in_a_subprocess_sees_every_new_event(env: dict[str, str], storage: Path) -> None:
    """tail -f in another process prints each event appended by this one exactly once, then stops at --until-seq."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="live") as store:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "context_persistent", "tail", "live", "-f", "--after", "0", "--until-seq", "201",
            "--json", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(200):
            await store.add_message({"role": "user", "content": f"n{i}"})
            if i % 50 == 0:
                await asyncio.sleep(0.05)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.decode().splitlines()]
    assert [r["seq"] for r in records] == list(range(1, 202))
    assert [r["data"]["message"]["content"] for r in records[1:]] == [f"n{i}" for i in range(200)]


def test_tail_follow_waits_for_a_missing_session_and_timeout_ends_it(env: dict[str, str]) -> None:
    """tail -f on a session that does not exist yet waits (says so on stderr); --timeout ends it with 0."""
    p = cli(env, "tail", "later", "-f", "--timeout", "0.5")
    assert p.returncode == 0 and "waiting for session 'later'" in p.stderr and p.stdout == ""
    Path(env["CONTEXT_PERSISTENT_DIR"]).mkdir()
    p = cli(env, "tail", "later")
    assert p.returncode == 1 and "not found" in one_line_error(p)


def test_export_formats_by_extension_and_errors(env: dict[str, str], sessions: Path, tmp_path: Path) -> None:
    """export infers the format from the extension, writes 0600 files, and fails with 1 for a missing folder."""
    for name, marker in (("a.jsonl", '{"context_persistent_snapshot"'), ("a.json", "{\n"),
                         ("a.md", "<!-- context-persistent snapshot")):
        p = cli(env, "export", "ref", str(tmp_path / name))
        assert p.returncode == 0 and "exported 15 messages" in p.stdout, p.stderr
        assert (tmp_path / name).read_text(encoding="utf-8").startswith(marker)
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert "cannot be imported" in cli(env, "export", "ref", str(tmp_path / "b.md")).stdout
    data = json.loads(cli(env, "export", "ref", str(tmp_path / "c.jsonl"), "--at", "5", "--view", "reasoning",
                          "--json").stdout)
    assert data["header"]["seq_range"] == [1, 5] and data["header"]["view"] == "reasoning"
    p = cli(env, "export", "ref", str(tmp_path / "missing" / "x.jsonl"))
    assert p.returncode == 1 and "does not exist" in one_line_error(p)
    p = cli(env, "export", "ref", str(tmp_path / "x"), "--format", "csv")
    assert p.returncode == 2


async def test_import_round_trip_and_error_paths(env: dict[str, str], sessions: Path, tmp_path: Path) -> None:
    """import makes a new session (exit 0); malformed → 1 naming the line; Markdown → 2; existing id → 1."""
    snap = tmp_path / "ref.jsonl"
    async with await PersistentContextManager.open(storage_path=sessions, session_id="ref", readonly=True) as s:
        await s.export(snap)
        await s.export(tmp_path / "ref.md", format="markdown")
        original = await s.get_messages()
    p = cli(env, "import", str(snap), "copy", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["messages"] == 15
    async with await PersistentContextManager.open(storage_path=sessions, session_id="copy", readonly=True) as s:
        assert await s.get_messages() == original
    p = cli(env, "import", str(FIXTURES / "malformed" / "transcript-bad-json.jsonl"), "bad")
    assert p.returncode == 1 and "line 5" in one_line_error(p)
    assert not (sessions / "bad").exists()
    p = cli(env, "import", str(tmp_path / "ref.md"), "md")
    assert p.returncode == 2 and "one-way" in one_line_error(p)
    p = cli(env, "import", str(TRANSCRIPT), "ref")
    assert p.returncode == 1 and "already exists" in one_line_error(p)
    p = cli(env, "import", str(TRANSCRIPT), "withsys", "--system", "Be kind.")
    assert p.returncode == 0 and "imported 14 messages (transcript)" in p.stdout


def test_fork_and_its_errors(env: dict[str, str], sessions: Path) -> None:
    """fork branches at a seq (exit 0) and refuses an existing target (exit 1) or a seq past the head (2)."""
    p = cli(env, "fork", "ref", "branch", "--at", "6")
    assert p.returncode == 0 and "forked ref at seq 6 into new session branch: 5 messages" in p.stdout
    data = json.loads(cli(env, "stats", "branch", "--json").stdout)
    assert data["parent"] == {"session_id": "ref", "seq": 6} and data["messages"] == 5
    p = cli(env, "fork", "ref", "branch")
    assert p.returncode == 1 and "already exists" in one_line_error(p)
    p = cli(env, "fork", "ref", "far", "--at", "500")
    assert p.returncode == 2 and "beyond the last event" in one_line_error(p)


async def test_reading_commands_work_while_an_agent_holds_the_lock(env: dict[str, str], storage: Path) -> None:
    """show, stats and fork open read-only: they work while a writer holds the session."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="busy") as store:
        await store.add_message({"role": "user", "content": "hello while locked"})
        for args in (["show", "busy"], ["stats", "busy"], ["fork", "busy", "busy2"]):
            p = await asyncio.to_thread(cli, env, *args)
            assert p.returncode == 0, (args, p.stderr)


def test_roles_are_coloured_on_a_terminal_unless_no_color(env: dict[str, str], sessions: Path) -> None:
    """On a terminal show colours roles; with NO_COLOR set it does not."""
    outputs = []
    for no_color in ("", "1"):
        master, slave = pty.openpty()
        try:
            p = subprocess.run([sys.executable, "-m", "context_persistent", "show", "ref"], stdout=slave,
                               stderr=subprocess.PIPE, env={**env, "NO_COLOR": no_color}, timeout=60)
            os.close(slave)
            chunks = []
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(master)
        assert p.returncode == 0
        outputs.append(b"".join(chunks).decode())
    assert "\x1b[32muser" in outputs[0] and "\x1b[" not in outputs[1]


class _Tty:
    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.text = ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_progress_bar_only_on_a_terminal_and_only_for_long_work() -> None:
    """The progress bar draws on a terminal once its delay has passed, clears itself, and is silent otherwise."""
    from context_persistent.cli.transfer import Progress

    tty, pipe, quick = _Tty(True), _Tty(False), _Tty(True)
    for stream, delay in ((tty, 0.0), (pipe, 0.0), (quick, 60.0)):
        bar = Progress("importing x", stream=stream, delay=delay)  # type: ignore[arg-type]
        bar(512, 1024)
        bar(1024, 1024)
        bar.close()
    assert "importing x [###############" in tty.text and "100%" in tty.text and tty.text.endswith("\r")
    assert pipe.text == "" and quick.text == ""


async def test_verify_and_repair_report_progress(tmp_path: Path) -> None:
    """verify/repair call their progress callback with growing byte offsets (the CLI draws the bar from it)."""
    from context_persistent import PersistentContextManager
    from context_persistent.operations.repair import repair, verify

    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="big", fsync="never") as s:
        for i in range(9000):
            await s.add_message({"role": "user", "content": f"m{i}"})
    size = (tmp_path / "big" / "events.jsonl").stat().st_size
    for run in (verify, repair):
        calls: list[tuple[int, int]] = []
        run(tmp_path / "big", "big", progress=lambda done, total: calls.append((done, total)))
        assert len(calls) >= 2 and all(total == size for _, total in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls) and 0 < calls[-1][0] < size
