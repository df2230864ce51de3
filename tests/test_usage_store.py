"""record_usage on a store: what is written and when, idempotence, resume, forks, kills, bad input, PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, ReadOnlyError, read_usage
from context_persistent.model.codec import decode
from tests.pgfixtures import pg_config, pg_dsn, pg_schema  # noqa: F401

CHILD = Path(__file__).with_name("usage_child.py")
CLAUDE = {"input_tokens": 1200, "output_tokens": 30, "cache_read_tokens": 300, "cache_write_tokens": 100,
          "cost_usd": 0.02}


def _kinds(storage: Path, session: str) -> list[str]:
    return [decode(x)["type"] for x in (storage / session / "events.jsonl").read_bytes().splitlines()]


async def test_the_report_rides_with_the_next_append(tmp_path: Path) -> None:
    """record_usage writes nothing by itself (file log, fsync always): the record goes out in the same write as
    the next event and answers the request view served last. That view was made from bounds (not counted):
    the record names it (``view``) instead of the store's count, which the calibration pairs when the store
    next counts (here stats()), without loading the tokenizer on the way."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    await store.add_message({"role": "user", "content": "hello there"})
    view = await store.get_messages_for_request(token_budget=10_000)
    data = await store.record_usage(CLAUDE, provider="anthropic", model="claude-x")
    assert data is not None and _kinds(tmp_path, "s")[-1] == "message_added"
    assert not store._s.counter.loaded
    assert data["request_seq"] == store.head_seq and data["estimated_tokens"] is None
    assert data["view"]["messages"] == 1 and data["view"]["key"] == store._s.state.keys[0]
    assert store.stats()["calibration"]["reports"] == 1
    assert data["estimated_tokens"] == sum(store._counter.count_message(m) for m in view)
    log = store._s.log
    real_append, appends = log.append, []

    async def spy(lines: list[bytes], first_seq: int) -> None:
        appends.append(len(lines))
        await real_append(lines, first_seq)

    log.append = spy
    await store.add_message({"role": "assistant", "content": "hi"})
    assert appends == [2]  # (one write: the record and the message, no write of its own)
    assert _kinds(tmp_path, "s")[-2:] == ["usage_reported", "message_added"]
    await store.close()
    logged = [decode(x)["data"] for x in (tmp_path / "s" / "events.jsonl").read_bytes().splitlines()
              if decode(x)["type"] == "usage_reported"]
    assert logged[0]["estimated_tokens"] is None and logged[0]["view"] == data["view"]


async def test_same_id_is_recorded_once_also_after_a_resume(tmp_path: Path) -> None:
    """A report recorded again with the same id (a host re-sending after a restart) is written once."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert await store.record_usage(CLAUDE, provider="anthropic", id="msg_1") is not None
    assert await store.record_usage(CLAUDE, provider="anthropic", id="msg_1") is None
    await store.close()
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert await store.record_usage(CLAUDE, provider="anthropic", id="msg_1") is None
    assert await store.record_usage(CLAUDE, provider="anthropic", id="msg_2") is not None
    await store.close()
    assert _kinds(tmp_path, "s").count("usage_reported") == 2
    assert (await read_usage(tmp_path))["total"]["reports"] == 2


async def test_bad_reports_are_refused_with_what_is_allowed(tmp_path: Path) -> None:
    """Negative or fractional tokens, a negative cost, an unknown source or no token field: a clear error, and
    nothing is recorded; a read-only store refuses to record."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    for usage, kw, words in (({"input_tokens": -1}, {}, "non-negative integer"),
                             ({"input_tokens": 1.5}, {}, "non-negative integer"),
                             ({"input_tokens": 1, "cost_usd": -2}, {}, "cost_usd"),
                             ({"input_tokens": 1}, {"source": "nope"}, "source must be one of"),
                             ({"foo": 1}, {}, "reports no tokens")):
        with pytest.raises(ValueError, match=words):
            await store.record_usage(usage, **kw)
    with pytest.raises(TypeError, match="mapping or an object"):
        await store.record_usage(42)
    await store.add_message({"role": "user", "content": "x"})
    await store.close()
    assert "usage_reported" not in _kinds(tmp_path, "s")
    ro = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", readonly=True)
    with pytest.raises(ReadOnlyError):
        await ro.record_usage({"input_tokens": 1})
    await ro.close()


async def test_calibrate_must_be_a_bool(tmp_path: Path) -> None:
    """calibrate takes true or false; anything else is refused naming the key."""
    with pytest.raises(ValueError, match="calibrate must be true or false"):
        await PersistentContextManager.open(storage_path=tmp_path, session_id="s", calibrate="yes")


