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

from context_persistent import PersistentContextManager

from context_persistent.model import codec
from context_persistent.errors import LogCorruptedError
from context_persistent.operations.repair import verify
from context_persistent.storage.segments import MANIFEST_NAME, LogReader, ManifestError, read_line_at

from checkpoint_files import strip_message_section

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
        with pytest.raises(LogCorruptedError, match="no complete record starts"):
            reader.read_line_at(end)
        with pytest.raises(ValueError, match="integer >= 0"):
            reader.read_line_at(-1)
    assert read_line_at(folder, lines[77][0]) == lines[77][1]
    assert read_line_at(folder / "events.jsonl", lines[-1][0]) == lines[-1][1]  # (the log file names it too)


async def test_a_random_read_in_a_compressed_segment_decompresses_one_frame(storage: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=0,
                                                compress_sealed=True)
    for i in range(1500):  # about 400 KiB: more than one frame
        await store.add_message({"role": "user", "content": f"m{i} " + "y" * 200})
    store._log.roll()
    await store.close()
    from context_persistent.storage import segment_file
    calls: list[int] = []
    real = segment_file.decompress_frame
    monkeypatch.setattr(segment_file, "decompress_frame", lambda frame, size: calls.append(size) or real(frame, size))
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
    # The checkpoint's message section holds the history as the log held it when it was written: served from it,
    # nothing of the damaged segments is read (verify, below, reports them).
    async with await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096) as store:
        assert await store.get_messages() == messages and store._checkpoints.section_messages > 0
    strip_message_section(folder / "checkpoint.json")
    # Without it, open and the newest messages read none of them (the history keeps refs into the log); reading an
    # old message does, and the damage is an error, never a message skipped (docs/architecture.md, "Bounded memory").
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    try:
        assert await store.get_messages(last=5) == messages[-5:] and store.head_seq == len(messages) + 1
        with pytest.raises(LogCorruptedError):
            await store.get_messages()
    finally:
        await store.close()
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

    from context_persistent.storage.follow import follow_file

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


def _files_hold(folder: Path, needle: bytes) -> list[str]:
    """Files of the session folder holding ``needle`` (compressed segments decompressed)."""
    import zstandard

    out = []
    for p in folder.iterdir():
        data = p.read_bytes()
        if p.name.endswith(".zst"):
            data = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)
        if needle in data:
            out.append(p.name)
    return out


@pytest.mark.parametrize("compress", [False, True])
async def test_erase_rewrites_sealed_segments_and_the_active_one(storage: Path, compress: bool) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                compress_sealed=compress, checkpoint_every=30)
    secret = {"role": "user", "content": "my card number is 4111 1111 1111 1111"}
    await store.add_message(secret)
    for i in range(60):
        await store.add_message({"role": "user", "content": f"filler {i} " + "f" * 200})
    history = await store.get_messages()
    await store.set_messages(history)  # a replacement carries the message forward (sealed: it is large)
    await store.set_messages([secret, history[-1]])  # and a small one, in the active segment
    folder = storage / SID
    needle = orjson.dumps(secret)[1:-1]
    store._log._wait_compressing()  # (a compression in its worker thread replaces a file while it is listed)
    assert len(_files_hold(folder, b"4111 1111 1111 1111")) >= 2
    positions = [p for p, _ in _all_lines(storage)]
    receipt = await store.erase(seq=2, reason="gdpr")
    assert _files_hold(folder, b"4111 1111 1111 1111") == []
    assert needle not in b"".join(line for _, line in _all_lines(storage))
    seg_name = _manifest(storage)["segments"][0]["name"] + (".zst" if compress else "")
    where = {r["seq"]: r["segment"] for r in receipt["records"]}
    assert where[2] == seg_name and "events.jsonl" in where.values()
    assert receipt["log"]["rewritten"][0] == seg_name
    after = [p for p, _ in _all_lines(storage)]
    assert after[:1] == positions[:1] and len(after) == len(positions)  # (positions after the tombstone move)
    assert await store.verify_erasure(receipt) == []
    await store.add_message({"role": "user", "content": "after the erasure"})
    messages = await store.get_messages()
    await store.close()
    doc = _manifest(storage)
    assert doc["pending"] == [] and all(stat.S_IMODE((folder / (s["name"] + (".zst" if s["compressed"] else "")))
                                                     .stat().st_mode) == 0o400 for s in doc["segments"])
    report = verify(folder, SID)
    assert report.ok, report.problems
    assert await _reopen_messages(storage) == messages
    from context_persistent.operations.erasure import check_receipt

    assert check_receipt(folder, receipt) == []
    out = _cli("verify", SID, "--receipt", str(_write_receipt(storage, receipt)), storage=storage)
    assert out.returncode == 0, out.stdout + out.stderr


