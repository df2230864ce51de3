"""The reading commands read only what they show: ``tail`` and followers only the end of a segmented log (the last
N records found from the end backwards, the records after a seq from the segment that holds it, by bisection
inside it), ``show``/``export --view request`` only the history messages the request view can hold."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager

from context_persistent.model import codec

from context_persistent.storage import segment_file, segments
from context_persistent.cli import main
from context_persistent.storage.follow import follow_file
from context_persistent.storage.paths import LOG_NAME
from context_persistent.storage.segments import LogReader

SID = "s"


def _fill(storage: Path, n: int, **config: Any) -> None:
    async def run() -> None:
        store = await PersistentContextManager.open(storage_path=storage, session_id=SID, fsync="never", **config)
        try:
            for i in range(n):
                await store.add_message({"role": "user", "content": f"message {i} " + "x" * 300})
        finally:
            await store.close()
    asyncio.run(run())


def _records(storage: Path) -> list[dict[str, Any]]:
    """Every record of the log, read from its start."""
    with LogReader(storage / SID) as reader:
        return [codec.decode(line) for _, line in reader.lines(0)]


class _Reads:
    """What a command read: the sealed segments it read from (a reader opens every file of its manifest at once,
    docs/format.md "Readers during an erasure or expiry": what counts is reading one), the zstd frames it
    decompressed, the records it decoded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read: list[str] = []
        self.frames = 0
        self.decoded = 0
        frame, decode = segment_file.decompress_frame, codec.decode

        def reading(method: Any) -> Any:
            def read(this: segment_file.SegmentFile, *args: Any) -> Any:
                if this.seg.name not in self.read:
                    self.read.append(this.seg.name)
                return method(this, *args)
            return read

        for name in ("frame", "chunks", "line_at", "line_ending_at"):
            monkeypatch.setattr(segment_file.SegmentFile, name, reading(getattr(segment_file.SegmentFile, name)))

        def decompressed(data: bytes, size: int) -> bytes:
            self.frames += 1
            return frame(data, size)

        def decoded(line: Any) -> dict[str, Any]:
            self.decoded += 1
            return decode(line)

        monkeypatch.setattr(segment_file, "decompress_frame", decompressed)
        monkeypatch.setattr(codec, "decode", decoded)


def _tail(capsys: pytest.CaptureFixture[str], storage: Path, *args: str) -> list[dict[str, Any]]:
    assert main(["--storage", str(storage), "tail", SID, "--json", *args]) == 0
    return [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]


def _manifest(storage: Path) -> list[dict[str, Any]]:
    segs: list[dict[str, Any]] = orjson.loads((storage / SID / segments.MANIFEST_NAME).read_bytes())["segments"]
    return segs


