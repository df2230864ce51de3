"""The reading commands never hold a session's history in memory: ``show``, ``stats`` and ``export`` read it a
message at a time (and give what the store's list methods give), ``export`` writes while it reads, and ``tail``
runs in memory that does not grow with the log (measured in a child process on a 200 MB log)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager

from context_persistent.transfer import snapshot
from context_persistent.cli import main
from context_persistent.model.projection import split_key

ROOT = Path(__file__).resolve().parent.parent


async def _session(storage: Path, n: int = 120, size: int = 0) -> dict[str, Any]:
    """A session with tool calls, a system prompt, a pin and a redaction; returns what the store's list
    methods give for it (the expected output of the commands)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.workloads import agent_mix, sized_message

    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never")
    try:
        msgs = agent_mix(n)
        if size:
            msgs = [m if m["role"] != "user" else sized_message(size, "user", seed=i) for i, m in enumerate(msgs)]
        await store.add_messages(msgs)
        await store.pin(3)
        await store.redact(5)
        count = store._counter.count_message
        full = await store.get_messages()
        conversation = await store.get_conversation_view()
        reasoning = await store.get_reasoning_view()
        keys = list(store._full().keys)
        return {"full": full, "conversation": conversation, "reasoning": reasoning,
                "seqs": [split_key(k)[0] for k in keys],
                "tokens": {"full": await store.get_token_count(),
                           "conversation": sum(count(m) for m in conversation),
                           "reasoning": sum(count(m) for m in reasoning)}}
    finally:
        await store.close()