def _write_receipt(storage: Path, receipt: dict[str, Any]) -> Path:
    path = storage.parent / "receipt.json"
    path.write_bytes(orjson.dumps(receipt))
    return path


async def test_repair_fixes_the_active_segment_and_refuses_to_touch_a_sealed_one(storage: Path) -> None:
    from context_persistent.operations.repair import repair

    messages = await _fill(storage, 64, segment_bytes=4096)  # (sealed segments, and records in the active one)
    folder = storage / SID
    active = folder / "events.jsonl"
    data = active.read_bytes()
    assert data.count(b"\n") >= 3
    lines = data.splitlines(keepends=True)
    damaged = lines[0] + b"garbage that is no record\n" + b"".join(lines[1:])
    active.write_bytes(damaged)
    with pytest.raises(LogCorruptedError):
        await _reopen_messages(storage)
    result = repair(folder, SID)
    assert result.changed and [p.kind for p in result.quarantined] == ["corrupt"] and not result.unfixable
    assert active.read_bytes().startswith(data)  # the records kept byte for byte, then the audit record
    assert verify(folder, SID).ok
    assert await _reopen_messages(storage) == messages
    # damage inside a sealed segment: reported, never rewritten
    first = folder / _manifest(storage)["segments"][0]["name"]
    os.chmod(first, 0o600)
    raw = bytearray(first.read_bytes())
    raw[30] ^= 0x02
    first.write_bytes(bytes(raw))
    result = repair(folder, SID)
    assert not result.changed and any(p.kind == "segment" for p in result.unfixable)
    assert first.read_bytes() == bytes(raw)
    out = _cli("repair", SID, storage=storage)
    assert out.returncode == 1 and "restore it from a backup" in out.stdout


async def test_the_command_line_reads_segmented_logs(storage: Path, tmp_path: Path) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                compress_sealed=True)
    for i in range(50):
        await store.add_message({"role": "user", "content": f"message {i} " + "x" * 200})
    store._log.roll()  # the active segment is empty: the newest record is in a sealed, compressed segment
    await store.close()
    assert (storage / SID / "events.jsonl").stat().st_size == 0
    show = _cli("show", SID, "--json", storage=storage)
    assert show.returncode == 0 and len(orjson.loads(show.stdout)["messages"]) == 50
    at = _cli("show", SID, "--at", "11", "--json", storage=storage)
    assert at.returncode == 0 and len(orjson.loads(at.stdout)["messages"]) == 10
    export = _cli("export", SID, str(tmp_path / "out.jsonl"), storage=storage)
    assert export.returncode == 0, export.stderr
    tail = _cli("tail", SID, "-n", "3", "--json", storage=storage)
    assert tail.returncode == 0 and [orjson.loads(x)["seq"] for x in tail.stdout.splitlines()] == [49, 50, 51]
    follow = _cli("tail", SID, "-f", "--after", "0", "--until-seq", "51", "--json", "--timeout", "60",
                  storage=storage)
    assert follow.returncode == 0 and [orjson.loads(x)["seq"] for x in follow.stdout.splitlines()] == list(range(1, 52))
    ls = _cli("ls", "--json", storage=storage)
    assert ls.returncode == 0 and SID in ls.stdout
    row = orjson.loads(ls.stdout)["sessions"][0]
    assert row["last_activity"] is not None and row["bytes"] > 10000
    stats = _cli("stats", SID, "--json", storage=storage)
    assert stats.returncode == 0 and orjson.loads(stats.stdout)["bytes"] == row["bytes"]
    fork = _cli("fork", SID, "child", "--at", "21", storage=storage)
    assert fork.returncode == 0, fork.stderr
    child = await PersistentContextManager.open(storage_path=storage, session_id="child", readonly=True)
    assert len(await child.get_messages()) == 20
    await child.close()