async def test_the_budget_follows_the_provider_count(tmp_path: Path) -> None:
    """A provider counting 1.5x the store plus 2,000 fixed tokens: once calibrated, every view is fitted so
    that the provider's count of it stays inside the budget, and the view uses most of it; with calibrate off
    the same history overflows the provider's count."""
    budget = 6_000

    async def run(calibrate: bool) -> list[int]:
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id=f"c{calibrate}",
                                                    calibrate=calibrate)
        real = []
        for i in range(60):
            await store.add_message({"role": "user", "content": f"turn {i} " + "word " * 120})
            view = await store.get_messages_for_request(token_budget=budget)
            counted = sum(store._counter.count_message(m) for m in view)
            real.append(int(1.5 * counted) + 2_000)
            await store.record_usage({"input_tokens": real[-1], "output_tokens": 5}, provider="acme", model="m1")
            await store.add_message({"role": "assistant", "content": "ok"})
        await store.close()
        return real

    calibrated = await run(True)
    assert max(calibrated[3:]) <= budget  # (the first requests are small; the fit follows from the reports)
    assert max(calibrated) >= 0.8 * budget
    assert max(await run(False)) > budget


async def test_a_slowly_rising_ratio_extends_the_view_instead_of_rebuilding_it(tmp_path: Path,
                                                                               rebuilds: Any) -> None:
    """A provider whose count rises a little against ours with every report lowers the calibrated budget a
    little each turn: the view, still under the lower budget's threshold, is extended, not rebuilt every turn;
    once it no longer fits it is compacted, and the provider's count stays inside its budget."""
    budget = 6_000
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync="never")
    real = []
    for i in range(60):
        await store.add_message({"role": "user", "content": f"turn {i} " + "word " * 60})
        view = await store.get_messages_for_request(token_budget=budget)
        counted = sum(store._counter.count_message(m) for m in view)
        real.append(int(counted * (1.2 + 0.01 * i)) + 300)
        await store.record_usage({"input_tokens": real[-1], "output_tokens": 5}, provider="acme", model="m1")
        await store.add_message({"role": "assistant", "content": "ok"})
    fitted = [store.stats()["calibration"]["budget"]]
    await store.get_messages_for_request(token_budget=budget)
    fitted.append(store.stats()["calibration"]["budget"])
    compacted = store.stats()["last_compaction"]
    await store.close()
    assert fitted[1] < fitted[0] and compacted is not None  # (the budget kept falling; the view was compacted)
    assert max(real[3:]) <= budget
    assert 2 <= rebuilds.count <= 6, rebuilds.count  # (the first view, the compactions; not one per turn)


async def test_a_fork_starts_its_own_ledger(tmp_path: Path) -> None:
    """A fork copies the history, not the usage records: summed across the storage each report counts once."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="parent")
    await store.add_message({"role": "user", "content": "q"})
    await store.record_usage(CLAUDE, provider="anthropic", model="claude-x")
    await store.add_message({"role": "assistant", "content": "a"})
    await store.fork("child")
    await store.close()
    child = await PersistentContextManager.open(storage_path=tmp_path, session_id="child")
    await child.record_usage({"input_tokens": 7, "output_tokens": 1}, provider="anthropic", model="claude-x")
    await child.close()
    result = await read_usage(tmp_path)
    assert {r["session"]: r["input_tokens"] for r in result["rows"]} == {"parent": 1200, "child": 7}
    assert result["total"]["reports"] == 2


@pytest.mark.slow
def test_killed_writers_never_double_count(tmp_path: Path) -> None:
    """A writer SIGKILLed mid-session, then resumed (re-recording the turns it had not acknowledged, with the
    same report ids), three times: every acknowledged report is in the ledger, each id exactly once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    start, acked = 0, []
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path), "s", str(start)],
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"OPEN")
        seen = 0
        while seen < 15 + 7 * round_:
            line = proc.stdout.readline()
            assert line.startswith(b"ACK"), line
            acked.append(int(line.split()[1]))
            seen += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        start = acked[-1] - 2  # (a host that re-sends the last turns: their ids are recorded already)
    records = [decode(x) for x in (tmp_path / "s" / "events.jsonl").read_bytes().splitlines()]
    ids = [r["data"]["id"] for r in records if r["type"] == "usage_reported"]
    assert len(ids) == len(set(ids))
    assert set(f"r{i}" for i in acked) <= set(ids)
    total = asyncio.run(read_usage(tmp_path))["total"]
    assert total["reports"] == len(ids)
    assert total["input_tokens"] == sum(1000 + int(i[1:]) for i in ids)
    assert total["cost_usd"] == pytest.approx(0.5 * len(ids))


