"""Segment retention: ``max_segments`` and ``max_age_days`` over the sealed segments of a kept session (the
plan, pure and on a real segmented log; validation), and applying it: the expired record with its carried
copies, the manifest boundary, the trash entry, the seeded open, restore refused, purge, live sessions kept."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON
from context_persistent import LogCorruptedError, PersistentContextManager, RecordsExpiredError
from context_persistent.operations import trash
from context_persistent.operations.repair import repair, verify
from context_persistent.model.retention import RetentionPolicy, SegmentInfo, SessionInfo, plan, plan_segments
from context_persistent.storage.segments import LogReader, ManifestError, load_manifest, read_line_at

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _segs(*days_ago: float) -> list[SegmentInfo]:
    """Sealed segments, oldest first, whose last records are ``days_ago`` days before T0 (10 records each)."""
    return [SegmentInfo(f"segment-{i + 1:06d}.jsonl", 10 * i + 1, 10 * i + 10, T0 - timedelta(days=d), 1000)
            for i, d in enumerate(days_ago)]


# -- the policy --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, words", [
    ({"max_segments": -1}, "retention.max_segments must be a whole number from 0 to"),
    ({"max_segments": 2.5}, "retention.max_segments must be a whole number"),
    ({"max_segments": "3"}, "retention.max_segments must be a whole number"),
    ({"max_segments": False}, "retention.max_segments must be a whole number"),
    ({"max_segment": 3}, "unknown retention key(s) max_segment; allowed: max_age_days, max_bytes, max_sessions, "
                         "max_segments"),
])
def test_max_segments_errors_say_what_is_allowed(config: Any, words: str) -> None:
    with pytest.raises(ValueError) as e:
        RetentionPolicy.from_config(config)
    assert words in str(e.value)


def test_max_segments_is_a_limit_of_its_own() -> None:
    policy = RetentionPolicy.from_config({"max_segments": 4, "apply_on_open": True})
    assert policy.limits() == {"max_segments": 4} and policy.segment_limits() == {"max_segments": 4}
    assert RetentionPolicy(max_sessions=3).segment_limits() == {}
    assert RetentionPolicy(max_age_days=9).segment_limits() == {"max_age_days": 9}
    assert policy.as_dict()["max_segments"] == 4
    cfg = PersistentContextManager.check_config({"retention": {"max_segments": 0}})
    assert cfg["retention"] == RetentionPolicy(max_segments=0)


# -- the plan (pure) ---------------------------------------------------------------------------------
def test_max_segments_keeps_the_newest_sealed_segments() -> None:
    sealed = _segs(9, 8, 7, 6, 5)
    got = plan_segments(RetentionPolicy(max_segments=2), "s", sealed, T0)
    assert [e.segment.name for e in got] == [s.name for s in sealed[:3]]
    assert {e.rule for e in got} == {"max_segments"} and "5 sealed segments; max_segments is 2" in got[0].reason
    assert plan_segments(RetentionPolicy(max_segments=5), "s", sealed, T0) == []
    assert len(plan_segments(RetentionPolicy(max_segments=0), "s", sealed, T0)) == 5  # the active one stays


def test_segment_age_is_the_last_record_and_only_a_prefix_expires() -> None:
    got = plan_segments(RetentionPolicy(max_age_days=30), "s", _segs(40, 31, 30, 45, 1), T0)
    # the third (exactly 30 days) stays, so the fourth stays too although it is older: never a gap
    assert [(e.segment.first_seq, e.rule) for e in got] == [(1, "max_age_days"), (11, "max_age_days")]
    assert "40.0 days old; max_age_days is 30" in got[0].reason


def test_segment_rules_combine_oldest_first() -> None:
    got = plan_segments(RetentionPolicy(max_age_days=30, max_segments=3), "s", _segs(50, 20, 10, 5, 1), T0)
    assert [(e.segment.first_seq, e.rule) for e in got] == [(1, "max_age_days"), (11, "max_segments")]


def test_plan_selects_segments_of_kept_sessions_only() -> None:
    infos = [SessionInfo("gone", T0 - timedelta(days=90), 10), SessionInfo("kept", T0, 10),
             SessionInfo("busy", T0, 10, live=True), SessionInfo("opening", T0, 10)]
    sealed = {sid: _segs(60, 50, 1) for sid in ("gone", "kept", "busy", "opening")}
    p = plan(RetentionPolicy(max_age_days=30), infos, T0, frozenset({"opening"}), sealed)
    assert [e.session_id for e in p.expire] == ["gone"]  # a whole session: its segments go with it
    assert [(e.session_id, e.segment.first_seq) for e in p.segments] == [("kept", 1), ("kept", 11)]
    assert [(e.session_id, e.segment.first_seq) for e in p.segments_live] == [("busy", 1), ("busy", 11)]
    rows = p.as_dict()["segments"]
    assert rows[0]["segment"] == "segment-000001.jsonl" and rows[0]["last_seq"] == 10 and rows[0]["bytes"] == 1000
    assert plan(RetentionPolicy(max_sessions=9), infos, T0, sealed=sealed).segments == []  # no segment rule


# -- on a segmented log ------------------------------------------------------------------------------
async def _segmented(storage: Path, sid: str, n: int = 60) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid, segment_bytes=4096)
    msgs = [{"role": "user", "content": f"{sid} message {i} " + "s" * 300} for i in range(n)]
    for m in msgs:
        await store.add_message(m)
    await store.close()
    return msgs


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "lock"}


async def test_sealed_segments_are_read_from_the_log(storage: Path) -> None:
    await _segmented(storage, "seg")
    manifest = load_manifest(storage / "seg", "seg")
    assert manifest is not None and len(manifest.segments) >= 3
    infos = trash.sealed_segments(storage, "seg")
    assert [(i.name, i.first_seq, i.last_seq, i.bytes) for i in infos] == [
        (s.name, s.first_seq, s.last_seq, s.size) for s in manifest.segments]
    lines = b"".join((storage / "seg" / s.name).read_bytes() for s in manifest.segments).splitlines()
    by_seq = {json.loads(line)["seq"]: json.loads(line)["ts"] for line in lines}
    assert [i.last_record for i in infos] == [datetime.fromisoformat(by_seq[s.last_seq]) for s in manifest.segments]
    assert trash.sealed_segments(storage, "nothing-here-is-segmented") == []


async def test_a_damaged_last_record_of_a_segment_is_an_error(storage: Path) -> None:
    await _segmented(storage, "seg")
    manifest = load_manifest(storage / "seg", "seg")
    assert manifest is not None
    first = storage / "seg" / manifest.segments[0].name
    data = bytearray(first.read_bytes())
    data[-5] ^= 0x01  # inside the last record's JSON: its checksum no longer holds
    os.chmod(first, 0o600)
    first.write_bytes(bytes(data))
    with pytest.raises(LogCorruptedError, match="last record of sealed segment segment-000001.jsonl"):
        trash.sealed_segments(storage, "seg")
    with pytest.raises(LogCorruptedError):  # a plan never skips it silently
        await trash.plan_file(storage, RetentionPolicy(max_segments=1))


async def _with_prompt_and_pin(storage: Path, sid: str, n: int = 60) -> list[dict[str, Any]]:
    """A segmented session: a system prompt, then ``n`` messages; the second one (index 2) pinned."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid, segment_bytes=4096)
    msgs = [{"role": "system", "content": "be brief"}]
    msgs += [{"role": "user", "content": f"{sid} message {i} " + "s" * 300} for i in range(n)]
    for m in msgs:
        await store.add_message(m)
    await store.pin(2)
    await store.close()
    return msgs