async def test_zstandard_is_imported_only_for_compressed_segments(storage: Path) -> None:
    import sys

    await _fill(storage, 60, segment_bytes=4096)
    code = ("import asyncio, sys\n"
            "import context_persistent\n"
            "assert 'zstandard' not in sys.modules, 'imported by import context_persistent'\n"
            "from context_persistent import PersistentContextManager\n"
            "async def main():\n"
            f"    s = await PersistentContextManager.open(storage_path={str(storage)!r}, session_id={SID!r})\n"
            "    assert len(await s.get_messages()) == 60\n"
            "    await s.close()\n"
            "asyncio.run(main())\n"
            "assert 'zstandard' not in sys.modules, 'imported to read plain segments'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


async def test_rolling_with_a_reserved_tail_seals_no_zeros(storage: Path) -> None:
    messages = await _fill(storage, 80, segment_bytes=4096, reserve_tail=True)
    folder = storage / SID
    for s in _manifest(storage)["segments"]:
        assert b"\0" not in (folder / s["name"]).read_bytes()
    assert verify(folder, SID).ok
    assert await _reopen_messages(storage, reserve_tail=True) == messages


async def test_a_follower_continues_across_an_erase_in_a_sealed_segment(storage: Path) -> None:
    import asyncio

    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    await store.add_message({"role": "user", "content": "short secret"})  # its tombstone is longer
    for i in range(40):
        await store.add_message({"role": "user", "content": f"message {i} " + "x" * 200})
    seen: list[int] = []

    async def follow() -> None:
        async for rec in store.follow(after_seq=0):
            seen.append(rec["seq"])
            if rec["seq"] == 44:
                return

    task = asyncio.ensure_future(follow())
    while len(seen) < 42:
        await asyncio.sleep(0.05)
    before = _manifest(storage)["segments"][0]
    await store.erase(seq=2)
    after = _manifest(storage)["segments"][0]
    assert after["sha256"] != before["sha256"] and after["end"] != before["end"]  # rewritten, ranges moved
    await store.add_message({"role": "user", "content": "x"})
    await store.add_message({"role": "user", "content": "y"})
    await asyncio.wait_for(task, 20)
    assert seen == list(range(1, 45))
    await store.close()


def test_segment_options_are_refused_for_postgres() -> None:
    from context_persistent.store.config import check_config

    for key in ("compress_sealed", "roll_on_compaction"):
        with pytest.raises(ValueError, match="apply to the file backend only"):
            check_config({"backend": "postgres", "dsn": "postgresql://u@h/db", key: True})
    assert check_config({"backend": "postgres", "dsn": "postgresql://u@h/db"})["segment_bytes"] > 0  # (unused there)


async def test_a_segment_is_verified_before_it_is_sealed(storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A record damaged before the checkpoint's position is not read by an open with the checkpoint; sealing
    reads every record and refuses, the append itself stays acknowledged and the log unchanged otherwise."""
    await _fill(storage, 60, segment_bytes=0, checkpoint_every=50)
    log = storage / SID / "events.jsonl"
    data = bytearray(log.read_bytes())
    at = data.index(b"message 3 ") + 12
    data[at] ^= 0x01
    log.write_bytes(bytes(data))
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    await store.add_message({"role": "user", "content": "acknowledged"})
    assert "could not seal the active segment" in caplog.text and "checksum mismatch" in caplog.text
    await store.add_message({"role": "user", "content": "and this one"})
    await store.close()
    assert not (storage / SID / MANIFEST_NAME).exists()
    assert log.read_bytes().startswith(bytes(data))
    assert any(p.kind == "corrupt" for p in verify(storage / SID, SID).problems)


def test_checked_seq_verifies_the_checksum_without_parsing() -> None:
    line = codec.encode_event(7, "message_added", {"message": {"role": "user", "content": "hi"}}, None,
                              codec.root_crc("x"))
    assert codec.checked_seq(line) == (7, codec.crc_of(line))
    bad = line.replace(b"hi", b"ho")
    with pytest.raises(codec.RecordError, match="checksum mismatch"):
        codec.checked_seq(bad)
    with pytest.raises(codec.RecordError, match="no checksum field"):
        codec.checked_seq(line[:40])


async def test_a_reader_of_more_segments_than_the_soft_open_file_limit_raises_it(storage: Path) -> None:
    """A reader holds one descriptor per sealed segment; with more segments than the soft limit allows it
    raises the limit toward the hard one instead of failing with EMFILE (run in a child: the limit is the
    process's)."""
    import sys

    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                segment_bytes=4096)
    try:
        for i in range(300):
            await store.add_message({"role": "user", "content": f"n {i} " + "x" * 1200})
    finally:
        await store.close()
    child = (
        "import resource, sys\n"
        "from context_persistent.storage.segments import LogReader\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (50, hard))\n"
        "with LogReader(sys.argv[1]) as r:\n"
        "    n = len(r.segments)\n"
        "    lines = sum(1 for _ in r.lines(0))\n"
        "print(n, lines, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", child, str(storage / "s")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    segments, lines, soft = map(int, out.stdout.split())
    assert segments > 50 and lines > 300 and soft > segments