@pytest.fixture
def no_lists(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Once called, the store's methods that return a whole view as a list fail: a command calling them fails."""
    def refuse(name: str) -> Any:
        original = getattr(PersistentContextManager, name)

        async def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name == "get_messages" and (args or kwargs.get("last") is not None):
                return await original(self, *args, **kwargs)  # (the newest N only: bounded)
            raise AssertionError(f"{name}() holds the whole view in memory")
        return guarded

    def guard() -> None:
        for name in ("get_messages", "get_conversation_view", "get_reasoning_view"):
            monkeypatch.setattr(PersistentContextManager, name, refuse(name))
    return guard


def _run(capsys: pytest.CaptureFixture[str], storage: Path, *args: str) -> str:
    assert main(["--storage", str(storage), *args]) == 0
    return capsys.readouterr().out


def test_show_streams_every_view_and_gives_the_stores_messages(storage: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    want = asyncio.run(_session(storage))
    calls = []
    monkeypatch.setattr(PersistentContextManager, "get_messages", _spy(calls, PersistentContextManager.get_messages))
    for view in ("full", "conversation", "reasoning"):
        got = json.loads(_run(capsys, storage, "show", "s", "--view", view, "--json"))
        assert got["messages"] == want[view] and got["total_messages"] == len(want[view])
        assert len(got["message_seqs"]) == len(want[view]) and got["first_index"] == 0
        last = json.loads(_run(capsys, storage, "show", "s", "--view", view, "-n", "4", "--json"))
        assert last["messages"] == want[view][-4:] and last["first_index"] == len(want[view]) - 4
        assert last["message_seqs"] == got["message_seqs"][-4:]
    full = json.loads(_run(capsys, storage, "show", "s", "--json"))
    assert full["message_seqs"] == want["seqs"]
    text = _run(capsys, storage, "show", "s", "-n", "2")
    assert f"{len(want['full'])} messages (the last 2)" in text and str(want["seqs"][-1]) in text
    assert calls == [], "show called get_messages() for the whole history"
    req = json.loads(_run(capsys, storage, "show", "s", "--budget", "100000", "--json"))
    assert req["view"] == "request" and [s for s in req["message_seqs"] if s is not None]
    assert all(s is None or s in want["seqs"] for s in req["message_seqs"])


def _spy(calls: list[Any], original: Any) -> Any:
    async def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and kwargs.get("last") is None:
            calls.append("get_messages")
        return await original(self, *args, **kwargs)
    return spy


def test_stats_counts_views_a_message_at_a_time(storage: Path, capsys: pytest.CaptureFixture[str],
                                               no_lists: Any) -> None:
    import asyncio

    want = asyncio.run(_session(storage))
    no_lists()
    got = json.loads(_run(capsys, storage, "stats", "s", "--json", "--tokens"))
    assert {k: got["tokens_per_view"][k] for k in ("full", "conversation", "reasoning")} == want["tokens"]
    assert got["messages"] == len(want["full"])


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_export_streams_each_view(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  no_lists: Any, fmt: str) -> None:
    import asyncio

    want = asyncio.run(_session(storage))
    no_lists()
    for view in ("full", "conversation", "reasoning"):
        out = tmp_path / f"{view}.{fmt}"
        _run(capsys, storage, "export", "s", str(out), "--view", view)
        raw = out.read_bytes()
        if fmt == "jsonl":
            lines = raw.splitlines(keepends=True)
            header, body = orjson.loads(lines[0]), lines[1:]
            assert [orjson.loads(x) for x in body] == want[view]
        else:
            doc = orjson.loads(raw)
            header = doc["header"]
            assert doc["messages"] == want[view]
            assert raw == orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"  # as one dumps would write it
            body = [orjson.dumps(m) + b"\n" for m in want[view]]
        assert header["messages"] == len(want[view]) and header["view"] == view
        assert header["body_sha256"] == "sha256:" + hashlib.sha256(b"".join(body)).hexdigest()


def test_export_writes_while_it_reads(storage: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes reach the file before the history's last message is read: nothing collects the whole file."""
    import asyncio

    want = asyncio.run(_session(storage, n=1200, size=4096))
    seen: list[int] = []
    original = snapshot.history_messages

    async def watched(store: Any) -> Any:
        i = 0
        async for m in original(store):
            i += 1
            if i == len(want["full"]):  # the last message: how much of the file is already written?
                seen.append(sum(p.stat().st_size for p in tmp_path.glob(".out.jsonl.tmp-*")))
            yield m

    monkeypatch.setattr(snapshot, "history_messages", watched)
    _run(capsys, storage, "export", "s", str(tmp_path / "out.jsonl"))
    total = (tmp_path / "out.jsonl").stat().st_size
    assert total > 3 << 20 and len(seen) == 2  # a checksum pass, then the writing pass
    assert seen[0] == 0 and seen[1] >= total - (2 << 20), (seen, total)


CHILD = """
import sys
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
import orjson, asyncio, context_persistent.cli as cli, context_persistent.store.manager, context_persistent.transfer.snapshot
import os
base = status("VmRSS:")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
rc = cli.main(sys.argv[1:])
sys.stderr.write(orjson.dumps({"rc": rc, "growth_kb": status("VmHWM:") - base}).decode() + "\\n")
"""


PREPARE = """
import asyncio, sys
from context_persistent import PersistentContextManager
async def main():
    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id="s", fsync="never")
    await store.close()  # writes the checkpoint, as any session closed normally has
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def big_session(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 200 MB log of 50,000 agent-mix messages with its checkpoint (as after a normal close).

    Why not a smaller log (with the cap, half the log, scaled with it): the commands' peak growth has a floor
    that does not depend on the log: a read batch of 4,096 records (about 40 MB of Python objects at this mix's
    ~4 KB a message) plus the interpreter's own, 40-57 MB on this log and on a 62 MB one alike (``tail --after
    1``, ``verify``, the first ``ls``; measured 2026-11-27; a smaller page cache or a tokenizer loaded before the
    baseline did not move it). Half a 62 MB log is under that floor, so a smaller log would pass only with a cap
    above half of it, no longer clearly below what holding its messages takes; at 200 MB the cap is about twice
    the floor, so a command that grew with the log would fail while the floor leaves room for noise."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.long_data import messages
    from benchmarks.workloads import write_session

    storage = tmp_path_factory.mktemp("big") / "store"
    log = write_session(storage, "s", messages(50_000))
    subprocess.run([sys.executable, "-c", PREPARE, str(storage)], check=True, timeout=300)
    yield storage, log.stat().st_size
    for p in (storage / "s").iterdir():
        p.unlink()


@pytest.mark.slow
@pytest.mark.parametrize("command", [["tail", "s", "-n", "5"], ["tail", "s", "--after", "1"], ["ls"],
                                     ["show", "s", "-n", "5"], ["show", "s", "-n", "5", "--json"],
                                     ["show", "s", "--json"], ["show", "s", "--view", "reasoning"],
                                     ["export", "s", "{tmp}/out.jsonl"], ["export", "s", "{tmp}/out.json"],
                                     ["verify", "s"]])
def test_command_memory_does_not_grow_with_the_log(big_session: Any, subprocess_env: dict[str, str],
                                                   command: list[str], tmp_path: Path) -> None:
    """On a 200 MB log the command's peak memory grows by less than half the log (a 32 MiB page cache and
    buffers): holding the log's messages would take more than the log."""
    storage, size = big_session
    assert size > 150 << 20
    command = [c.replace("{tmp}", str(tmp_path)) for c in command]
    proc = subprocess.run([sys.executable, "-c", CHILD, "--storage", str(storage), *command], env=subprocess_env,
                          capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["rc"] == 0, proc.stderr[-2000:]
    assert result["growth_kb"] * 1024 < size / 2, (result, size)


@pytest.fixture(scope="module", params=["one plain segment", "compressed 64 MiB segments"])
def big_segmented_session(big_session: Any, tmp_path_factory: pytest.TempPathFactory,
                          request: pytest.FixtureRequest) -> Any:
    """The 200 MB session cut into sealed segments by `migrate`: the whole log in one plain segment (as a long
    single-file log becomes), or 64 MiB segments stored as zstd frames."""
    storage, size = big_session
    copy = tmp_path_factory.mktemp("segmented") / "store"
    shutil.copytree(storage, copy)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOME=str(copy.parent / "home"))
    extra = ["--segment-bytes", "0"] if request.param == "one plain segment" else [
        "--segment-bytes", str(64 << 20), "--compress"]
    subprocess.run([sys.executable, "-m", "context_persistent", "--storage", str(copy), "migrate", "s", *extra],
                   env=env, check=True, capture_output=True, timeout=300)
    manifest = json.loads((copy / "s" / "segments.json").read_bytes())
    assert (len(manifest["segments"]) == 1) == (request.param == "one plain segment"), manifest
    yield copy, size
    shutil.rmtree(copy)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "repair"])
