"""Torn writes and flipped bits, at every byte of the last record and at random places in the middle."""

from __future__ import annotations

import base64
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import LogCorruptedError, PersistentContextManager
from context_persistent.cli import main
from context_persistent.model.codec import encode_event
from context_persistent.storage.paths import LOG_NAME
from context_persistent.operations.repair import QUARANTINE_PREFIX, TORN_PREFIX, repair, verify
from conftest import PYTHON

SESSION = "s"
N = 12  # messages; the log holds session_started + N records


class Hooks:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def emit(self, event: str, data: dict[str, Any]) -> None:
        self.events.append((event, data))


def msg(i: int) -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": f"message {i} " + "é✓" * (i % 5)}


async def _build(storage: Path) -> tuple[bytes, list[int]]:
    """A session with N messages; returns the log bytes and the start offset of every record (+ the end)."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION) as store:
        for i in range(N):
            await store.add_message(msg(i))
    data = (storage / SESSION / LOG_NAME).read_bytes()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return data, starts


def _reset(folder: Path, data: bytes) -> None:
    for p in folder.iterdir():
        if p.name != "lock":
            p.unlink()
    (folder / LOG_NAME).write_bytes(data)


async def _messages(storage: Path, hooks: Hooks | None = None, fsync: str = "always") -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION, hooks=hooks,
                                                   fsync=fsync) as store:
        return await store.get_messages()


def _flip(data: bytes, pos: int, bit: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 1 << bit
    return bytes(out)


async def _assert_tail_recovered(storage: Path, damaged: bytes, last_start: int, kept: int = N - 1,
                                 fsync: str = "always") -> None:
    folder = storage / SESSION
    _reset(folder, damaged)
    hooks = Hooks()
    assert await _messages(storage, hooks, fsync) == [msg(i) for i in range(kept)]
    assert (folder / LOG_NAME).read_bytes() == damaged[:last_start]
    sides = [p for p in folder.iterdir() if p.name.startswith(TORN_PREFIX)]
    assert len(sides) == 1 and sides[0].read_bytes() == damaged[last_start:]
    [(event, data)] = hooks.events
    assert event == "context:recovered"
    assert (data["offset"], data["length"], data["line"]) == (last_start, len(damaged) - last_start, kept + 2)
    assert data["saved_to"] == str(sides[0])


async def test_torn_write_at_every_byte_of_the_last_record_recovers_the_exact_prefix(storage: Path) -> None:
    """A log cut at any byte inside its last record opens as the exact valid prefix; the cut bytes go to a side file."""
    data, starts = await _build(storage)
    last_start = starts[-2]
    for cut in range(last_start + 1, len(data)):
        await _assert_tail_recovered(storage, data[:cut], last_start)


async def test_bit_flip_at_every_byte_of_the_last_record_with_fsync_never_recovers_the_exact_prefix(
        storage: Path) -> None:
    """fsync=never promised nothing durable: a flipped bit anywhere in the last record (checksum, JSON, newline)
    is cut as a torn tail (saved to a side file), never loaded."""
    data, starts = await _build(storage)
    last_start = starts[-2]
    for pos in range(last_start, len(data)):
        await _assert_tail_recovered(storage, _flip(data, pos, pos % 8), last_start, fsync="never")


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_bit_flip_in_a_complete_last_record_is_corruption_not_a_torn_tail(storage: Path, fsync: str) -> None:
    """With the records synced, a crash leaves an unterminated line or NUL bytes, never a complete bad line: a
    flipped bit in the last complete record is corruption (open refuses, nothing is cut, verify says corrupt).
    Only a flip of its newline makes it unterminated, which a crash can leave: that is cut as a torn tail."""
    data, starts = await _build(storage)
    last_start = starts[-2]
    folder = storage / SESSION
    for pos in range(last_start, len(data)):
        damaged = _flip(data, pos, pos % 8)
        if pos == len(data) - 1:
            await _assert_tail_recovered(storage, damaged, last_start, fsync=fsync)
            continue
        _reset(folder, damaged)
        with pytest.raises(LogCorruptedError, match=f"line {N + 1} .*no crash leaves behind") as info:
            await _messages(storage, fsync=fsync)
        assert info.value.offset == last_start
        assert (folder / LOG_NAME).read_bytes() == damaged
        assert not [p for p in folder.iterdir() if p.name.startswith(TORN_PREFIX)]
    _reset(folder, _flip(data, last_start + 5, 1))
    report = verify(folder, SESSION)
    assert [(p.kind, p.offset) for p in report.problems] == [("corrupt", last_start)]
    assert "no crash leaves" in report.problems[0].reason


async def test_a_record_torn_by_a_hole_is_still_a_torn_tail(storage: Path) -> None:
    """Space the file system had not written yet reads as NUL bytes: a complete line holding them is torn."""
    data, starts = await _build(storage)
    last_start = starts[-2]
    hole = data[:last_start + 10] + b"\0" * 20 + data[last_start + 30:]
    await _assert_tail_recovered(storage, hole, last_start)


async def test_several_garbage_lines_after_the_last_record_are_one_torn_tail(storage: Path) -> None:
    """Bad lines with no valid record after them (e.g. zero-filled blocks after a power cut) are all cut."""
    data, starts = await _build(storage)
    damaged = data + b"\x00" * 300 + b"\nnot a record\n" + b'{"v":1,"seq":99'
    await _assert_tail_recovered(storage, damaged, len(data), kept=N)


def _record_index(starts: list[int], pos: int) -> int:
    return max(i for i, s in enumerate(starts) if s <= pos)


async def test_corruption_in_the_middle_names_file_line_and_offset_and_repair_keeps_every_valid_record(
        storage: Path) -> None:
    """A flipped bit before the last record makes open fail naming the file, line and offset; repair then
    keeps every other record and quarantines exactly the damaged bytes."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    rng = random.Random(7)
    # Every record but session_started and the last; the newline ending a record is included (it merges
    # two lines, and the record after it must survive repair).
    positions = rng.sample(range(starts[1], starts[-2]), 25) + [starts[5] - 1]
    for pos in positions:
        k = _record_index(starts, pos)  # 0-based record index; its line is k + 1
        damaged = _flip(data, pos, rng.randrange(8))
        _reset(folder, damaged)
        with pytest.raises(LogCorruptedError) as info:
            await _messages(storage)
        err = info.value
        assert (err.path, err.line, err.offset) == (str(folder / LOG_NAME), k + 1, starts[k])
        assert f"line {k + 1} (byte offset {starts[k]})" in str(err)
        assert (folder / LOG_NAME).read_bytes() == damaged, "a failed open must not change the log"

        report = verify(folder, SESSION)
        assert not report.ok and [p.kind for p in report.problems] in (["corrupt"], ["corrupt", "corrupt"])
        assert report.problems[0].offset == starts[k]

        result = repair(folder, SESSION)
        assert result.changed and result.kept == N  # session_started + N messages - the damaged one
        assert await _messages(storage) == [msg(i) for i in range(N) if i != k - 1]
        [qfile] = [p for p in folder.iterdir() if p.name.startswith(QUARANTINE_PREFIX)]
        entries = [json.loads(line) for line in qfile.read_text().splitlines()[1:]]
        raw = b"".join(e["raw"].encode() if "raw" in e else base64.b64decode(e["raw_b64"]) for e in entries)
        assert raw == damaged[starts[k]:starts[k + 1]]
        assert verify(folder, SESSION).ok


