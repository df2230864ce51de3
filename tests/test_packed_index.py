"""The per-message index of a history (refs, keys, token counts) is packed: about 24 bytes a message wherever
the history is folded (replay, checkpoint restore, appends after a lazy open, time travel), and the packed
lists behave as the lists they replace (docs/architecture.md, "Bounded memory")."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.model import events as ev
from context_persistent.storage.checkpoint import Checkpoint, decode, encode, restore, snapshot
from context_persistent.storage.checkpoint import payload as cppayload
from context_persistent.model.projection import Counts, PagedList, Projection, Refs

N = 20_000
#: Bytes a message the index may take: 3 x 8 packed, plus the arrays' growth margin (lists of Python ints
#: took about 90 here: 3 list slots and two 32-byte int objects, refs and keys being beyond the small ints).
PER_MESSAGE = 40


def _record(seq: int) -> dict[str, Any]:
    return {"seq": seq, "type": ev.MESSAGE_ADDED, "data": {"message": {"role": "user", "content": f"m{seq}"}}}


def _fold(pager: Any, n: int = N) -> Projection:
    p = Projection(pager)
    for seq in range(1, n + 1):
        p.apply(_record(seq), seq * 300, 300)  # (as a replay of a file log: each record's position and length)
    return p


def _held(make: Any) -> tuple[Any, int]:
    """What ``make()`` returns and the bytes it still holds once made (transient allocations left out)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        made = make()
        gc.collect()
        return made, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


class _Pager:
    """Keeps no message (only the index is measured); every ref reads as the same user message."""

    def put(self, ref: int, message: dict[str, Any], size: int) -> None:
        pass

    def fetch(self, ref: int) -> dict[str, Any]:
        return {"role": "user", "content": str(ref)}

    def fetch_many(self, refs: list[int]) -> list[dict[str, Any]]:
        return [self.fetch(r) for r in refs]


def _pager(tmp_path: Path) -> Any:
    return _Pager()


def test_a_paged_fold_holds_about_24_bytes_a_message(tmp_path: Path) -> None:
    p, held = _held(lambda: _fold(_pager(tmp_path)))
    assert len(p.messages) == len(p.keys) == len(p.tokens) == N
    assert held < N * PER_MESSAGE, held / N
    assert p.messages.items[5] == 6 * 300 << 20 and p.keys[5] == 6 << 20 and p.tokens[5] is None


def test_a_checkpoint_state_restores_packed(tmp_path: Path) -> None:
    """A stored state (JSON lists, as every checkpoint layout holds them) loads into packed lists: once the
    parsed lists are dropped, the projection holds about 24 bytes a message."""
    folded = _fold(_pager(tmp_path))
    for i in range(0, N, 2):
        folded.tokens[i] = 1000 + i  # (counts beyond the small ints, as real ones are)
    stored = snapshot(folded)
    assert orjson.loads(stored)["tokens"][:2] == [1000, None]

    def restored_state() -> Projection:
        cp = Checkpoint(session_id="s", seq=N, position=None, first_crc=None, last_crc=None, tokenizer="t",
                        format=1, schema=[], state=orjson.loads(stored))
        return restore(cp, lambda: "t", _pager(tmp_path))

    restored, held = _held(restored_state)
    assert held < N * PER_MESSAGE, held / N
    assert restored.messages.items == folded.messages.items and list(restored.keys) == list(folded.keys)
    assert restored.tokens == folded.tokens and restored.tokens[2] == 1002 and restored.tokens[3] is None


