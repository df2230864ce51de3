"""The demo (`make demo`) runs end to end: kill, resume, ignored transcript, views, what is on disk and the
next commands, with nothing on stderr. It leaves no temporary folder behind, refuses to mix two runs in one
--storage (--fresh replaces the earlier session), uses one tool-call form, and its help says where it writes.
`make demo` installs the package alone into its own venv."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
ROOT = Path(__file__).resolve().parent.parent


def demo(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "context_persistent", "demo", *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=cwd)


async def history(storage: Path) -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id="demo-session",
                                                   readonly=True) as s:
        return await s.get_messages()


async def test_demo_kills_resumes_and_ends_with_what_to_try_next(tmp_path: Path, subprocess_env: dict) -> None:
    storage = tmp_path / "demo"
    out = demo(subprocess_env, "--storage", str(storage))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no warnings
    text = out.stdout
    assert "exit -9" in text and "none lost" in text
    assert "set_messages: ignored" in text and "and its system prompt" in text
    for title in ("conversation view", "reasoning view", "request view"):
        assert f"-- {title}" in text
    log = storage / "demo-session" / "events.jsonl"
    assert f"the log:      {log}" in text
    tail = text.rstrip().splitlines()[-6:]
    assert tail[0] == "next: explore the session"
    assert all(line.startswith("  ") and "demo-session" in line and f"--storage {storage}" in line
               for line in tail[1:])
    assert not any(line.lstrip().startswith(("{", "stats: {")) for line in text.splitlines())  # no raw JSON
    msgs = await history(storage)
    assert msgs[0]["role"] == "system" and len(msgs) == 11
    # one tool-call form (OpenAI): tool_calls on assistant messages, results as role "tool"; no content blocks
    assert all(not isinstance(m.get("content"), list) for m in msgs)
    calls = [c["id"] for m in msgs for c in m.get("tool_calls") or ()]
    results = [m["tool_call_id"] for m in msgs if m["role"] == "tool"]
    assert calls == results == ["call_1", "call_2", "call_3"]
    records = [json.loads(line) for line in log.read_text().splitlines()]  # plain JSONL
    assert sum(r["type"] == "session_started" for r in records) == 1


async def test_a_second_run_in_the_same_storage_is_refused_unless_fresh(tmp_path: Path,
                                                                        subprocess_env: dict) -> None:
    storage = tmp_path / "demo"
    assert demo(subprocess_env, "--storage", str(storage)).returncode == 0
    log = storage / "demo-session" / "events.jsonl"
    before = log.read_bytes()
    again = demo(subprocess_env, "--storage", str(storage))
    assert again.returncode == 2 and again.stdout == ""
    assert "already holds the demo session of an earlier run" in again.stderr and "--fresh" in again.stderr
    assert log.read_bytes() == before  # untouched
    fresh = demo(subprocess_env, "--storage", str(storage), "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stderr == ""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(r["type"] == "session_started" for r in records) == 1  # one run's session, not two mixed
    assert len(await history(storage)) == 11


def test_without_storage_the_demo_leaves_nothing_behind(tmp_path: Path, subprocess_env: dict) -> None:
    tmpdir, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmpdir.mkdir()
    cwd.mkdir()
    env = {**subprocess_env, "TMPDIR": str(tmpdir)}
    out = demo(env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert re.search(rf"storage: {re.escape(str(tmpdir))}/context-persistent-demo-\S+ \(a temporary folder, "
                     r"deleted at the end\)", out.stdout)
    assert "the temporary folder was deleted." in out.stdout
    assert "next: keep the session to explore it" in out.stdout and "demo --storage ./demo-store" in out.stdout
    assert list(tmpdir.iterdir()) == [] and list(cwd.iterdir()) == []
    assert not Path(subprocess_env["HOME"]).exists() or list(Path(subprocess_env["HOME"]).iterdir()) == []


def test_demo_help_says_where_it_writes(subprocess_env: dict) -> None:
    out = demo(subprocess_env, "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "without --storage, into a new temporary folder that is deleted when the demo ends" in text
    assert "with --storage PATH, the session \"demo-session\" and its snapshot are written into PATH" in text
    assert "--fresh" in text and "never uses $CONTEXT_PERSISTENT_DIR" in text


def test_make_demo_installs_the_package_alone_in_its_own_venv() -> None:
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^demo: (.*)$", makefile, re.M)
    assert rule is not None and "STAMP" not in rule.group(1).replace("DEMO_VENV", "")
    install = [line for line in makefile.splitlines() if "$(DEMO_VENV)/bin/python -m pip install" in line]
    assert len(install) == 1
    assert re.search(r"pip install .*--quiet.* \. ", install[0]) and "[" not in install[0]  # no extras
    assert "install.log" in install[0]  # pip's chatter goes to a log, shown only on failure
