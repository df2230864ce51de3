"""The benchmark harness runs end to end with tiny sizes and produces every row (no timing assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repo root, outside the installed package
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import compare, percentile  # noqa: E402
from benchmarks.peers import ReferenceReRead  # noqa: E402
from benchmarks.run import plugins  # noqa: E402
from benchmarks.workloads import agent_mix, sized_message, write_reference  # noqa: E402

TINY = ["append_n=5", "batch_total=128", "never_total=20", "replay_small=0", "replay_mid=50", "replay_large=80",
        "replay_4k=10", "replay_rounds=1", "replay_large_rounds=1", "request_small=10", "request_large=20", "request_large_4k=0",
        "request_huge=0", "request_calls=2", "tokens_messages=12", "import_rounds=1", "loop_mb=1", "segments_mb=1",
        "retention_sessions=6", "long_small=40", "long_medium=90", "long_large=0", "long_appends=20",
        "long_rounds=1", "long_peers=90", "long_cli=90", "usage_messages=20", "usage_turns=5",
        "usage_request_messages=30", "usage_request_calls=2", "viewer_messages=400",
        "turns_messages=50", "turns_large=0", "turns_rounds=1", "turns_interactive=3"]  # (the peers and the commands at 90 only: fewer children)

#: Every row name (prefix) each plug-in must produce with the sizes above.
EXPECTED = {
    "append": ["add_message fsync=always 300 B p50", "add_message fsync=always 300 B p99",
               "fsync=always 300 B p50: SQLiteSession.add_items / ours", "fsync=always 300 B p50: sqlite3",
               "add_message fsync=always 4096 B p50", "add_message fsync=always 4096 B p99",
               "add_message fsync=always reserve_tail 300 B p50", "add_message fsync=always reserve_tail 4096 B p99",
               "fsync=always reserve_tail 300 B p50: SQLiteSession.add_items / ours",
               "add_message fsync=batch, 64 producers", "fsync=batch, 64 producers: ours vs SQLiteSession",
               "fsync=batch, 64 producers: ours vs sqlite3", "add_message fsync=never"],
    "replay": ["open+replay 50 x 300 B, no checkpoint", "open 50 x 300 B from a checkpoint",
               "peak RSS after open 80 x 300 B, no checkpoint", "open + first request 80 x 300 B, no checkpoint",
               "open + first request 80 x 300 B from a checkpoint", "open+replay 10 x 4096 B, no checkpoint",
               "resume 80 x 300 B: reference module", "resume 80 x 300 B: sqlite3"],
    "request": ["unchanged 20 x 300 B: reference / ours", "after one new message 20 x 300 B: reference / ours",
                "after one new message: 20 / 10 messages"],
    "tokens": ["token count, 12 agent-mix messages", "token count again", "tokenizer throughput"],
    "import": ["import context_persistent", "tokenizer encodings loaded by the import", "first tokenizer load"],
    "loop": ["longest loop stall while counting one 1 MB message", "time to count it"],
    "retention": ["open + close with apply_on_open, 6 sessions", "apply_on_open overhead per session",
                  "retention apply: per session moved to the trash"],
    "long_session": ["40: first open, replaying the whole log", "40: peak RSS, open (fresh interpreter)", "40: open",
                     "40: first request", "40: compact() at half the budget", "40: 20 appends",
                     "40: periodic checkpoint", "40: stats()", "90: compact() at half the budget, / its 40 cost",
                     "90: peak RSS, context-persistent show --at (halfway)",
                     "90: peak RSS, stats() (fresh interpreter)", "90: open, / its 40 cost",
                     "90: first request, / its 40 cost", "90: 20 appends, / its 40 cost",
                     "90: periodic checkpoint, / its 40 cost", "90: stats(), / its 40 cost",
                     "90: first request: reference module / ours", "90: peak RSS, first request: ours vs SQLiteSession",
                     "90: 20 appends: SQLiteSession / ours", "90: peak RSS, context-persistent verify",
                     "90: peak RSS, context-persistent export to JSON", "90: peak RSS, context-persistent tail"],
    "usage": ["turn on 20 x 300 B, fsync=always: with record_usage / without", "record_usage call, fsync=always",
              "turn on 20 x 300 B, fsync=never: with record_usage / without", "record_usage call, fsync=never",
              "request unchanged 30 x 300 B: calibrated / calibrate=false",
              "request after one new message 30 x 300 B: calibrated / calibrate=false"],
    "amplifier_turns": ["50 x 300 B: resumed turn, inside the module (new store), ours",
                        "50 x 300 B: resumed turn, the same calls of an in-memory list",
                        "50 x 300 B: resumed turn, ours, mount", "50 x 300 B: resumed turn, ours, set_messages",
                        "50 x 300 B: resumed turn, ours, get_messages (3 calls)",
                        "50 x 300 B: resumed turn, ours, get_messages_for_request",
                        "50 x 300 B: resumed turn, ours, provider:response hook",
                        "50 x 300 B: interactive turn (one store), fsync=never, ours",
                        "50 x 300 B: interactive turn (one store), fsync=never, ours, CPU",
                        "50 x 300 B: interactive turn (one store), fsync=always, ours",
                        "50 x 300 B: interactive turn, the same calls of an in-memory list"],
    "viewer": ["open a session: facts + last 200 events, 400 messages", "last page of the full view, 400",
               "timeline page from the middle, 400", "first view page from the middle", "first page of the full view",
               "request view at 8,000 tokens, 400", "time travel to the middle", "time travel to another seq",
               "request view at 8,000 tokens in the past", "peak RSS, every step above, 400 messages"],
    "segments": ["the append that fills a 1 MiB segment and rolls it", "the append that rolls a 1 MiB segment, compress_sealed",
                 "roll (seal) of a 1 MiB active segment opened with data", "compress a sealed 1 MiB segment",
                 "read_line_at, plain sealed segment", "read_line_at, compressed sealed segment",
                 "open a reader on 512 sealed segments"],
}


#: The tiny run in three parts, so that pytest-xdist spreads them over its workers (one run of every plug-in
#: took a worker three minutes): each part is a full run of the harness on its plug-ins.
PARTS = {"long_session": ["long_session", "replay"],
         "writes": ["append", "segments", "import", "loop", "tokens", "request"],
         "hosts": ["usage", "viewer", "retention", "amplifier_turns"]}


def test_the_parts_cover_every_plugin_once() -> None:
    """Every plug-in the tiny run expects is in exactly one part."""
    listed = [name for part in PARTS.values() for name in part]
    assert sorted(listed) == sorted(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PARTS))
def test_tiny_run_produces_every_row_and_the_json(tmp_path: Path, subprocess_env: dict[str, str], part: str) -> None:
    """A tiny run of each part exits 0, prints the table, and writes a JSON file holding every expected row."""
    wanted_plugins = PARTS[part]
    out = tmp_path / "bench.json"
    subprocess_env = {**subprocess_env, "CP_BENCH_SCRATCH": str(tmp_path), "CP_BENCH_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "benchmarks.run", "--quiet", "--rounds", "2", "--json", str(out),
            "--only", ",".join(wanted_plugins)]
    args += [a for size in TINY for a in ("--size", size)]
    proc = subprocess.run(args, cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {k: v["status"] for k, v in result["plugins"].items()} == {f"bench_{k}": "ok" for k in wanted_plugins}
    names = [r["name"] for r in result["rows"]]
    for group in wanted_plugins:
        for prefix in EXPECTED[group]:
            assert any(n.startswith(prefix) for n in names), f"{group}: no row starting {prefix!r} in {names}"
    if "long_session" in wanted_plugins:
        # long_rounds=1, long_peers=90, long_cli=90: one round, and no peer or command row at 40.
        assert [r["rounds"] for r in result["rows"] if r["name"] == "40: open"] == [1]
        assert not [n for n in names if n.startswith("40: ") and (" / ours" in n or " vs " in n
                                                                   or "context-persistent" in n)]
    for row in result["rows"]:
        assert row["ours"] is not None and math.isfinite(row["ours"]), row
        if row["target"] is not None:
            assert row["ok"] in (True, False), row
    assert "targets met" in proc.stdout and "ratio" in proc.stdout
    assert result["machine"]["nproc"] >= 1 and result["sizes"]["append_n"] == 5


def test_plugins_are_discovered_by_name() -> None:
    """Every benchmarks/bench_*.py module is a plug-in, found in name order."""
    found = plugins()
    assert found == sorted(found)
    assert {f"bench_{k}" for k in EXPECTED} <= set(found)


def test_bad_arguments_exit_2(subprocess_env: dict[str, str]) -> None:
    """An unknown plug-in or a malformed --size is a usage error (exit 2) that names what is allowed."""
    for args, fragment in ((["--only", "nope"], "available:"), (["--size", "x"], "key=value")):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=ROOT, env=subprocess_env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr


def test_compare_takes_ratios_round_by_round() -> None:
    """compare() reports the median per-round ratio, its spread, and checks the target both ways."""
    row = compare("g", "n", [2.0, 4.0, 3.0], [1.0, 2.0, 1.0], unit="s", ref_name="r", target="<= 2.5")
    assert row.ratio == 2.0 and row.ok is True and row.spread == pytest.approx(0.5)
    inv = compare("g", "n", [1.0], [5.0], unit="s", ref_name="r", target=">= 10", invert=True)
    assert inv.ratio == 5.0 and inv.ok is False and inv.spread is None
    assert percentile([5, 1, 4, 2, 3], 50) == 3 and percentile(list(range(1, 101)), 99) == 99


def test_workloads_have_the_stated_shape(tmp_path: Path) -> None:
    """Sized messages are exactly that many JSON bytes; the agent mix pairs every tool result with its call."""
    import orjson

    for size in (300, 4096):
        assert len(orjson.dumps(sized_message(size))) == size
    msgs = agent_mix(300)
    assert msgs[0]["role"] == "system" and len(msgs) == 300
    calls = {c["id"] for m in msgs if m.get("tool_calls") for c in m["tool_calls"]}
    assert all(m["tool_call_id"] in calls for m in msgs if m["role"] == "tool")
    ref = ReferenceReRead(write_reference(tmp_path / "ref.jsonl", msgs[:5]))
    assert [{k: v for k, v in m.items() if k != "timestamp"} for m in ref.get_messages_for_request()] == msgs[:5]


def test_long_session_cache_is_reused_and_cut_back(tmp_path: Path) -> None:
    """The long-session data is generated once, found again by the next run, and a log a killed run left
    longer is cut back to its cached length; a change inside the cached bytes makes it rebuild."""
    from benchmarks.long_data import Dataset, messages

    data = Dataset(30, root=tmp_path)
    manifest, built = data.ensure()
    assert built and manifest["n"] == 30 and manifest["average_message_bytes"] > 0
    assert len(data.log.read_bytes().splitlines()) == 31  # session_started + 30 messages
    assert len(data.reference.read_text().splitlines()) == 30
    assert data.ensure() == (manifest, False)
    size = data.log.stat().st_size
    with open(data.log, "ab") as f:
        f.write(b"appended by a step\n")
    assert data.ensure() == (manifest, False) and data.log.stat().st_size == size
    raw = bytearray(data.log.read_bytes())
    raw[-5] ^= 1
    data.log.write_bytes(bytes(raw))
    assert data.ensure()[1] is True  # rebuilt
    assert list(messages(30)) == list(messages(30))  # the same data for the same size


def test_long_session_child_is_stopped_at_its_memory_cap() -> None:
    """A step that grows past the cap is stopped and reported as such, not left to exhaust the machine."""
    from benchmarks.bench_long_session import run_capped

    got = run_capped("x = bytearray(400 << 20)\nx[::4096] = b'1' * len(x[::4096])\nimport time; time.sleep(5)\n"
                     "print('{}')", [], cap_mb=150, timeout=60)
    assert got["stopped"] == "memory" and got["peak_kb"] > 150 * 1024
    got = run_capped("import json; print(json.dumps({'seconds': 0.5, 'peak_kb': peak_rss_kb()}))", [], cap_mb=150,
                     timeout=60)
    assert "stopped" not in got and 0 < got["peak_kb"] < 150 * 1024
