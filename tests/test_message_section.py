"""The checkpoint's message section (docs/format.md, "Checkpoints"): the history's messages beside the state
section's refs while they fit the page cache's budget, so that open + get_messages() reads no record of the log it
covers. Round trip, older checkpoints without it, a damaged section (reported, the log read instead), erasure and
redaction (no erased or redacted text left in a checkpoint file) and a writer killed while writing one."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.operations.erasure import check_receipt
from context_persistent.operations.repair import verify
from context_persistent.storage.checkpoint import CHECKPOINT_VERSION, decode
from context_persistent.storage.checkpoint import payload as payload_mod, sections as sections_mod
from context_persistent.storage.checkpoint.front import is_whole
from context_persistent.storage.log import scan
from context_persistent.storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, LOG_NAME
from context_persistent.model.projection import Projection

from checkpoint_files import section_at, set_layout, strip_message_section
from strategies import tool_turns

S = "s"
CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)
SECRET = {"role": "user", "content": "the vault code is 4411-ZETA-9, keep it safe"}
NEEDLE = orjson.dumps(SECRET)


async def _open(storage: Path, **config: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=S, **{**CONFIG, **config})


def _fold(storage: Path) -> list[Any]:
    state = Projection()
    for rec, _ in scan(storage / S / LOG_NAME):
        state.apply(rec)
    return list(state.messages)


def _head(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return orjson.loads(data[:data.index(b"\n")])  # type: ignore[no-any-return]


async def _session(storage: Path, turns: int = 300, secret_at: int | None = None, **config: Any) -> None:
    async with await _open(storage, **config) as store:
        await store.add_message({"role": "system", "content": "You are helpful."})
        for i, m in enumerate(tool_turns(turns)):
            if i == secret_at:
                await store.add_message(SECRET)
            await store.add_message(m)


@pytest.mark.parametrize("budget", [None, 2_000])
async def test_round_trip_reads_no_record_it_covers(storage: Path, budget: int | None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A front that holds most of the history (the default budget covers all of this one) is written whole
    (layout 6: no message in it) and the open reads the state and message sections, parsing each message
    once; a small budget's front stays lazy (it holds the messages its first view needs). Either way the
    first ``get_messages()`` reads no record the checkpoint covers."""
    config = {} if budget is None else {"max_tokens": budget}
    await _session(storage, **config)
    path = storage / S / CHECKPOINT_NAME
    head = _head(path)
    assert head["checkpoint"] == CHECKPOINT_VERSION == 6 and head["messages_bytes"] > 0
    cp = decode(path.read_bytes())
    assert cp.messages_bytes == head["messages_bytes"] and cp.messages_section is not None
    whole = budget is None
    assert is_whole(cp.front) is whole and (cp.front["messages"] == []) is whole  # type: ignore[index]
    want = _fold(storage)
    parsed: list[int] = []
    real = payload_mod.parse_messages

    def counting(read: Any, start: int, length: int, n: int) -> list[Any]:
        out = real(read, start, length, n)
        parsed.append(len(out))
        return out
    monkeypatch.setattr(sections_mod, "parse_messages", counting)
    async with await _open(storage, **config) as store:
        assert store._state.is_lazy is not whole  # (whole: both sections read at open; lazy: the front only)
        assert parsed == ([len(want)] if whole else [])
        if whole:  # (the front section held no message: the section's parse is the only one)
            assert head["front_bytes"] < 1000 and store._checkpoints.section_messages == len(want)
        await store.add_message({"role": "user", "content": "one more"})  # (the log's tail after the checkpoint)
        store._s.pager.reads = 0
        got = await store.get_messages()
        assert got == want + [{"role": "user", "content": "one more"}]
        assert parsed == [len(want)] and store._checkpoints.ignored is None
        assert store._checkpoints.section_messages == len(want)
        # (lazy: the section's messages went to the caller, the cache is seeded when next used)
        assert (store._s.pager._pending is not None) is not whole and store._s.pager.reads == 0  # every message from the section or the appends, none from the log
        got[0]["content"] = "changed by the caller"  # (the caller's: nothing stored changes)
        assert (await store.get_messages())[0]["content"] == "You are helpful."
        assert store._checkpoints.section_messages == len(want) and store._s.pager.reads == 0
        # whole (the host's case): the history parsed once in the process; lazy: the first get_messages() got
        # the section as parsed for it (no copy), and the cache a second parse
        assert parsed == [len(want)] * (1 if whole else 2)