def test_a_checkpoint_loads_without_a_python_int_per_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Loading a stored state (the JSON lists of every layout) parses the lists of refs, keys and token counts a
    piece at a time straight into packed lists: the load's peak stays near the packed size, never the ~120
    bytes a message of the lists as Python objects."""
    monkeypatch.setattr(cppayload, "_PIECE", 4096)  # (pieces far smaller than the lists, as at a million)
    folded = _fold(_pager(tmp_path))
    for i in range(0, N, 2):
        folded.tokens[i] = 1000 + i
    data = encode(session_id="s", seq=N, position=N * 300 + 300, first_crc=None, last_crc=None, tokenizer="t",
                  state_json=snapshot(folded))
    gc.collect()
    tracemalloc.start()
    try:
        restored = restore(decode(data, packed=True), lambda: "t", _pager(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < N * 80, peak / N
    assert restored.messages.items == folded.messages.items and restored.keys == folded.keys
    assert restored.tokens == folded.tokens and restored.head_seq == folded.head_seq


def test_a_state_not_of_refs_is_parsed_whole() -> None:
    """Messages stored whole, a negative key (an expired record's placeholder) or a malformed list: the state
    section is parsed as plain JSON (and a malformed one is an error, never a partial state)."""
    whole = {"messages": [{"role": "user", "content": "x"}], "keys": [1 << 20], "tokens": [None], "pinned": []}
    assert cppayload.parse_state(orjson.dumps(whole)) == whole
    placeholder = {"messages": [5 << 20], "keys": [-1], "tokens": [3], "pinned": []}
    assert cppayload.parse_state(orjson.dumps(placeholder)) == placeholder
    with pytest.raises(cppayload.CheckpointError):
        cppayload.parse_state(b'{"messages":[1,,2],"keys":[1,2],"tokens":[null,null],"pinned":[]}')


def test_appends_after_a_lazy_open_are_packed(tmp_path: Path) -> None:
    pager = _pager(tmp_path)
    lazy = Projection.lazy({"pinned": [], "head_seq": 1, "has_history": True, "session": {}}, 1,
                           {0: (1 << 20, 1 << 20, 7)}, [], lambda: ([1 << 20], [1 << 20], [7]), pager)

    def appended() -> Projection:
        for seq in range(2, N + 2):
            lazy.apply(_record(seq), seq * 300, 300)
        return lazy

    _, held = _held(appended)
    assert lazy.is_lazy and len(lazy.keys) == N + 1
    assert held < N * PER_MESSAGE, held / N
    lazy.materialise()
    assert lazy.keys[0] == 1 << 20 and lazy.keys[-1] == (N + 1) << 20 and lazy.tokens[0] == 7


async def test_time_travel_keeps_refs_not_messages(tmp_path: Path) -> None:
    """``open_at`` (``show --at``, ``export --at``) folds the log as an open does: refs to the records, the
    messages read back from the log."""
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync="never") as store:
        for i in range(30):
            await store.add_message({"role": "user", "content": f"m{i}"})
        past = await store.at(20)
        try:
            messages = past._state.messages
            assert type(messages) is PagedList and all(type(v) is int for v in messages.items)
            assert [m["content"] for m in await past.get_messages()] == [f"m{i}" for i in range(19)]
        finally:
            await past.close()


def test_counts_behave_as_a_list_of_ints_and_nones() -> None:
    c = Counts([None, 3, None, 5])
    assert c == [None, 3, None, 5] and list(c) == [None, 3, None, 5] and c[1:3] == [3, None]
    assert c.index(None) == 0 and c.index(None, 1) == 2 and c.count(None) == 2 and None in c and 4 not in c
    with pytest.raises(ValueError):
        c.index(4)
    c[0] = 9
    c.append(None)
    del c[1]
    assert c == [9, None, 5, None]
    c[:] = [None] * len(c)
    assert c == Counts.none(4) and sum(Counts([1, 2, 3])) == 6
    with pytest.raises(TypeError):
        sum(c)  # (as with a list holding None)


def test_refs_keep_messages_without_a_position_beside_the_refs() -> None:
    placeholder = {"role": "user", "content": None}
    r = Refs([7 << 20, placeholder, 9 << 20])
    assert list(r) == [7 << 20, placeholder, 9 << 20] and r[1] is placeholder
    del r[0]
    r.append(11 << 20)
    assert r == [placeholder, 9 << 20, 11 << 20] and r.copy() == r
    with pytest.raises(ValueError):
        Refs([-5])  # (a ref is a position: never negative)


async def test_a_replay_caches_only_the_messages_of_the_logs_last_cache_bytes(tmp_path: Path) -> None:
    """A full replay at open puts only the messages the cache would still hold at its end (those of about the
    log's last ``page_cache_bytes``): the newest are served from memory, the older ones read from the log."""
    config: dict[str, Any] = dict(fsync="never", page_cache_bytes=64 << 10)
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s", **config) as store:
        for i in range(400):
            await store.add_message({"role": "user", "content": f"m{i} " + "x" * 1000})
    (tmp_path / "s" / "checkpoint.json").unlink(missing_ok=True)
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s", readonly=True,
                                                   **config) as store:
        pager = store._s.pager
        floor = (store._s.log.position - pager.cache_bytes) << 20
        assert pager._cache and min(pager._cache) >= floor and pager._floor == 0  # (puts keep all again)
        items = store._s.state.messages.items
        reads = pager.reads
        assert pager.fetch(items[-1])["content"].startswith("m399") and pager.reads == reads  # (from the cache)
        assert pager.fetch(items[0])["content"].startswith("m0 ") and pager.reads == reads + 1  # (from the log)


def test_keep_from_makes_put_ignore_older_records(tmp_path: Path) -> None:
    from context_persistent.storage.pages import MessageReader, make_ref

    reader = MessageReader(tmp_path)
    reader.keep_from(1000)
    reader.put(make_ref(999, 3), {"role": "user"}, 10)
    reader.put(make_ref(1000), {"role": "user"}, 10)
    assert list(reader._cache) == [make_ref(1000)]
    reader.keep_from(0)
    reader.put(make_ref(5), {"role": "user"}, 10)
    assert make_ref(5) in reader._cache



@pytest.mark.parametrize("tokens", [b"null,null,null", b"7,null,9", b"7,8,9"])
@pytest.mark.parametrize("odd", [None, b"1.5", b"true", b"-3", b"9223372036854775808", b"1180591620717411303424"])
def test_packed_lists_take_only_non_negative_integers(odd: bytes | None, tokens: bytes) -> None:
    """The lists of refs and keys are packed only when they hold non-negative 64-bit integers (checked from
    their bytes when those are digits and commas alone, else item by item); anything else (a float, a bool, a
    negative or too large number) leaves the section parsed whole, as stored (or refused): never a changed value."""
    from array import array

    data = b'{"messages":[1048576,2097152,3145728],"keys":[1,%s,3],"tokens":[%s],"pinned":[]}' % (odd or b"2", tokens)
    try:
        got = cppayload.parse_state(data)
    except cppayload.CheckpointError:
        assert odd is not None and len(odd) > 19  # (beyond what JSON readers take: refused, never packed)
        return
    assert list(got["messages"]) == [1 << 20, 2 << 20, 3 << 20]
    assert [None if t == -1 else t for t in got["tokens"]] == orjson.loads(b"[" + tokens + b"]")
    if odd is None:
        assert type(got["keys"]) is array and list(got["keys"]) == [1, 2, 3]
    else:
        assert type(got["keys"]) is list and got["keys"] == orjson.loads(b"[1,%s,3]" % odd)