async def test_a_duplicate_seq_in_the_middle_is_refused_and_repair_quarantines_the_second(storage: Path) -> None:
    """A valid record whose seq does not increase is corruption; repair keeps the first and quarantines it."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    dup = data[starts[3]:starts[4]]
    damaged = data[:starts[4]] + dup + data[starts[4]:]
    _reset(folder, damaged)
    with pytest.raises(LogCorruptedError, match="seq 4 does not follow seq 4") as info:
        await _messages(storage)
    assert (info.value.line, info.value.offset) == (5, starts[4])
    result = repair(folder, SESSION)
    assert [p.kind for p in result.quarantined] == ["seq"]
    assert await _messages(storage) == [msg(i) for i in range(N)]


async def test_repair_leaves_seq_gaps_records_them_and_open_continues_after_them(storage: Path) -> None:
    """After repair removed a record the seqs keep their gap, a log_repaired event explains it, and appends go on."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    _reset(folder, _flip(data, starts[6] + 20, 1))
    repair(folder, SESSION)
    lines = [orjson.loads(x) for x in (folder / LOG_NAME).read_bytes().splitlines()]
    seqs = [r["seq"] for r in lines]
    assert seqs == [s for s in range(1, N + 2) if s != 7] + [N + 2]
    assert lines[-1]["type"] == "log_repaired" and lines[-1]["data"]["gaps"] == [[6, 8]]
    async with await PersistentContextManager.open(storage_path=storage, session_id=SESSION) as store:
        await store.add_message(msg(99))
        assert store.head_seq == N + 3
    assert (await _messages(storage))[-1] == msg(99)
    report = verify(folder, SESSION)
    assert report.ok and [(g.after_seq, g.next_seq, g.explained) for g in report.gaps] == [(6, 8, True)]