async def test_a_layout_5_checkpoint_still_opens_lazily(storage: Path, lazy_fronts: None) -> None:
    """A layout 5 checkpoint (its front section holds the messages it keeps, never ``whole``) opens lazily."""
    await _session(storage)
    path = storage / S / CHECKPOINT_NAME
    set_layout(path, 5)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq > 0
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.ignored is None and store._checkpoints.section_messages > 0


async def test_a_history_beyond_the_budget_is_written_without_a_section(storage: Path) -> None:
    """The section is written only while every message is in the page cache: a paged history is not."""
    await _session(storage, page_cache_bytes=4096)
    head = _head(storage / S / CHECKPOINT_NAME)
    assert "messages_bytes" not in head
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.section_messages == 0 and store._checkpoints.ignored is None


async def test_a_budget_lowered_since_reads_the_log(storage: Path) -> None:
    await _session(storage)
    size = _head(storage / S / CHECKPOINT_NAME)["messages_bytes"]
    async with await _open(storage, page_cache_bytes=size - 1) as store:
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.section_messages == 0 and store._s.pager.reads > 0


async def test_an_older_checkpoint_without_the_section_still_loads(storage: Path) -> None:
    """A layout-4 checkpoint (no ``messages_bytes``, nothing after the state section) loads as before."""
    await _session(storage)
    path = storage / S / CHECKPOINT_NAME
    strip_message_section(path)
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage)
        cps = store._checkpoints
        assert cps.loaded_seq > 0 and cps.ignored is None and cps.section_messages == 0
        assert store._s.pager.reads > 0
        await store.add_messages(tool_turns(100))  # (enough for close to write a new checkpoint)
    assert _head(path)["messages_bytes"] > 0