def test_tail_opens_only_the_last_segment(storage: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(storage, 200, segment_bytes=8192)
    segs = _manifest(storage)
    assert len(segs) >= 6
    everything = _records(storage)
    in_active = everything[-1]["seq"] - segs[-1]["last_seq"]
    assert in_active >= 2
    reads = _Reads(monkeypatch)
    n = in_active - 1  # (the record before them, where the read starts, is in the active segment too)
    assert _tail(capsys, storage, "-n", str(n)) == everything[-n:]
    assert reads.read == [] and reads.decoded <= 2 * n + 4  # the active segment's last lines only
    # The last segment holds fewer than N: the rest come from the end of the sealed segment before it.
    n = in_active + 4
    assert _tail(capsys, storage, "-n", str(n)) == everything[-n:]
    assert set(reads.read) == {segs[-1]["name"]} and reads.decoded <= 2 * n + 4
    # More than the log holds: every record, read from the start.
    assert _tail(capsys, storage, "-n", str(len(everything) + 5)) == everything
    assert _tail(capsys, storage, "-n", "0") == []


def test_tail_across_compressed_segments_reads_only_their_last_frames(storage: Path, capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(storage, 4000, segment_bytes=600_000, compress_sealed=True)
    segs = _manifest(storage)
    assert len(segs) >= 2 and all(len(s["compressed"]["frames"]) >= 3 for s in segs)  # (256 KiB frames)
    everything = _records(storage)
    reads = _Reads(monkeypatch)
    in_active = everything[-1]["seq"] - segs[-1]["last_seq"]
    n = in_active + 20
    assert _tail(capsys, storage, "-n", str(n)) == everything[-n:]
    assert set(reads.read) == {segs[-1]["name"]}
    # Its last frame only, decompressed by each of the three readers: the walk back from the end, the check
    # of the record the read starts after, the read.
    assert reads.frames <= 3
    # After a seq inside the last sealed segment: found by bisection over its frames, read from there on.
    last = segs[-1]
    after = (last["first_seq"] + last["last_seq"]) // 2
    reads.read.clear()
    reads.frames = 0
    assert _tail(capsys, storage, "--after", str(after)) == [r for r in everything if r["seq"] > after]
    assert set(reads.read) == {last["name"]}
    assert reads.frames <= 2 * len(last["compressed"]["frames"])  # (not the segments before)


def test_tail_after_a_seq_reads_from_the_segment_that_holds_it(storage: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(storage, 200, segment_bytes=8192)
    segs = _manifest(storage)
    everything = _records(storage)
    middle = segs[len(segs) // 2]
    after = (middle["first_seq"] + middle["last_seq"]) // 2
    reads = _Reads(monkeypatch)
    assert _tail(capsys, storage, "--after", str(after)) == [r for r in everything if r["seq"] > after]
    assert reads.read[0] == middle["name"] and not {s["name"] for s in segs[:len(segs) // 2]} & set(reads.read)
    # A seq past the head: the active segment is read from its start (after the last sealed record, checked),
    # and nothing is printed.
    reads.read.clear()
    assert _tail(capsys, storage, "--after", str(everything[-1]["seq"] + 10)) == []
    assert set(reads.read) == {segs[-1]["name"]}
    assert _tail(capsys, storage, "--after", "0") == everything


def test_tail_after_a_seq_of_a_long_single_file_log_bisects(storage: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without segments (one file of about 4 MB), the record is found by its seq without decoding the records
    before it."""
    _fill(storage, 10_000)
    assert not (storage / SID / segments.MANIFEST_NAME).exists()
    everything = _records(storage)
    reads = _Reads(monkeypatch)
    assert _tail(capsys, storage, "--after", "5000") == everything[5000:]
    assert reads.decoded < 5100
    reads.decoded = 0
    assert _tail(capsys, storage, "--after", str(everything[-4]["seq"])) == everything[-3:]
    assert reads.decoded < 100


def test_tail_skips_a_torn_tail_as_before(storage: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(storage, 50, segment_bytes=8192)
    everything = _records(storage)
    with open(storage / SID / LOG_NAME, "ab") as f:
        f.write(b'{"v":2,"seq":999,"ts":"2026-0')  # a write cut short by a crash
    assert _tail(capsys, storage, "-n", "2") == everything[-2:]


def test_follow_starts_at_its_seq_without_reading_the_segments_before(storage: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(storage, 200, segment_bytes=8192)
    segs = _manifest(storage)
    everything = _records(storage)
    second_last = segs[-2]
    after = second_last["first_seq"] + 1
    reads = _Reads(monkeypatch)

    async def follow() -> list[dict[str, Any]]:
        stop = asyncio.Event()
        stop.set()  # (read what is there, then end)
        async with contextlib.aclosing(follow_file(storage / SID / LOG_NAME, after, stop_event=stop,
                                                   poll_interval=0.05)) as records:
            return [rec async for rec in records]

    assert asyncio.run(follow()) == [r for r in everything if r["seq"] > after]
    assert set(reads.read) <= {second_last["name"], segs[-1]["name"]}
    assert reads.decoded <= 2 * len(everything[after - 1:]) + 10


# -- the request view -------------------------------------------------------------------------------------
OWN_NOTE = "[context-persistent: a line the user typed that looks like a note]"


def _long_session(storage: Path) -> dict[str, Any]:
    """5,000 messages (a request view at a small budget is built from a window of them), one of the user's own
    pinned early on looking like a note; returns the history and each message's seq."""
    async def run() -> dict[str, Any]:
        store = await PersistentContextManager.open(storage_path=storage, session_id=SID, fsync="never")
        try:
            await store.add_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": OWN_NOTE}])
            await store.pin(1)
            for start in range(0, 5000, 500):
                await store.add_messages([{"role": "user" if i % 2 == 0 else "assistant",
                                           "content": f"turn {i} " + "words " * 30} for i in range(start, start + 500)])
            return {"history": await store.get_messages(), "seqs": [k >> 20 for k in store._full().keys]}
        finally:
            await store.close()
    return asyncio.run(run())


def _seqs_by_a_whole_pass(view: list[dict[str, Any]], history: list[dict[str, Any]], seqs: list[int]
                          ) -> list[int | None]:
    """The seq of each view message: the first equal history message after the previous match."""
    def enc(m: dict[str, Any]) -> bytes:
        return orjson.dumps(m, option=orjson.OPT_SORT_KEYS)
    out: list[int | None] = []
    last = -1
    for m in view:
        found = next((i for i in range(last + 1, len(history)) if enc(history[i]) == enc(m)), None)
        if found is not None:
            last = found
        out.append(None if found is None else seqs[found])
    return out


def test_request_view_commands_read_only_its_window(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from context_persistent.model import projection
    from context_persistent.transfer import snapshot
    want = _long_session(storage)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole history was read")
    monkeypatch.setattr(snapshot, "history_messages", refused)
    monkeypatch.setattr(projection.PagedList, "__iter__", refused)
    assert main(["--storage", str(storage), "show", SID, "--budget", "3000", "--json"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    view = shown["messages"]
    assert 2 < len(view) < 200 and view[0] == want["history"][0] and view[1]["content"] == OWN_NOTE
    assert shown["message_seqs"] == _seqs_by_a_whole_pass(view, want["history"], want["seqs"])
    assert shown["message_seqs"][-1] == want["seqs"][-1] and shown["message_seqs"][1] == want["seqs"][1]
    out = tmp_path / "request.jsonl"
    assert main(["--storage", str(storage), "export", SID, str(out), "--view", "request", "--budget", "3000"]) == 0
    header, *body = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert body == view
    notes = [i for i, s in enumerate(shown["message_seqs"]) if s is None]
    # The window's note is listed; the user's own message that reads like one is not.
    assert header["notes"] == notes and 1 not in notes and notes
    assert all(view[i]["content"].startswith("[context-persistent: ") for i in notes)