def _log_records(folder: Path) -> list[dict[str, Any]]:
    out = []
    manifest = load_manifest(folder, folder.name)
    assert manifest is not None
    for seg in manifest.segments:
        out += [json.loads(line) for line in (folder / seg.name).read_bytes().splitlines()]
    out += [json.loads(line) for line in (folder / "events.jsonl").read_bytes().splitlines()]
    return out


async def test_apply_expires_the_oldest_segments_and_keeps_prompt_and_pins(storage: Path) -> None:
    msgs = await _with_prompt_and_pin(storage, "seg")
    folder = storage / "seg"
    manifest = load_manifest(folder, "seg")
    assert manifest is not None
    n = len(manifest.segments)
    gone = manifest.segments[:-1]
    digests = {s.name: "sha256:" + hashlib.sha256((folder / s.name).read_bytes()).hexdigest() for s in gone}
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert report["trashed"] == [] and report["segments_kept"] == []
    [row] = report["segments_expired"]
    last = gone[-1].last_seq
    assert row["entry"] == "seg~1" and row["segments"] == [s.name for s in gone] and row["last_seq"] == last
    # the files are in the trash entry, unchanged; the manifest starts at the first surviving segment
    entry = storage / ".retention" / "trash" / "seg~1"
    assert {p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in entry.iterdir()} == digests
    after = load_manifest(folder, "seg")
    assert after is not None and after.boundary is not None and [s.name for s in after.segments] == [
        manifest.segments[-1].name]
    b = after.boundary
    assert (b.last_seq, b.last_crc, b.start, b.last_segment) == (last, gone[-1].last_crc, gone[-1].end, n - 1)
    assert not (folder / "checkpoint.json").exists()
    records = _log_records(folder)
    expired = records[-1]
    assert expired["type"] == "expired" and expired["seq"] == b.expired_seq
    assert [c["message"] for c in expired["data"]["carried"]] == [msgs[0], msgs[2]]
    assert expired["data"]["segments"][0]["sha256"] == digests[gone[0].name]
    # message i (index i + 1 after the prompt) was written at seq i + 3 (seq 1: session_started, 2: the prompt)
    survivors = [m for i, m in enumerate(msgs[1:]) if i + 3 > last]
    want = [msgs[0], msgs[2], *survivors]
    for _ in range(2):  # without a checkpoint (seeded from the expired record), then with the one close wrote
        store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
        assert await store.get_messages() == want
        # the carried messages are read from the expired record (paged refs into it), never from the trash
        items = store._s.full().messages.items
        with LogReader(folder) as reader:
            found = reader.find_seq(b.expired_seq)
        assert found is not None
        assert all(type(v) is int and v >> 20 == found[0] for v in items[:2])
        await store.close()
    # a ledger entry of kind "segments": restore is refused, purge deletes it
    [listed] = await trash.list_trash(storage)
    assert listed["kind"] == "segments" and listed["segments"] == [s.name for s in gone]
    with pytest.raises(ValueError, match="cannot go back into the log"):
        await trash.restore(storage, "seg~1")
    out = await trash.purge(storage, ["seg~1"], force=True)
    assert [p["entry"] for p in out["purged"]] == ["seg~1"] and not entry.exists()
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    assert await store.get_messages() == want
    await store.close()