def test_verify_memory_does_not_grow_with_a_segmented_log(big_segmented_session: Any, command: str,
                                                           subprocess_env: dict[str, str]) -> None:
    """Verify and repair hash and walk sealed segments in pieces: on a 200 MB segmented log their peak memory
    grows by less than half the log (reading a segment whole would take the segment's size, the whole log in
    the one-segment case). The log is clean: repair finds nothing to rewrite."""
    storage, size = big_segmented_session
    proc = subprocess.run([sys.executable, "-c", CHILD, "--storage", str(storage), command, "s"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["rc"] == 0, proc.stderr[-2000:]
    assert result["growth_kb"] * 1024 < size / 2, (result, size)


def test_stats_tokens_uses_the_counts_the_history_keeps(storage: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``stats --tokens`` sums the per-message counts the history keeps (the checkpoint records them; the
    store's first token count makes the missing ones) instead of tokenising every message again in its pass
    over the history: in that pass only what the conversation view changes is tokenised. The totals are those
    of counting everything."""
    import asyncio

    from context_persistent.transfer import snapshot
    from context_persistent.model.tokens import TokenCounter

    want = asyncio.run(_session(storage))
    in_pass: list[bool] = [False]
    calls: list[Any] = []
    count, walk = TokenCounter.count_message, snapshot.history_messages

    def counting(self: Any, m: Any) -> int:
        if in_pass[0]:
            calls.append(m)
        return count(self, m)  # type: ignore[no-any-return]

    async def passing(store: Any) -> Any:
        in_pass[0] = True
        try:
            async for m in walk(store):
                yield m
        finally:
            in_pass[0] = False

    monkeypatch.setattr(TokenCounter, "count_message", counting)
    monkeypatch.setattr(snapshot, "history_messages", passing)
    got = json.loads(_run(capsys, storage, "stats", "s", "--json", "--tokens"))
    assert {k: got["tokens_per_view"][k] for k in ("full", "conversation", "reasoning")} == want["tokens"]
    changed = [m for m in want["conversation"] if m not in want["full"]]
    assert len(calls) == len(changed) < len(want["full"]) // 2