@pytest.mark.parametrize("where", ["inside", "crc"])
async def test_a_damaged_section_is_reported_and_the_log_is_read(storage: Path, caplog: pytest.LogCaptureFixture,
                                                                 where: str) -> None:
    await _session(storage)
    path = storage / S / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    start, length = section_at(bytes(data))
    data[start + length // 2 if where == "inside" else start + length + 3] ^= 0x01
    path.write_bytes(bytes(data))
    async with await _open(storage) as store:
        with caplog.at_level(logging.WARNING, logger="context_persistent"):
            assert await store.get_messages() == _fold(storage)
        cps = store._checkpoints
        assert cps.loaded_seq > 0 and cps.section_messages == 0 and store._s.pager.reads > 0
        assert cps.ignored is not None and cps.ignored.startswith("message section: message section checksum")
        assert store.stats()["checkpoint"]["ignored"] == cps.ignored
        assert "message section cannot be used" in caplog.text and "reading the messages from the log" in caplog.text
    # the close wrote a new checkpoint (nothing else was due): the next open uses its section again
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.section_messages > 0 and store._checkpoints.ignored is None


async def test_a_section_that_does_not_match_its_state_is_refused(storage: Path) -> None:
    """A section with a valid checksum but one item too few (never written so): refused, not used."""
    await _session(storage)
    path = storage / S / CHECKPOINT_NAME
    data = path.read_bytes()
    start, length = section_at(data)
    items = [m for line in data[start:start + length].split(b"\n") for m in orjson.loads(line)]
    short = orjson.dumps(items[:-1])
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    head["messages_bytes"] = len(short)
    line = orjson.dumps(head)
    front_end = nl + 1 + head["front_bytes"] + 1
    front = data[nl + 1:front_end]
    crc1 = zlib.crc32(front, zlib.crc32(line + b"\n"))
    crc3 = zlib.crc32(b"\n", zlib.crc32(short))
    path.write_bytes(line + b"\n" + front + b"%08x\n" % crc1 + data[front_end + 9:start] + short
                     + b"\n%08x\n" % crc3)
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.section_messages == 0
        assert "items for a state of" in (store._checkpoints.ignored or "")


async def test_a_whole_front_with_a_damaged_state_section_replays_the_log(storage: Path) -> None:
    """A whole front (layout 6) whose state section fails its checksum: the open reads the history from the log
    (neither section is used), says why and removes the checkpoint, as a lazy open does."""
    await _session(storage)
    path = storage / S / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    assert is_whole(decode(bytes(data)).front)
    head = _head(path)
    state_at = data.index(b"\n") + 1 + head["front_bytes"] + 1 + 9
    data[state_at + head["state_bytes"] // 2] ^= 0x01
    path.write_bytes(bytes(data))
    async with await _open(storage) as store:
        assert not store._state.is_lazy
        assert await store.get_messages() == _fold(storage)
        assert (store._checkpoints.ignored or "").startswith("state section:")
        assert store._checkpoints.section_messages == 0
    assert not path.exists()
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage) and store._checkpoints.ignored is None


async def test_erase_leaves_no_copy_in_any_checkpoint_file(storage: Path) -> None:
    await _session(storage, secret_at=40)
    folder = storage / S
    start, length = section_at((folder / CHECKPOINT_NAME).read_bytes())
    assert NEEDLE in (folder / CHECKPOINT_NAME).read_bytes()[start:start + length]  # (the section holds it)
    async with await _open(storage, checkpoint_every=50) as store:
        seq = next(rec["seq"] for rec, _ in scan(folder / LOG_NAME) if rec["data"].get("message") == SECRET)
        receipt = await store.erase(seq=seq)
        assert receipt["checkpoints"][0]["action"] == "deleted"
        assert not any(NEEDLE in p.read_bytes() for p in folder.iterdir() if p.is_file())
        assert SECRET not in await store.get_messages()
        await store.add_messages(tool_turns(30))  # (periodic checkpoints after the erase: written with a section)
        assert await store.verify_erasure(receipt) == []
    cp_files = [p for p in folder.iterdir() if p.name in (CHECKPOINT_NAME, CHECKPOINT_BASE_NAME)]
    assert cp_files and _head(folder / CHECKPOINT_NAME)["messages_bytes"] > 0
    assert [p.name for p in folder.iterdir() if p.is_file() and NEEDLE in p.read_bytes()] == []
    assert check_receipt(folder, receipt) == []
    async with await _open(storage) as store:
        got = await store.get_messages()
        assert SECRET not in got and got == _fold(storage)
        assert store._checkpoints.section_messages > 0
    assert verify(folder, S).ok


async def test_redaction_leaves_no_text_in_the_checkpoint_written_at_close(storage: Path) -> None:
    """A redaction keeps the bytes in the log (docs/operations.md), not in a checkpoint: the close after it
    writes a new one, even with fewer events than a close needs otherwise."""
    await _session(storage, secret_at=40)
    folder = storage / S
    async with await _open(storage) as store:
        index = (await store.get_messages()).index(SECRET)
        await store.redact(index)
    assert NEEDLE in (folder / LOG_NAME).read_bytes()
    assert not any(NEEDLE in (folder / n).read_bytes() for n in (CHECKPOINT_NAME, CHECKPOINT_BASE_NAME)
                   if (folder / n).exists())
    async with await _open(storage) as store:
        assert SECRET not in await store.get_messages() and store._checkpoints.section_messages > 0


CHILD = """
import asyncio, sys
from context_persistent import PersistentContextManager
sys.path.insert(0, sys.argv[2])
from checkpoint_files import section_at, strip_message_section
from strategies import tool_turns
async def main():
    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id="s", fsync="never",
                                                tokenizer="chars/4", recognise_replay=False, checkpoint_every=40)
    await store.get_messages()
    for _ in range(50):  # (killed long before the end: by the crash hook, or by the test)
        for m in tool_turns(100):
            await store.add_message(m)
    await store.close()
    print("DONE", flush=True)
asyncio.run(main())
"""


@pytest.mark.parametrize("crash_at", ["checkpoint-written", None])
def test_a_writer_killed_while_writing_a_checkpoint_leaves_an_openable_session(storage: Path,
                                                                               crash_at: str | None) -> None:
    """A real process killed after the new checkpoint's temp file is written but before it is renamed (the
    crash hook), or with SIGKILL at once after its first checkpoint: the session opens, the history is the log's."""
    import asyncio

    asyncio.run(_session(storage, turns=100))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    if crash_at:
        env["CONTEXT_PERSISTENT_CRASH_AT"] = crash_at
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(storage), str(Path(__file__).parent)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if crash_at is None:  # (killed as soon as a checkpoint newer than the first is in place)
        first = _head(storage / S / CHECKPOINT_NAME)["seq"]
        while proc.poll() is None:
            try:
                if _head(storage / S / CHECKPOINT_NAME)["seq"] > first:
                    break
            except (ValueError, OSError):
                pass
        proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    out = proc.stdout.read() if proc.stdout else b""
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL and b"DONE" not in out, out

    async def check() -> None:
        async with await _open(storage) as store:
            assert await store.get_messages() == _fold(storage)
            assert store._checkpoints.loaded_seq > 0 and store._checkpoints.ignored is None

    asyncio.run(check())


async def test_verify_checks_the_section_against_the_log_and_repair_removes_a_damaged_one(storage: Path) -> None:
    from context_persistent.operations.repair import repair

    await _session(storage)
    folder = storage / S
    report = verify(folder, S)
    assert report.ok and report.checkpoint["messages"] == "valid"
    path = folder / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    start, length = section_at(bytes(data))
    data[start + length // 3] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify(folder, S)
    assert not report.ok and report.checkpoint["status"] == "valid"
    assert report.checkpoint["messages"].startswith("damaged: message section checksum mismatch")
    repair(folder, S)
    assert not path.exists() and verify(folder, S).ok


async def test_a_based_checkpoint_keeps_its_base_message_section(storage: Path, lazy_fronts: None) -> None:
    """A checkpoint written while the history is still lazy refers to (or copies) the state section it was
    opened from, and the message section that follows it: the next open still reads the history from it."""
    await _session(storage)
    async with await _open(storage, checkpoint_every=20) as store:
        assert store._state.is_lazy
        for i in range(25):
            await store.add_message({"role": "user", "content": f"later {i}"})
        while store._checkpoints._task is not None:
            await store._checkpoints._task
        assert store._state.is_lazy
    head = _head(storage / S / CHECKPOINT_NAME)
    assert head["base"] is not None and head["messages_bytes"] > 0
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage)
        assert store._checkpoints.section_messages > 0 and store._checkpoints.ignored is None
    assert verify(storage / S, S).checkpoint["messages"] == "valid"


async def test_the_first_get_messages_of_a_lazy_open_gets_the_section_without_a_copy(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a lazy open the first ``get_messages()`` gets the message section's messages as parsed for it (no
    copy of them: only the log's tail after the checkpoint is copied); the cache is seeded from a second
    parse when next used. What the caller does to them reaches no later result, request view, log or
    checkpoint."""
    from context_persistent.model import events

    await _session(storage, max_tokens=2_000)
    want = _fold(storage)
    copied = [0]
    real = events.copy_json

    def counting(value: Any) -> Any:
        copied[0] += type(value) is dict and "role" in value
        return real(value)
    async with await _open(storage, max_tokens=2_000) as store:
        assert store._state.is_lazy
        await store.add_message({"role": "user", "content": "one more"})
        monkeypatch.setattr(events, "copy_json", counting)
        got = await store.get_messages()
        assert got == want + [{"role": "user", "content": "one more"}]
        assert copied[0] == 1 and store._s.pager._pending is not None  # (the tail's one message; old code: all)
        monkeypatch.setattr(events, "copy_json", real)
        for m in got:
            m["content"] = "changed by the caller"
        again = await store.get_messages()
        assert store._s.pager._pending is None and again == want + [{"role": "user", "content": "one more"}]
        assert all(a is not g for a, g in zip(again, got))
        view = await store.get_messages_for_request()
        assert not any(m.get("content") == "changed by the caller" for m in view)
        await store.add_messages(tool_turns(5))  # (enough for the close to write a checkpoint)
    assert not any(b"changed by the caller" in p.read_bytes() for p in (storage / S).iterdir() if p.is_file())
    async with await _open(storage) as store:
        assert (await store.get_messages())[:len(want)] == want


async def test_an_erase_before_the_deferred_seed_drops_it(storage: Path) -> None:
    """An erasure after the first ``get_messages()`` of a lazy open (the section's seed still deferred) drops
    the deferred seed: the erased message's text reaches neither the cache nor a checkpoint written later."""
    await _session(storage, secret_at=40, max_tokens=2_000)
    folder = storage / S
    async with await _open(storage, checkpoint_every=50, max_tokens=2_000) as store:
        assert SECRET in await store.get_messages() and store._s.pager._pending is not None
        seq = next(rec["seq"] for rec, _ in scan(folder / LOG_NAME) if rec["data"].get("message") == SECRET)
        receipt = await store.erase(seq=seq)
        assert store._s.pager._pending is None
        assert not any(m == SECRET for m, _ in store._s.pager._cache.values())
        assert SECRET not in await store.get_messages()
        await store.add_messages(tool_turns(30))  # (periodic checkpoints after the erase: written with a section)
        assert await store.verify_erasure(receipt) == []
    assert _head(folder / CHECKPOINT_NAME)["messages_bytes"] > 0
    assert [p.name for p in folder.iterdir() if p.is_file() and NEEDLE in p.read_bytes()] == []


@pytest.mark.parametrize("into", [None, "whole", "short"])
@pytest.mark.parametrize("piece", [7, 64, 1 << 20])
def test_a_section_is_parsed_the_same_whatever_its_lines_and_read_pieces(monkeypatch: pytest.MonkeyPatch,
                                                                         piece: int, into: str | None) -> None:
    """parse_messages reads a piece at a time and parses each line where it lies: lines longer than a piece,
    several in one, nulls, and a malformed line anywhere (reported only once the checksum was read whole). The
    same with a reader that reads into one buffer (a file's: ``into``), also when it reads less than asked."""
    monkeypatch.setattr(payload_mod, "_PIECE", piece)
    lines = [orjson.dumps([{"role": "user", "content": f"m{i}-{j} ü"} for j in range(i % 4 + 1)] + [None] * (i % 2))
             for i in range(9)]
    expected = [m for line in lines for m in orjson.loads(line)]

    def section(body: bytes, stored: bytes | None = None) -> tuple[Any, int]:
        data = b"xx" + (stored or body) + b"\n%08x\n" % zlib.crc32(body + b"\n")

        def read(offset: int, count: int) -> bytes:
            return data[offset:offset + count]

        def read_into(offset: int, view: memoryview) -> int:
            got = data[offset:offset + (len(view) if into == "whole" else min(len(view), 5))]
            view[:len(got)] = got
            return len(got)
        if into is not None:
            read.into = read_into  # type: ignore[attr-defined]
        return read, len(body)

    read, length = section(b"\n".join(lines))
    assert payload_mod.parse_messages(read, 2, length, len(expected)) == expected
    with pytest.raises(payload_mod.CheckpointError, match="items for a state of 12 messages"):
        payload_mod.parse_messages(read, 2, length, 12)
    for bad in (b"[1", b"{}", b""):
        read, length = section(b"\n".join([*lines[:4], bad, *lines[4:]]))
        with pytest.raises(payload_mod.CheckpointError, match="malformed message section"):
            payload_mod.parse_messages(read, 2, length, len(expected))
    body = b"\n".join(lines)
    read, length = section(body, body.replace(b"m3-0", b"m3-1"))  # (a message changed after its checksum)
    with pytest.raises(payload_mod.CheckpointError, match="checksum mismatch"):
        payload_mod.parse_messages(read, 2, length, len(expected))
    for stored in (body[:-9], body[:20]):  # (the file ends inside the section or its trailer)
        read, length = section(body, stored)
        if stored == body[:20]:
            read_all = read
            read = (lambda offset, count: read_all(offset, count) if offset < 22 else b"")  # noqa: E731
            if into is not None:
                read.into = read_all.into  # type: ignore[attr-defined]
        with pytest.raises(payload_mod.CheckpointError, match="truncated message section"):
            payload_mod.parse_messages(read, 2, length, len(expected))