async def test_a_second_expiry_carries_what_the_first_carried(storage: Path) -> None:
    msgs = await _with_prompt_and_pin(storage, "seg")
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg", segment_bytes=4096)
    more = [{"role": "user", "content": f"later {i} " + "t" * 300} for i in range(40)]
    for m in more:
        await store.add_message(m)
    want_before = await store.get_messages()
    await store.close()
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert [r["entry"] for r in report["segments_expired"]] == ["seg~2"]
    b = load_manifest(storage / "seg", "seg").boundary  # type: ignore[union-attr]
    assert b is not None and b.last_seq == report["segments_expired"][0]["last_seq"]
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    got = await store.get_messages()
    await store.close()
    assert got[:2] == [msgs[0], msgs[2]]  # carried again: the first expired record is in the trash now
    assert got[2:] == [m for m in want_before[2:] if m in got[2:]] and got[-1] == more[-1]


async def test_a_live_session_keeps_its_segments(storage: Path) -> None:
    await _with_prompt_and_pin(storage, "seg")
    before = _files(storage / "seg")
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert report["segments_expired"] == [] and report["segments_kept"]
    assert all(k["why"].startswith("live") for k in report["segments_kept"])
    await store.close()
    assert {k: v for k, v in _files(storage / "seg").items() if not k.startswith("checkpoint")} == {
        k: v for k, v in before.items() if not k.startswith("checkpoint")}


def test_cli_plan_and_apply_expire_segments(storage: Path, subprocess_env: dict[str, str]) -> None:
    asyncio.run(_segmented(storage, "seg"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "context_persistent", *args, "--storage", str(storage)],
                              capture_output=True, text=True, env=subprocess_env, timeout=60)

    out = cli("retention", "plan", "--max-segments", "1")
    assert out.returncode == 0, out.stderr
    assert "segment seg/segment-000001.jsonl" in out.stdout and "max_segments" in out.stdout
    out = cli("retention", "apply", "--max-segments", "1")
    assert out.returncode == 0, out.stderr
    assert "expired seg/segment-000001.jsonl" in out.stdout and "seg~1" in out.stdout
    out = cli("trash", "restore", "seg~1")
    assert out.returncode == 2 and "cannot go back into the log" in out.stderr
    out = cli("retention", "plan", "--max-segments", "-2")
    assert out.returncode == 2 and "-2" in out.stderr