async def test_postgres_records_resumes_and_reads_the_ledger(tmp_path: Path, pg_config: dict[str, Any]) -> None:
    """On PostgreSQL the reports go out with the group commit, are read back at open (the calibration is
    rebuilt) and summed by read_usage."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="pg-usage", **pg_config)
    for i in range(4):
        await store.add_message({"role": "user", "content": f"q{i} " + "w " * 50 * (i + 1)})
        await store.get_messages_for_request(token_budget=100_000)
        await store.record_usage({"input_tokens": 500 * (i + 1) + 900, "output_tokens": 3}, provider="anthropic",
                                 model="claude-pg", id=f"pg{i}")
    await asyncio.sleep(0.05)  # (the group commit runs in the background)
    await store.close()
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="pg-usage", **pg_config)
    assert store.stats()["events"]["usage_reported"] == 4
    assert await store.record_usage({"input_tokens": 1}, provider="anthropic", id="pg3") is None
    assert store._usage.calibration.counts == {("anthropic", "claude-pg"): 4}
    await store.close()
    result = await read_usage(tmp_path, "pg-usage", by="model", **pg_config)
    assert result["rows"][0]["model"] == "claude-pg" and result["total"]["input_tokens"] == 500 * 10 + 3600


async def test_a_report_left_unpaired_is_paired_after_a_resume_and_dropped_once_its_view_is_gone(tmp_path: Path
                                                                                             ) -> None:
    """A report whose view was not counted in its process is paired by the next one that counts, from the view
    the record names (its length and the key of its last message); a history replaced since calibrates
    nothing from it."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    await store.add_messages([{"role": "user", "content": f"question {i} " * 20} for i in range(30)])
    view = await store.get_messages_for_request(token_budget=100_000)
    data = await store.record_usage(CLAUDE, provider="anthropic", model="claude-x")
    assert data is not None and data["estimated_tokens"] is None
    await store.add_message({"role": "assistant", "content": "answer"})
    await store.close()
    exact = sum(store._counter.count_message(m) for m in view)

    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    assert len(store._usage.pending) == 1 and not store._s.counter.loaded
    await store.get_messages_for_request(token_budget=100_000)  # (fits by the bound and by the report)
    assert len(store._usage.pending) == 1 and not store._s.counter.loaded
    calibration = store.stats()["calibration"]
    assert calibration["reports"] == 1 and store._usage.last_report["estimated_tokens"] == exact
    assert list(store._usage.calibration.points[("anthropic", "claude-x")]) == [(exact, 1200 + 300 + 100)]
    await store.close()

    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    await store.set_messages([{"role": "user", "content": "a new history"}], reason="test")
    assert store.stats()["calibration"]["reports"] == 0 and not store._usage.pending
    await store.close()


async def test_a_pending_report_that_says_the_view_no_longer_fits_is_paired_before_the_view(tmp_path: Path) -> None:
    """The view made from bounds is served without pairing a pending report only while the report's count,
    grown in proportion to the bound, fits the provider's budget too: a provider that counted the last
    request near the budget gets the view a store that paired the report at once would make."""
    views = []
    for pair_at_once in (True, False):
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id=f"s{pair_at_once}")
        await store.add_messages([{"role": "user", "content": f"question {i} " * 20} for i in range(60)])
        await store.get_messages_for_request(token_budget=60_000)
        await store.record_usage({"input_tokens": 59_800, "output_tokens": 5}, provider="anthropic",
                                 model="claude-x")
        if pair_at_once:
            store.stats()
        await store.add_message({"role": "assistant", "content": "answer"})
        views.append(await store.get_messages_for_request(token_budget=60_000))
        assert not store._usage.pending and store.stats()["calibration"]["reports"] == 1
        await store.close()
    assert views[0] == views[1] and len(views[1]) < 61  # (compacted: the provider counts far more than the store)


