"""Command-line conventions every command follows: the storage folder (default, `where`, a missing folder is
an error naming where the setting came from), global options before the command, `--json` honoured or
refused, one metavar spelling, plain-text help; and the per-command fixes: `show`'s seq column and -n,
`export -`, `stats --json` as `store.stats()` returns it, `verify`/`repair` on a flipped byte and a locked
session, request-view notes on export and import."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, import_
from context_persistent.cli import build_parser
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REFERENCE = FIXTURES / "reference" / "context-messages.jsonl"


def cli(env: dict[str, str], *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "context_persistent", *args], env=env, capture_output=True,
                          text=True, timeout=60, **kw)


@pytest.fixture
def env(subprocess_env: dict[str, str], storage: Path) -> dict[str, str]:
    return {**subprocess_env, "CONTEXT_PERSISTENT_DIR": str(storage), "NO_COLOR": ""}


@pytest.fixture
async def ref(storage: Path) -> Path:
    await import_(REFERENCE, session_id="ref", storage_path=storage)
    return storage


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# -- storage ----------------------------------------------------------------------------------------
def test_default_storage_is_under_home_whatever_the_working_directory(subprocess_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """Without --storage or $CONTEXT_PERSISTENT_DIR the CLI uses ~/.amplifier/context, from any folder."""
    env = {k: v for k, v in subprocess_env.items() if k != "CONTEXT_PERSISTENT_DIR"}
    home = Path(env["HOME"])
    home.mkdir()
    expected = home / ".amplifier" / "context"
    for cwd in (tmp_path, home):
        data = json.loads(cli(env, "where", "--json", cwd=cwd).stdout)
        assert data == {"storage": str(expected), "source": "default", "backend": "file", "exists": False,
                        "sessions": 0}


@pytest.mark.parametrize("command", [["ls"], ["show", "s"], ["stats", "s"], ["tail", "s"], ["export", "s", "-"],
                                     ["fork", "s", "t"], ["verify", "s"], ["repair", "s"]])
def test_a_missing_storage_folder_is_an_error_naming_it_and_its_source(env: dict[str, str], tmp_path: Path,
                                                                        command: list[str]) -> None:
    """Reading commands exit 1 on a storage folder that does not exist, saying which and where it came from."""
    typo = tmp_path / "typo"
    p = cli(env, *command, "--storage", str(typo))
    assert p.returncode == 1 and p.stdout == ""
    assert f"storage folder {typo} (from --storage) does not exist" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = cli({**env, "CONTEXT_PERSISTENT_DIR": str(typo)}, *command)
    assert p.returncode == 1 and f"{typo} (from $CONTEXT_PERSISTENT_DIR)" in p.stderr
    default_env = {k: v for k, v in env.items() if k != "CONTEXT_PERSISTENT_DIR"}
    p = cli(default_env, *command)
    assert p.returncode == 1 and f"{Path(env['HOME']) / '.amplifier' / 'context'} (from default)" in p.stderr
    assert not typo.exists()


def test_where_and_ls_name_the_storage_and_its_source(env: dict[str, str], ref: Path, tmp_path: Path) -> None:
    p = cli(env, "where")
    assert p.returncode == 0 and p.stdout.splitlines()[0] == str(ref)
    assert "from:     $CONTEXT_PERSISTENT_DIR" in p.stdout and "1 session(s)" in p.stdout
    data = json.loads(cli(env, "ls", "--json").stdout)
    assert data["storage"] == str(ref) and data["storage_source"] == "$CONTEXT_PERSISTENT_DIR"
    other = tmp_path / "other"
    other.mkdir()
    p = cli(env, "ls", "--storage", str(other))
    assert p.returncode == 0 and p.stdout.strip() == f"no sessions in {other} (from --storage)"


# -- global options ---------------------------------------------------------------------------------
def test_global_options_before_the_command(env: dict[str, str], ref: Path, tmp_path: Path) -> None:
    """`--storage X ls` is `ls --storage X`; --json and --storage work on either side; after wins."""
    bare = {k: v for k, v in env.items() if k != "CONTEXT_PERSISTENT_DIR"}
    before = cli(bare, "--storage", str(ref), "--json", "ls")
    after = cli(bare, "ls", "--storage", str(ref), "--json")
    assert before.returncode == after.returncode == 0, before.stderr
    assert json.loads(before.stdout) == json.loads(after.stdout)
    assert [s["session_id"] for s in json.loads(before.stdout)["sessions"]] == ["ref"]
    p = cli(bare, "--storage", str(tmp_path / "typo"), "show", "ref", "--storage", str(ref))
    assert p.returncode == 0, p.stderr


def test_pg_schema_is_a_common_option_and_needs_dsn(env: dict[str, str], ref: Path) -> None:
    parser = build_parser()
    for name, sub in _subparsers(parser).items():
        if name in ("db", "demo"):
            continue
        assert "--pg-schema" in sub.format_help() and "--dsn" in sub.format_help(), name
    p = cli(env, "ls", "--pg-schema", "team_a")
    assert p.returncode == 2 and "--pg-schema applies with --dsn only" in p.stderr


# -- --json -----------------------------------------------------------------------------------------
def test_every_command_honours_or_refuses_json(env: dict[str, str], ref: Path, tmp_path: Path) -> None:
    """Each command either prints JSON with --json or refuses it (exit 2); none ignores it."""
    runs = {
        "ls": ["ls"], "where": ["where"], "show": ["show", "ref"], "stats": ["stats", "ref"],
        "tail": ["tail", "ref", "-n", "2"], "export": ["export", "ref", str(tmp_path / "e.jsonl")],
        "import": ["import", str(REFERENCE), "imp"], "fork": ["fork", "ref", "forked"],
        "verify": ["verify", "ref"], "repair": ["repair", "ref"],
        "search": ["search", "checkout"], "index": ["index", "status"],
        "retention": ["retention", "plan", "--max-sessions", "5"], "trash": ["trash", "list"],
        "usage": ["usage"],
        "erase": ["erase", "ref", "--seq", "2"],  # (it changes the session)
        "migrate": ["migrate", "ref", "--segment-bytes", "4096"],  # (last: it changes the layout)
    }
    refused = {"demo": ["demo"], "serve": ["serve", "--no-browser"]}
    assert set(runs) | set(refused) | {"db"} == set(_subparsers(build_parser()))  # db: test_postgres.py
    for name, argv in runs.items():
        p = cli(env, *argv, "--json")
        assert p.returncode == 0, (name, p.stderr)
        text = p.stdout.strip()
        for line in (text.splitlines() if name == "tail" else [text]):
            json.loads(line)
    for name, argv in refused.items():
        p = cli(env, *argv, "--json")
        assert p.returncode == 2 and f"--json is not supported by {name}" in p.stderr and p.stdout == ""


# -- help -------------------------------------------------------------------------------------------
def test_help_is_plain_text_and_session_is_spelt_SESSION() -> None:
    parser = build_parser()
    helps = {"": parser.format_help()}
    for name, sub in _subparsers(parser).items():
        helps[name] = sub.format_help()
        for inner in (_subparsers(sub).items() if name in ("db", "retention", "trash") else ()):
            helps[f"{name} {inner[0]}"] = inner[1].format_help()
    for name, text in helps.items():
        assert "``" not in text and ":func:" not in text and ":class:" not in text, name
        usage = text.split("\n\n", 1)[0]
        assert " session" not in usage.replace("context-persistent", ""), (name, usage)
    assert "SESSION" in helps["verify"] and "SESSION" in helps["repair"]


# -- show -------------------------------------------------------------------------------------------
async def test_show_has_a_seq_column_and_last_n(env: dict[str, str], ref: Path) -> None:
    """Each message line carries the seq of the event that added it (what --at takes); -n N shows the last N."""
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref") as store:
        await store.set_messages([{"role": "user", "content": "ignored: the store loaded its log"}])
        await store.add_message({"role": "user", "content": "last one"})
    p = cli(env, "tail", "ref", "-n", "100", "--json")
    added = [json.loads(line)["seq"] for line in p.stdout.splitlines()
             if json.loads(line)["type"] == "message_added"]
    p = cli(env, "show", "ref")
    assert p.returncode == 0
    lines = [line for line in p.stdout.splitlines()[2:] if line[:5].strip().isdigit()]
    assert [int(line.split()[1]) for line in lines] == added
    p = cli(env, "show", "ref", "-n", "2")
    head, columns, *rows = p.stdout.splitlines()
    assert "the last 2" in head and columns.split() == ["#", "SEQ", "ROLE", "MESSAGE"]
    assert [r.split()[:3] for r in rows if r[:5].strip()] == [["14", str(added[-2]), "assistant"],
                                                              ["15", str(added[-1]), "user"]]
    data = json.loads(cli(env, "show", "ref", "--last", "3", "--json").stdout)
    assert data["message_seqs"] == added[-3:] and len(data["messages"]) == 3 and data["first_index"] == 13
    assert data["total_messages"] == 16
    assert cli(env, "show", "ref", "-n", "-1").returncode == 2


async def test_show_seqs_of_set_messages_and_the_request_view(env: dict[str, str], storage: Path) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="s") as store:
        await store.set_messages([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
        for i in range(6):
            await store.add_message({"role": "user", "content": f"question {i} " + "word " * 200})
            await store.add_message({"role": "assistant", "content": f"answer {i}"})
    data = json.loads(cli(env, "show", "s", "--json").stdout)
    assert data["message_seqs"][:3] == [2, 2, 3]  # one replacement event holds two messages
    data = json.loads(cli(env, "show", "s", "--budget", "400", "--json").stdout)
    seqs, msgs = data["message_seqs"], data["messages"]
    notes = [i for i, m in enumerate(msgs) if str(m["content"]).startswith("[context-persistent: ")]
    assert notes and all(seqs[i] is None for i in notes)
    assert seqs[-1] == 14 and msgs[-1]["content"] == "answer 5"


# -- export -----------------------------------------------------------------------------------------
def test_export_dash_writes_the_snapshot_to_stdout(env: dict[str, str], ref: Path, tmp_path: Path) -> None:
    p = cli(env, "export", "ref", "-")
    assert p.returncode == 0 and "to stdout" in p.stderr
    cli(env, "export", "ref", str(tmp_path / "f.jsonl"))
    file_lines = (tmp_path / "f.jsonl").read_text(encoding="utf-8").splitlines()
    out_lines = p.stdout.splitlines()
    assert out_lines[1:] == file_lines[1:] and len(out_lines) == 16
    assert json.loads(out_lines[0])["body_sha256"] == json.loads(file_lines[0])["body_sha256"]
    p = cli(env, "export", "ref", "-", "--format", "json")
    assert json.loads(p.stdout)["header"]["format"] == "json"
    p = cli(env, "export", "ref", "-", "--json")
    assert p.returncode == 2 and "cannot be combined" in p.stderr


async def test_library_export_takes_the_format_from_the_suffix(ref: Path, tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref", readonly=True) as store:
        assert (await store.export(tmp_path / "x.json"))["format"] == "json"
        assert (tmp_path / "x.json").read_text(encoding="utf-8").startswith("{\n")
        assert (await store.export(tmp_path / "x.md"))["format"] == "markdown"
        assert (await store.export(tmp_path / "x.txt"))["format"] == "jsonl"
        assert (await store.export(tmp_path / "y.json", format="jsonl"))["format"] == "jsonl"
        assert (tmp_path / "y.json").read_text(encoding="utf-8").startswith('{"context_persistent_snapshot"')


# -- stats ------------------------------------------------------------------------------------------
async def test_stats_json_is_what_store_stats_returns(env: dict[str, str], ref: Path) -> None:
    """Every key of store.stats() in the same shape; last_compaction is the request view's, not a record."""
    p = cli(env, "stats", "ref", "--budget", "300", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref", readonly=True) as store:
        await store.get_messages_for_request(token_budget=300)
        expected = json.loads(json.dumps(store.stats()))
    for key, value in expected.items():
        if key == "last_compaction":
            assert set(out[key]) == set(value)
            assert {k: v for k, v in out[key].items() if k != "ts"} == {k: v for k, v in value.items() if k != "ts"}
        else:
            assert out[key] == value, key
    assert out["recorded_compaction"] is None  # opened read-only: nothing was recorded


# -- verify / repair --------------------------------------------------------------------------------
def _flip(log: Path, line_no: int, offset: int) -> None:
    data = bytearray(log.read_bytes())
    lines = data.split(b"\n")
    at = sum(len(x) + 1 for x in lines[:line_no - 1]) + offset
    data[at] ^= 0x01
    log.write_bytes(bytes(data))


def test_a_flipped_byte_is_one_problem_and_repair_names_what_leaves(env: dict[str, str], ref: Path) -> None:
    log = ref / "ref" / "events.jsonl"
    _flip(log, 6, 200)  # inside a message's text: the record fails its checksum, its JSON still parses
    p = cli(env, "verify", "ref")
    assert p.returncode == 1
    problems = [line for line in p.stdout.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and "the history loses seq 6" in problems[0], p.stdout
    assert "tool message" in problems[0]
    report = json.loads(cli(env, "verify", "ref", "--json").stdout)
    assert len(report["problems"]) == 1 and report["gaps"] == [
        {"after_seq": 5, "next_seq": 7, "explained": False, "corrupt": True}]
    p = cli(env, "repair", "ref")
    assert p.returncode == 0
    assert "quarantined corrupt record at line 6" in p.stdout and "the history loses seq 6" in p.stdout
    # the bytes are sound now; the lost record was a tool result, so its call is unanswered: one semantic problem
    p = cli(env, "verify", "ref")
    assert p.returncode == 1
    problems = [line for line in p.stdout.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1 and "unanswered tool call" in problems[0], p.stdout
    p = cli(env, "repair", "ref", "--semantic", "--json")
    assert p.returncode == 0
    fixed = json.loads(p.stdout)  # one JSON object for both steps
    assert fixed["changed"] is False and len(fixed["semantic"]["placeholders"]) == 1
    assert cli(env, "verify", "ref").returncode == 0


def test_a_gap_with_no_bad_bytes_is_still_a_problem(env: dict[str, str], ref: Path) -> None:
    log = ref / "ref" / "events.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:5] + lines[6:]))  # a record cut out cleanly
    p = cli(env, "verify", "ref")
    assert p.returncode == 1 and "PROBLEM gap seq 5 -> 7" in p.stdout


async def test_repair_on_a_locked_session_says_what_to_do(env: dict[str, str], ref: Path) -> None:
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref"):
        p = cli(env, "repair", "ref")
    assert p.returncode == 1
    assert "readonly=True" not in p.stderr and "Stop that agent" in p.stderr
    assert "context-persistent verify ref" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# -- request-view notes -----------------------------------------------------------------------------
def test_request_view_export_lists_its_notes_and_import_refuses_them(env: dict[str, str], ref: Path,
                                                                     tmp_path: Path) -> None:
    path = tmp_path / "request.jsonl"
    p = cli(env, "export", "ref", str(path), "--budget", "300")
    assert p.returncode == 0 and "notes written in place of left-out messages" in p.stdout
    header, *body = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert header["notes"] and all(body[i]["content"].startswith("[context-persistent: ") for i in header["notes"])
    p = cli(env, "import", str(path), "copy")
    assert p.returncode == 2 and "is a request view" in p.stderr and "--request-notes" in p.stderr
    assert not (ref / "copy").exists()
    data = json.loads(cli(env, "import", str(path), "dropped", "--request-notes", "drop", "--json").stdout)
    assert data["messages"] == len(body) - len(header["notes"])
    data = json.loads(cli(env, "import", str(path), "kept", "--request-notes", "keep", "--json").stdout)
    assert data["messages"] == len(body)
    md = tmp_path / "request.md"
    assert cli(env, "export", "ref", str(md), "--budget", "300").returncode == 0
    labelled = [line for line in md.read_text(encoding="utf-8").splitlines() if "a note in place of" in line]
    assert labelled == [f"## {i + 1}. user (a note in place of left-out messages, not a message of the session)"
                        for i in header["notes"]]


async def test_a_request_view_without_a_notes_header_is_recognised(ref: Path, tmp_path: Path) -> None:
    """A request-view snapshot written before headers listed the notes: the notes are found by their text."""
    path = tmp_path / "old.jsonl"
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref", readonly=True) as store:
        await store.export(path, view="request", token_budget=300)
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    del header["notes"]
    path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is a request view"):
        await import_(path, session_id="old", storage_path=ref)
    assert not (ref / "old").exists()


async def test_a_full_view_keeps_a_user_message_that_looks_like_a_note(ref: Path, tmp_path: Path) -> None:
    """Only the store's notes are listed: a user's own message with that text is a message of the session."""
    async with await PersistentContextManager.open(storage_path=ref, session_id="ref") as store:
        await store.add_message({"role": "user", "content": "[context-persistent: typed by a user]"})
        await store.export(tmp_path / "req.jsonl", view="request")
    header = json.loads((tmp_path / "req.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert header["notes"] == []
    result = await import_(tmp_path / "req.jsonl", session_id="fine", storage_path=ref)
    assert result["messages"] == 16


# -- PostgreSQL -------------------------------------------------------------------------------------
async def test_stats_and_ls_on_postgres_with_pg_schema(env: dict[str, str], tmp_path: Path,
                                                       pg_config: dict[str, Any], sid: str) -> None:  # noqa: F811
    """--dsn and --pg-schema reach every command; stats gives the bytes of the session's records."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id=sid, **pg_config) as store:
        await store.add_message({"role": "user", "content": "hello"})
    flags = ["--dsn", pg_config["dsn"], "--pg-schema", pg_config["pg_schema"]]
    p = cli(env, *flags, "stats", sid)
    assert p.returncode == 0, p.stderr
    assert "None" not in p.stdout
    data = json.loads(cli(env, "stats", sid, "--json", *flags).stdout)
    assert isinstance(data["bytes"], int) and data["bytes"] > 50
    listed = json.loads(cli(env, "ls", "--json", *flags).stdout)
    assert sid in [s["session_id"] for s in listed["sessions"]]
    assert listed["storage_source"] == "--dsn" and pg_config["pg_schema"] in listed["storage"]
    p = cli(env, "show", sid, *flags, "--json")
    assert json.loads(p.stdout)["messages"][-1]["content"] == "hello"