async def test_reads_of_an_expired_session_work_on_what_is_left(storage: Path, tmp_path: Path) -> None:
    msgs = await _with_prompt_and_pin(storage, "seg")
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    [row] = report["segments_expired"]
    b = load_manifest(storage / "seg", "seg").boundary  # type: ignore[union-attr]
    assert b is not None
    # verify: clean, the chain checked from the boundary; it says what expired
    r = verify(storage / "seg", "seg")
    assert r.ok and r.first_seq == row["last_seq"] + 1 and r.gaps == [] and r.expired == {
        "last_seq": b.last_seq, "expired_seq": b.expired_seq, "start": b.start}
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    want = await store.get_messages()
    # time travel: from the expired record on; before it, a clear error
    past = await store.at(b.expired_seq)
    assert await past.get_messages() == want
    await past.close()
    with pytest.raises(RecordsExpiredError, match=f"the state at seq 5 .*seqs 1..{b.last_seq},"):
        await store.at(5)
    with pytest.raises(RecordsExpiredError):
        await store.fork("other", at_seq=b.expired_seq - 1)
    await store.fork("other")
    await store.export(tmp_path / "out.jsonl")
    await store.close()
    assert "be brief" in (tmp_path / "out.jsonl").read_text()  # the carried system prompt is exported
    other = await PersistentContextManager.open(storage_path=storage, session_id="other")
    assert await other.get_messages() == want
    await other.close()
    with pytest.raises(RecordsExpiredError, match="position 0"):
        read_line_at(storage / "seg", 0)
    assert json.loads(read_line_at(storage / "seg", b.start))["seq"] == b.last_seq + 1
    with LogReader(storage / "seg") as reader:
        assert [json.loads(line)["seq"] for _, line in reader.lines(0)][0] == b.last_seq + 1


async def test_a_manifest_boundary_is_checked(storage: Path) -> None:
    await _with_prompt_and_pin(storage, "seg")
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    path = storage / "seg" / "segments.json"
    doc = json.loads(path.read_bytes())
    for change, words in ((lambda d: d["boundary"].update(start=d["boundary"]["start"] + 1), "the recorded boundary"),
                          (lambda d: d["boundary"].update(last_crc="xyz"), "'last_crc' must match"),
                          (lambda d: d.pop("boundary"), "it must start at 0")):
        bad = json.loads(json.dumps(doc))
        change(bad)
        os.chmod(path, 0o600)
        path.write_bytes(json.dumps(bad).encode())
        with pytest.raises(ManifestError, match=words):
            load_manifest(storage / "seg", "seg")
    path.write_bytes(json.dumps(doc).encode())
    # an expired record that is not the one the boundary names is corruption, never skipped
    bad = json.loads(json.dumps(doc))
    bad["boundary"]["expired_seq"] = bad["boundary"]["last_seq"] + 1
    path.write_bytes(json.dumps(bad).encode())
    with pytest.raises(LogCorruptedError, match="not the expired record the segment manifest names"):
        await PersistentContextManager.open(storage_path=storage, session_id="seg", readonly=True)
    path.write_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("keep", [0, 1])
async def test_erase_after_expiry(storage: Path, keep: int) -> None:
    """Erasure rewrites surviving records (positions after the boundary may move: the expired record is found
    by its seq); a carried message is erased from the expired record (tests/test_erase_expired.py)."""
    msgs = await _with_prompt_and_pin(storage, "seg", 40)
    await trash.apply_file(storage, RetentionPolicy(max_segments=keep))
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg", segment_bytes=4096)
    for i in range(30):
        await store.add_message({"role": "user", "content": f"more {i} " + "y" * 300})
    before = await store.get_messages()
    receipt = await store.erase(5)
    assert await store.verify_erasure(receipt) == []
    receipt = await store.erase(1)  # the pinned message, carried by the expired record
    assert await store.verify_erasure(receipt) == []
    want = before[:1] + before[2:5] + before[6:]
    assert await store.get_messages() == want and want[:2] == [msgs[0], before[2]]
    await store.close()
    assert verify(storage / "seg", "seg").ok
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    assert await store.get_messages() == want
    await store.close()


async def test_repair_after_expiry_sees_no_gap(storage: Path) -> None:
    """The records before the boundary are expired, not missing: repair finds nothing to do; a damaged record
    after the boundary is still found and quarantined, the boundary kept."""
    await _with_prompt_and_pin(storage, "seg")
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    result = repair(storage / "seg", "seg")
    assert not result.changed and result.gaps == []
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    want = await store.get_messages()
    await store.add_message({"role": "user", "content": "last"})
    await store.close()
    active = storage / "seg" / "events.jsonl"
    data = active.read_bytes()
    active.write_bytes(data[:-3] + b"x}\n")  # the last record's checksum no longer holds
    result = repair(storage / "seg", "seg")
    assert result.changed and len(result.quarantined) == 1
    assert load_manifest(storage / "seg", "seg").boundary is not None  # type: ignore[union-attr]
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    assert await store.get_messages() == want
    await store.close()
    assert verify(storage / "seg", "seg").ok
