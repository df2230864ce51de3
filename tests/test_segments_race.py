"""A reader that looks at the log's files at the worst moment of a roll or a compression still reads a whole
prefix, each record once. The writer is held at a chosen step (segment_store's step hook) while the reader is
paused at a chosen point of its own looks, so the interleaving is the same on every run."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager

from context_persistent.storage import segment_store

from context_persistent.storage import segments
from context_persistent.storage.paths import LOG_NAME
from context_persistent.storage.segments import LogReader, load_manifest, segment_name

SID = "race"
BODY = "x" * 150


def _seqs(reader: LogReader) -> list[int]:
    return [int(line[13:line.index(b",", 13)]) for _, line in reader.lines(0)]


class _Held:
    """Holds the thread named ``thread`` at step ``at`` until released; says when it got there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread: str, at: str) -> None:
        self.thread, self.at = thread, at
        self.reached, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr(segment_store, "_step", self._step)

    def _step(self, name: str) -> None:
        if name == self.at and threading.current_thread().name == self.thread:
            self.reached.set()
            assert self.release.wait(30), f"{self.thread} was held at {name} for too long"


async def _session(storage: Path, messages: int, segment_bytes: int) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, fsync="never",
                                                segment_bytes=segment_bytes)
    for i in range(messages):
        await store.add_message({"role": "user", "content": f"m{i} {BODY}"})
    return store


async def test_a_reader_that_looks_while_a_roll_renames_reads_each_record_once(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roll has committed its manifest (listing events.jsonl as the next sealed segment) and renames the
    file between the reader's look at events.jsonl and its look at the sealed name: the file the reader holds
    is that sealed segment, not also the active one after it."""
    store = await _session(storage, 30, 1 << 20)
    folder = storage / SID
    with LogReader(folder) as reader:
        expected = _seqs(reader)
    assert expected == list(range(1, len(expected) + 1)) and not reader.segments
    at_manifest = _Held(monkeypatch, "roller", "roll-manifest")
    roller = threading.Thread(target=store._s.log.roll, name="roller")
    roller.start()
    try:
        assert at_manifest.reached.wait(30)
        main = threading.current_thread()
        real_stat = os.stat
        renamed = threading.Event()

        def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            st = real_stat(path, *args, **kwargs)
            if threading.current_thread() is main and isinstance(path, (str, os.PathLike)) and Path(path) == folder / LOG_NAME and not renamed.is_set():
                renamed.set()  # the reader has just looked at events.jsonl: the roll renames it now
                at_renamed = _Held(monkeypatch, "roller", "roll-renamed")
                at_manifest.release.set()
                assert at_renamed.reached.wait(30)
                at_manifest.release = at_renamed.release
            return st

        monkeypatch.setattr(os, "stat", stat)
        with LogReader(folder) as reader:
            monkeypatch.setattr(os, "stat", real_stat)
            assert renamed.is_set() and [s.name for s in reader.segments] == [segment_name(1)]
            assert _seqs(reader) == expected
            assert reader.end() == reader.base  # (nothing after the sealed segment yet)
    finally:
        at_manifest.release.set()
        roller.join(30)
    with LogReader(folder) as reader:
        assert _seqs(reader) == expected
    await store.close()


async def test_a_reader_that_opens_a_segment_while_it_is_compressed_finds_it(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest lists the segment as compressed, with the rename of ``.zst.tmp`` pending; the reader looks
    for the temp file just after the compression renamed it and removed the plain file: it reads the ``.zst``."""
    store = await _session(storage, 60, 4096)
    await store.close()
    folder = storage / SID
    with LogReader(folder) as reader:
        expected = _seqs(reader)
    assert expected == list(range(1, len(expected) + 1))
    held = _Held(monkeypatch, "compressor", "compress-manifest")
    manifest = load_manifest(folder, SID)
    assert manifest is not None and len(manifest.segments) >= 2
    compressor = threading.Thread(target=segment_store.compress_segment, args=(folder, manifest, 0),
                                  name="compressor")
    compressor.start()
    try:
        assert held.reached.wait(30)
        real_open = segments._open_ro
        missed: list[str] = []

        def open_ro(path: Path) -> int:
            if path.name.endswith(".zst.tmp") and not missed:
                missed.append(path.name)  # the compression finishes now: the temp file is renamed away
                held.release.set()
                compressor.join(30)
            return real_open(path)

        monkeypatch.setattr(segments, "_open_ro", open_ro)
        with LogReader(folder) as reader:
            assert reader.segments[0].compressed is not None  # (the committed manifest lists the .zst)
            assert _seqs(reader) == expected
        assert missed == [segment_name(1) + ".zst.tmp"]
        assert not (folder / segment_name(1)).exists()
    finally:
        held.release.set()
        compressor.join(30)


async def test_a_session_without_a_folder_is_not_found_at_once_and_an_empty_folder_is_looked_at_again(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking again is for a roll that replaced a file between two looks; a roll never removes the session's
    folder, so a read of a session that has none (a mistyped id) is SessionNotFoundError without a wait. A
    folder without a log file is looked at again, waiting between looks, before it is reported."""
    from context_persistent import SessionNotFoundError

    waits: list[float] = []
    monkeypatch.setattr(segments.time, "sleep", waits.append)
    with pytest.raises(SessionNotFoundError, match="'my-sesion' not found"):
        await PersistentContextManager.open(storage_path=storage, session_id="my-sesion", readonly=True)
    assert waits == []
    with pytest.raises(FileNotFoundError):
        LogReader(storage / "my-sesion")
    assert waits == []
    (storage / "empty").mkdir(parents=True)
    with pytest.raises(SessionNotFoundError, match="'empty' not found"):
        await PersistentContextManager.open(storage_path=storage, session_id="empty", readonly=True)
    assert len(waits) == segments._ATTEMPTS - 1 and 0 < sum(waits) < 1.5