async def test_with_calibrate_off_a_pending_report_never_loads_the_tokenizer(tmp_path: Path) -> None:
    """calibrate: false: the reports never change a budget, so one that says the view is near the budget is not
    paired on the request path (the tokenizer stays unloaded); the view is the store's own count's."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", calibrate=False)
    await store.add_messages([{"role": "user", "content": f"question {i} " * 20} for i in range(60)])
    await store.get_messages_for_request(token_budget=60_000)
    await store.record_usage({"input_tokens": 59_800, "output_tokens": 5}, provider="anthropic", model="claude-x")
    await store.add_message({"role": "assistant", "content": "answer"})
    assert len(await store.get_messages_for_request(token_budget=60_000)) == 61
    assert len(store._usage.pending) == 1 and not store._s.counter.loaded
    await store.close()


def test_the_pending_reports_asked_are_those_every_pending_report_would_answer(tmp_path: Path) -> None:
    """Whether a view made from bounds fits by the pending reports is asked of the one report that predicts the
    most per token of bound (kept as reports come, go out at REBUILD_REPORTS, or are paired): the answer is
    every pending report's, one by one, through any sequence of those."""
    import random

    from context_persistent.model.usage import request_tokens
    from context_persistent.store.usage import REBUILD_REPORTS
    from context_persistent.store.view_bound import fits

    async def run() -> None:
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync="never")
        meter, cfg = store._usage, store._s.compaction
        rng = random.Random(7)

        def every(budget: int, bound: int) -> bool:
            for data, _ in meter.pending:
                reported, b = request_tokens(data), data["view"].get("bound")
                if reported and type(b) is int and b > 0 and not fits(int(reported * bound / b) + 1, budget, cfg):
                    return False
            return True

        checked = 0
        for step in range(3 * REBUILD_REPORTS + 50):  # (the last ones push the oldest out)
            data = {"input_tokens": rng.choice([None, 0, rng.randint(1, 200_000)]), "provider": "anthropic",
                    "cache_read_tokens": rng.choice([0, 500]),
                    "view": {"bound": rng.choice([None, 0, "12", rng.randint(1, 200_000)])}}
            meter._add_pending(data, lambda load=True: None)
            if step < 2 * REBUILD_REPORTS and rng.random() < 0.02:  # (pair() takes the oldest: some, or all)
                for _ in range(rng.randint(1, len(meter.pending))):
                    meter.pending.popleft()
            for _ in range(4):
                budget, bound = rng.randint(1_000, 200_000), rng.randint(1, 200_000)
                answer = meter._pending_fit(budget, bound)
                assert answer == every(budget, bound), (step, budget, bound)
                checked += not answer
        assert len(meter.pending) == REBUILD_REPORTS and checked > 50
        meter.pending.clear()
        assert meter._pending_fit(1, 10**9)
        await store.close()

    asyncio.run(run())


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_resume_reads_the_reports_where_the_checkpoint_says_not_the_whole_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str) -> None:
    """A session with few reports and a long history (every report is wanted at open): its checkpoint keeps where
    the reports start (``usage_at``), so a resume reads the log back only to the checkpoint and the older
    reports where they are, and its meter is the one a whole backward read makes. Once the reports are known at
    every place, later checkpoints keep them too."""
    from context_persistent.storage import newest

    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync=fsync)
    for turn in range(3):
        await store.add_message({"role": "user", "content": f"turn {turn}"})
        await store.record_usage(CLAUDE, provider="anthropic", model="claude-x", id=f"r{turn}")
        await store.add_messages([{"role": "assistant", "content": f"answer {turn} " + "x" * 300}] * 200)
    await store.close()

    from test_newest_records import spy_backward_reads

    real = newest._backwards
    stops = spy_backward_reads(monkeypatch)
    for turn in range(2):  # (the first resume: the checkpoint the first process wrote; then its successor's)
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync=fsync)
        cp = store._s.checkpoints
        assert cp.loaded_seq and len(cp.loaded_usage_at) == 3 + turn
        assert stops == [cp.position] and store.stats()["last_usage"]["id"] == f"r{2 + turn}"
        assert {i for _, i in store._usage._ids} == {f"r{i}" for i in range(3 + turn)}  # (every report read)
        await store.record_usage(CLAUDE, provider="anthropic", model="claude-x", id=f"r{3 + turn}")
        await store.add_messages([{"role": "user", "content": "more " + "y" * 300}] * 300)
        await store.close()
        stops.clear()
    monkeypatch.setattr(newest, "_backwards", real)
    (tmp_path / "s" / "checkpoint.json").unlink()  # (the whole log read back, as without the positions)
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync=fsync)
    try:
        assert store.stats()["last_usage"]["id"] == "r4" and store._usage.positions is not None
        assert list(store._usage.positions) == cp.loaded_usage_at + [store._usage.positions[-1]]
    finally:
        await store.close()