async def test_an_unexplained_gap_fails_verify_and_repair_records_it(storage: Path) -> None:
    """A record deleted by hand leaves a gap verify reports; repair records it and verify is clean again."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    _reset(folder, data[:starts[4]] + data[starts[5]:])
    report = verify(folder, SESSION)
    assert not report.ok and [(g.after_seq, g.next_seq, g.explained) for g in report.gaps] == [(4, 6, False)]
    result = repair(folder, SESSION)
    assert result.changed and result.quarantined == [] and result.quarantine_file is None
    assert verify(folder, SESSION).ok


async def test_repair_of_a_clean_log_changes_nothing(storage: Path) -> None:
    """repair on a healthy session leaves the log byte-identical."""
    data, _ = await _build(storage)
    result = repair(storage / SESSION, SESSION)
    assert not result.changed and result.kept == N + 1
    assert (storage / SESSION / LOG_NAME).read_bytes() == data


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_verify_and_repair_commands_report_exit_codes_and_json(
        storage: Path, subprocess_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """verify exits 1 with each bad record's line and offset (text and --json); repair fixes; verify then exits 0."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    _reset(folder, _flip(data, starts[3] + 40, 2) + b'{"v":1,"se')
    proc = subprocess.run([PYTHON, "-m", "context_persistent", "verify", SESSION, "--storage", str(storage)],
                          capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert proc.returncode == 1
    assert f"corrupt record at line 4 (byte offset {starts[3]}" in proc.stdout
    assert f"torn tail at line {N + 2} (byte offset {len(data)}" in proc.stdout
    code, out, _ = _cli(capsys, "verify", SESSION, "--storage", str(storage), "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [(p["kind"], p["line"], p["offset"]) for p in report["problems"]] == [
        ("corrupt", 4, starts[3]), ("torn", N + 2, len(data))]
    code, out, _ = _cli(capsys, "repair", SESSION, "--storage", str(storage))
    assert code == 0 and "quarantined corrupt record at line 4" in out and "rebuilt the log atomically" in out
    code, out, _ = _cli(capsys, "verify", SESSION, "--storage", str(storage))
    assert code == 0 and "verdict: clean" in out
    code, _, err = _cli(capsys, "verify", "nope", "--storage", str(storage))
    assert code == 1 and "not found" in err
    code, _, err = _cli(capsys, "repair", "../x", "--storage", str(storage))
    assert code == 2 and "session_id" in err


async def test_a_newline_lost_between_two_records_loses_only_the_damaged_one(storage: Path) -> None:
    """Two records merged into one line by a damaged newline: repair salvages the intact second record."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    damaged = data[:starts[4] - 1] + b"#" + data[starts[4]:]
    _reset(folder, damaged)
    with pytest.raises(LogCorruptedError):
        await _messages(storage)
    repair(folder, SESSION)
    assert await _messages(storage) == [msg(i) for i in range(N) if i != 2]


async def test_a_record_line_appended_by_hand_without_checksum_is_not_loaded(storage: Path) -> None:
    """A hand-written line without a valid checksum in the middle is refused, never skipped."""
    data, starts = await _build(storage)
    folder = storage / SESSION
    line = encode_event(3, "message_added", {"message": msg(0)})
    forged = line[:-11] + b'00000000"}\n'  # a plausible record whose checksum is wrong
    _reset(folder, data[:starts[3]] + forged + data[starts[3]:])
    with pytest.raises(LogCorruptedError, match="line 4"):
        await _messages(storage)
