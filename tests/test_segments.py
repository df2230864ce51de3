"""Segmented file logs: rolling, the manifest, reading by global position, open with a checkpoint, verify."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager, codec
from context_persistent.errors import LogCorruptedError
from context_persistent.repair import verify
from context_persistent.segments import MANIFEST_NAME, LogReader, ManifestError, read_line_at

SID = "seg"


async def _fill(storage: Path, n: int, sid: str = SID, **config: Any) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid, **config)
    try:
        for i in range(n):
            await store.add_message({"role": "user", "content": f"message {i} " + "x" * 200})
        return await store.get_messages()
    finally:
        await store.close()


def _manifest(storage: Path, sid: str = SID) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads((storage / sid / MANIFEST_NAME).read_bytes())
    return doc


def _all_lines(storage: Path, sid: str = SID) -> list[tuple[int, bytes]]:
    with LogReader(storage / sid) as reader:
        return list(reader.lines(0))


async def test_the_log_rolls_at_segment_bytes_and_every_record_stays(storage: Path) -> None:
    messages = await _fill(storage, 120, segment_bytes=4096)
    folder = storage / SID
    doc = _manifest(storage)
    segs = doc["segments"]
    assert len(segs) >= 5 and doc["pending"] == []
    start, seq = 0, 0
    for s in segs:
        path = folder / s["name"]
        data = path.read_bytes()
        assert s["start"] == start and s["end"] - s["start"] == len(data) == s["size"]
        assert s["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert stat.S_IMODE(path.stat().st_mode) == 0o400  # sealed: read-only
        records = [codec.decode(line) for line in data.splitlines(keepends=True)]
        assert records[0]["seq"] == s["first_seq"] == seq + 1 and records[-1]["seq"] == s["last_seq"]
        assert records[0]["crc"] == s["first_crc"] and records[-1]["crc"] == s["last_crc"]
        assert len(data) >= 4096  # rolled once the size was passed, not before
        start, seq = s["end"], s["last_seq"]
    assert stat.S_IMODE((folder / MANIFEST_NAME).stat().st_mode) == 0o600
    # the first record of each segment names the last one of the segment before it
    for a, b in zip(segs, segs[1:]):
        first = codec.decode((folder / b["name"]).read_bytes().split(b"\n", 1)[0] + b"\n")
        assert first["prev"] == a["last_crc"]
    again = PersistentContextManager
    store = await again.open(storage_path=storage, session_id=SID, readonly=True)
    assert await store.get_messages() == messages
    await store.close()
    store = await again.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    assert await store.get_messages() == messages
    await store.add_message({"role": "assistant", "content": "after reopening"})
    await store.close()
    assert len(await _reopen_messages(storage)) == 121


async def _reopen_messages(storage: Path, **config: Any) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, **config)
    try:
        return await store.get_messages()
    finally:
        await store.close()


async def test_no_rolling_with_segment_bytes_zero_and_roll_on_request(storage: Path) -> None:
    await _fill(storage, 60, segment_bytes=0)
    assert not (storage / SID / MANIFEST_NAME).exists()  # a single-file log, exactly as before
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0)
    seg = store._log.roll()
    assert seg is not None and seg.first_seq == 1 and seg.last_seq == 61
    assert store._log.roll() is None  # an empty active segment is not sealed
    await store.add_message({"role": "user", "content": "next"})
    await store.close()
    assert [s["name"] for s in _manifest(storage)["segments"]] == ["segment-000001.jsonl"]
    assert len(await _reopen_messages(storage)) == 61


@pytest.mark.parametrize("value", [-1, 100, 4095, "64MiB", 1.5, True])
async def test_segment_bytes_is_validated(storage: Path, value: Any) -> None:
    with pytest.raises(ValueError, match="segment_bytes must be 0 or null"):
        await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=value)
    assert not (storage / SID).exists()


async def test_compress_sealed_is_validated(storage: Path) -> None:
    with pytest.raises(ValueError, match="compress_sealed must be true or false"):
        await PersistentContextManager.open(storage_path=storage, session_id=SID, compress_sealed="yes")


@pytest.mark.parametrize("compress", [False, True])
async def test_read_line_at_every_position(storage: Path, compress: bool) -> None:
    await _fill(storage, 150, segment_bytes=8192, compress_sealed=compress)
    folder = storage / SID
    lines = _all_lines(storage)
    assert [codec.decode(line)["seq"] for _, line in lines] == list(range(1, 152))
    with LogReader(folder) as reader:
        assert bool(reader.segments) and all((s.compressed is not None) == compress for s in reader.segments)
        for pos, line in lines:
            assert reader.read_line_at(pos) == line
        end = lines[-1][0] + len(lines[-1][1])
        assert reader.end() == end
        for pos, line in lines[1:]:
            assert reader.line_ending_at(pos) == lines[[p for p, _ in lines].index(pos) - 1][1]
        with pytest.raises(ValueError, match="at or past the end"):
            reader.read_line_at(end)
        with pytest.raises(ValueError, match="integer >= 0"):
            reader.read_line_at(-1)
    assert read_line_at(folder, lines[77][0]) == lines[77][1]


async def test_a_random_read_in_a_compressed_segment_decompresses_one_frame(storage: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0,
                                                compress_sealed=True)
    for i in range(1500):  # about 400 KiB: more than one frame
        await store.add_message({"role": "user", "content": f"m{i} " + "y" * 200})
    store._log.roll()
    await store.close()
    from context_persistent import segments

    calls: list[int] = []
    real = segments.decompress_frame
    monkeypatch.setattr(segments, "decompress_frame", lambda frame, size: calls.append(size) or real(frame, size))
    lines = _all_lines(storage)
    with LogReader(storage / SID) as reader:
        seg = reader.segments[0]
        assert seg.compressed is not None and len(seg.compressed.frames) >= 2
        calls.clear()
        pos, line = lines[1200]
        assert reader.read_line_at(pos) == line
        assert len(calls) == 1 and calls[0] <= 256 << 10


async def test_compressed_segments_read_with_zstd_tools(storage: Path) -> None:
    await _fill(storage, 150, segment_bytes=8192, compress_sealed=True)
    import zstandard

    folder = storage / SID
    names = [s["name"] for s in _manifest(storage)["segments"]]
    plain = b""
    for name in names:
        assert not (folder / name).exists() and (folder / (name + ".zst")).exists()
        with open(folder / (name + ".zst"), "rb") as f:  # all frames, as zstdcat reads them
            data = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()
        plain += data
        for line in data.splitlines(keepends=True):
            codec.decode(line)
    active = (folder / "events.jsonl").read_bytes()
    assert b"".join(line for _, line in _all_lines(storage)) == plain + active
    zstdcat = shutil.which("zstdcat")
    if zstdcat:
        out = subprocess.run([zstdcat, *[str(folder / (n + ".zst")) for n in names]], capture_output=True,
                             check=True).stdout
        assert out == plain


async def test_open_with_a_checkpoint_reads_no_sealed_segment(storage: Path) -> None:
    messages = await _fill(storage, 120, segment_bytes=4096, checkpoint_every=100)
    folder = storage / SID
    assert (folder / "checkpoint.json").exists()
    doc = _manifest(storage)
    position = verify(folder, SID).checkpoint["position"]
    before = [s for s in doc["segments"] if s["end"] < position]
    assert len(before) >= 3
    # Damage every sealed segment before the one holding the checkpoint's position (same size, garbage): an
    # open that read one would fail.
    for s in before:
        p = folder / s["name"]
        os.chmod(p, 0o600)
        p.write_bytes(b"z" * s["size"])
    assert await _reopen_messages(storage, segment_bytes=4096) == messages
    report = verify(folder, SID)
    assert not report.ok and {p.kind for p in report.problems} >= {"segment"}
    (folder / "checkpoint.json").unlink()
    with pytest.raises(LogCorruptedError):
        await _reopen_messages(storage, segment_bytes=4096)


async def test_verify_checks_checksums_and_the_chain_across_segments(storage: Path) -> None:
    await _fill(storage, 120, segment_bytes=4096)
    folder = storage / SID
    report = verify(folder, SID)
    assert report.ok, report.problems
    assert report.segments == [s["name"] for s in _manifest(storage)["segments"]]
    assert report.records == 121 and report.last_seq == 121
    # A byte flipped in a sealed segment: its checksum no longer matches the manifest.
    second = folder / _manifest(storage)["segments"][1]["name"]
    os.chmod(second, 0o600)
    data = bytearray(second.read_bytes())
    data[40] ^= 0x01
    second.write_bytes(bytes(data))
    report = verify(folder, SID)
    seg_problems = [p for p in report.problems if p.kind == "segment"]
    assert len(seg_problems) == 1 and second.name in seg_problems[0].reason and not report.ok


async def test_verify_finds_a_segment_from_another_log(storage: Path, tmp_path: Path) -> None:
    """Two logs with the same records except one message: segment 2 of the other log, with a manifest that
    matches it, still breaks the chain at its first record (it names a crc the segment before lacks)."""
    await _fill(storage, 60, segment_bytes=4096)
    other = tmp_path / "other"
    store = await PersistentContextManager.open(storage_path=other, session_id=SID, segment_bytes=4096)
    await store.add_message({"role": "user", "content": "message 0 " + "y" * 200})  # same size, other bytes
    for i in range(1, 60):
        await store.add_message({"role": "user", "content": f"message {i} " + "x" * 200})
    await store.close()
    mine, theirs = _manifest(storage), _manifest(other)
    a, b = mine["segments"][1], theirs["segments"][1]
    assert (a["start"], a["end"], a["first_seq"]) == (b["start"], b["end"], b["first_seq"])
    target = storage / SID / a["name"]
    os.chmod(target, 0o600)
    target.write_bytes((other / SID / b["name"]).read_bytes())
    mine["segments"][1] = b
    (storage / SID / MANIFEST_NAME).write_bytes(orjson.dumps(mine))
    report = verify(storage / SID, SID)
    assert any(p.kind == "link" for p in report.problems), report.problems
    with pytest.raises(LogCorruptedError, match="seq"):
        await _reopen_messages(storage)


async def test_a_bad_manifest_is_refused_with_what_is_wrong(storage: Path) -> None:
    await _fill(storage, 60, segment_bytes=4096)
    path = storage / SID / MANIFEST_NAME
    good = path.read_bytes()
    doc = orjson.loads(good)
    doc["segments"][1]["start"] += 1
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(ManifestError, match="segment 2 .* must start at"):
        await _reopen_messages(storage)
    path.write_bytes(b"{not json")
    with pytest.raises(ManifestError, match="not JSON"):
        await _reopen_messages(storage)
    doc = orjson.loads(good)
    doc["session_id"] = "other"
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(ManifestError, match="names session 'other'"):
        await _reopen_messages(storage)
    path.write_bytes(good)
    assert len(await _reopen_messages(storage)) == 60


async def test_follow_reads_across_rolls(storage: Path) -> None:
    import asyncio
    import contextlib

    from context_persistent.follow import follow_file

    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    seen: list[int] = []
    stop = asyncio.Event()

    async def reader() -> None:
        async with contextlib.aclosing(follow_file(storage / SID / "events.jsonl", 0, stop_event=stop,
                                                   poll_interval=0.05)) as stream:
            async for rec in stream:
                seen.append(rec["seq"])
                if rec["seq"] == 101:
                    return

    task = asyncio.ensure_future(reader())
    for i in range(100):
        await store.add_message({"role": "user", "content": f"m{i} " + "z" * 200})
        if i % 10 == 0:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(task, 20)
    await store.close()
    assert seen == list(range(1, 102))
    assert len(_manifest(storage)["segments"]) >= 4
    # a follower that starts late reads the sealed segments first
    late: list[int] = []
    stop.set()
    async with contextlib.aclosing(follow_file(storage / SID / "events.jsonl", 50, stop_event=stop)) as stream:
        async for rec in stream:
            late.append(rec["seq"])
    assert late == list(range(51, 102))


async def test_roll_on_compaction_seals_the_write_that_records_the_compaction(storage: Path) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0,
                                                roll_on_compaction=True)
    for i in range(40):
        await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w" * 300})
    view = await store.get_messages_for_request(token_budget=2000)
    assert len(view) < 40  # compacted
    assert not (storage / SID / MANIFEST_NAME).exists()  # a view is a read: nothing written yet
    await store.add_message({"role": "user", "content": "next"})
    segs = _manifest(storage)["segments"]
    assert len(segs) == 1
    # the audit record goes out with the next append (before its event), then the segment is sealed
    tail = [codec.decode(line) for line in (storage / SID / segs[0]["name"]).read_bytes().splitlines(keepends=True)[-2:]]
    assert [r["type"] for r in tail] == ["compacted", "message_added"] and tail[1]["seq"] == segs[0]["last_seq"]
    assert (storage / SID / "events.jsonl").stat().st_size == 0
    await store.close()
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0)
    await store.get_messages_for_request(token_budget=2000)
    await store.add_message({"role": "user", "content": "without the option: no roll"})
    await store.close()
    assert len(_manifest(storage)["segments"]) == 1


def _cli(*args: str, storage: Path) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "context_persistent", "--storage", str(storage), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("compress", [False, True])
async def test_migrate_converts_a_single_file_log_and_keeps_the_checkpoint_valid(storage: Path,
                                                                                  compress: bool) -> None:
    messages = await _fill(storage, 100, segment_bytes=0, checkpoint_every=50)
    folder = storage / SID
    old = (folder / "events.jsonl").read_bytes()
    assert not (folder / MANIFEST_NAME).exists() and (folder / "checkpoint.json").exists()
    args = ["migrate", SID, "--segment-bytes", "5000"] + (["--compress"] if compress else [])
    out = _cli(*args, storage=storage)
    assert out.returncode == 0, out.stderr
    assert "migrated session seg" in out.stdout and "sealed segment(s)" in out.stdout
    doc = _manifest(storage)
    assert doc["pending"] == [] and len(doc["segments"]) >= 3
    assert all((s["compressed"] is not None) == compress for s in doc["segments"])
    assert (folder / "events.jsonl").read_bytes() == b""
    assert b"".join(line for _, line in _all_lines(storage)) == old  # positions are the old offsets
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp")) == []
    report = verify(folder, SID)
    assert report.ok and report.checkpoint["status"] == "valid", report
    assert await _reopen_messages(storage) == messages
    again = _cli("migrate", SID, storage=storage)
    assert again.returncode == 0 and "already segmented" in again.stdout


async def test_migrate_refuses_what_it_cannot_do(storage: Path) -> None:
    await _fill(storage, 10, segment_bytes=0)
    assert _cli("migrate", "nope", storage=storage).returncode == 1
    bad = _cli("migrate", SID, "--segment-bytes", "12", storage=storage)
    assert bad.returncode == 2 and "segment_bytes must be 0 or null" in bad.stderr
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    locked = _cli("migrate", SID, storage=storage)
    await store.close()
    assert locked.returncode == 1 and "needs the session to itself" in locked.stderr
    with open(storage / SID / "events.jsonl", "ab") as f:
        f.write(b'{"v":2,"seq":11,"half a rec')
    torn = _cli("migrate", SID, storage=storage)
    assert torn.returncode == 1 and "torn tail" in torn.stderr
    assert not (storage / SID / MANIFEST_NAME).exists()
