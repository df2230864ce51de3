"""Lazy open: a store opened from a checkpoint's front section serves the request view without loading the
whole history, and behaves exactly like a store that loaded everything (checkpoint/, projection.LazyList)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
from context_persistent.storage.checkpoint import CHECKPOINT_VERSION, decode
from context_persistent.errors import LogCorruptedError
from context_persistent.storage.log import scan
from context_persistent.storage.paths import CHECKPOINT_NAME, LOG_NAME
from context_persistent.model.projection import Projection

from strategies import conversations, tool_turns as _turns

S = "s"


@pytest.fixture(autouse=True)
def _lazy(lazy_fronts: None) -> None:
    """Every test here opens lazily (a front that covers most of the history is written whole otherwise:
    tests/test_message_section.py tests that)."""


CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)


async def _open(storage: Path, window: int = 512, **config: Any) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=S, **{**CONFIG, **config})
    store.WINDOW_MIN_MESSAGES = window
    return store


async def _pair(storage: Path, window: int = 512, **config: Any
                ) -> tuple[PersistentContextManager, PersistentContextManager]:
    """The session opened lazily, and a copy of it (in a sibling folder) opened and loaded whole at once."""
    twin = storage.parent / (storage.name + "-eager")
    shutil.rmtree(twin, ignore_errors=True)
    shutil.copytree(storage, twin)
    lazy = await _open(storage, window, **config)
    eager = await _open(twin, window, **config)
    eager._full()
    return lazy, eager


def _fold(storage: Path) -> Projection:
    state = Projection()
    for rec, _ in scan(storage / S / LOG_NAME):
        state.apply(rec)
    return state


async def _long_session(storage: Path, turns: int = 1500, **config: Any) -> None:
    """A system prompt and ``turns`` tool-using turns; close writes a checkpoint with a front section."""
    async with await _open(storage, **config) as store:
        await store.set_messages([{"role": "system", "content": "You are helpful."}, *_turns(turns)])
    assert decode((storage / S / CHECKPOINT_NAME).read_bytes()).front is not None


async def test_the_first_request_does_not_load_the_history(storage: Path) -> None:
    """Opening a long session from its checkpoint reads only the front section; the first request view is
    built from it, identical to the view of a store that loaded everything."""
    await _long_session(storage, max_tokens=10_000)
    lazy, eager = await _pair(storage, max_tokens=10_000)
    try:
        assert lazy._state.is_lazy and not eager._state.is_lazy
        view = await lazy.get_messages_for_request(token_budget=8_000)
        assert lazy._state.is_lazy, "the first request loaded the whole history"
        assert view == await eager.get_messages_for_request(token_budget=8_000)
        assert view[0] == {"role": "system", "content": "You are helpful."}
        in_memory = len(lazy._state.messages.known_indices())  # type: ignore[union-attr]
        assert in_memory < 1000 < len(lazy._state.messages) == 6001
        # Appends and requests stay lazy and equal.
        for m in ({"role": "user", "content": "one more"}, {"role": "assistant", "content": "ok"}):
            await lazy.add_message(m)
            await eager.add_message(m)
            assert await lazy.get_messages_for_request(token_budget=8_000) == \
                await eager.get_messages_for_request(token_budget=8_000)
        assert lazy._state.is_lazy
        assert await lazy.get_token_count() == await eager.get_token_count()  # needs every count: loads
        assert not lazy._state.is_lazy
        assert await lazy.get_messages() == await eager.get_messages()
    finally:
        await lazy.close()
        await eager.close()
    assert (await (await _open(storage)).get_messages()) == _fold(storage).messages


async def test_a_pin_outside_the_front_section_loads_the_rest(storage: Path) -> None:
    """Pinning a message the front section did not keep is still honoured: the rebuild loads the history."""
    await _long_session(storage, max_tokens=10_000)
    async with await _open(storage, max_tokens=10_000) as store:
        assert store._state.is_lazy
        await store.pin(2000)  # (resolving the index loads what it needs)
        view = await store.get_messages_for_request(token_budget=8_000)
        history = await store.get_messages()
        assert history[2000] in view
    async with await _open(storage, max_tokens=10_000) as again:  # the pin is in the tail after the checkpoint
        assert await again.get_messages_for_request(token_budget=8_000) == view


async def test_a_redaction_in_the_tail_is_applied(storage: Path) -> None:
    """A redaction after the checkpoint needs the whole list: applying it at open loads the rest."""
    await _long_session(storage, max_tokens=10_000)
    path = storage / S / CHECKPOINT_NAME
    before = path.read_bytes()
    async with await _open(storage, max_tokens=10_000) as store:
        await store.redact(5)
    # (the close after a redaction writes a new checkpoint: the one before it is put back, the redaction in its tail)
    path.write_bytes(before)
    async with await _open(storage, max_tokens=10_000) as store:
        assert store._checkpoints.loaded_seq > 0 and not store._state.is_lazy
        assert await store.get_messages() == _fold(storage).messages


def _in_state_section(data: bytes | bytearray) -> int:
    """A byte 5000 bytes before the end of the state section (a message section may follow it)."""
    nl = data.index(b"\n")
    head = orjson.loads(data[:nl])
    return nl + 1 + head["front_bytes"] + 1 + 9 + head["state_bytes"] - 5000


async def test_a_damaged_state_section_falls_back_to_the_log(storage: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bit flip in the state section is found when the rest is loaded: the history is rebuilt from the log
    (the source of truth), the reason is logged and shown in stats, and the checkpoint is removed."""
    await _long_session(storage, max_tokens=10_000)
    path = storage / S / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    data[_in_state_section(data)] ^= 0x04
    path.write_bytes(bytes(data))
    async with await _open(storage, max_tokens=10_000) as store:
        assert store._state.is_lazy
        await store.get_messages_for_request(token_budget=8_000)
        with caplog.at_level(logging.WARNING, logger="context_persistent"):
            history = await store.get_messages()
        assert history == _fold(storage).messages
        assert "state section" in caplog.text and "rebuilding the history from the log" in caplog.text
        assert store.stats()["checkpoint"]["ignored"].startswith("state section: state checksum mismatch")
        assert not path.exists()


async def test_a_damaged_state_section_and_a_damaged_log_raise(storage: Path) -> None:
    """If the state section is damaged and the log it falls back to is corrupt before the checkpoint too, the
    read that needs the history raises LogCorruptedError (nothing is served from unverified bytes), every time."""
    async with await _open(storage, max_tokens=10_000) as store:
        await store.set_messages(_turns(1500))
        await store.add_message({"role": "user", "content": "the checkpoint's own record (seq 3)"})
    path = storage / S / CHECKPOINT_NAME
    assert decode(path.read_bytes()).seq == 3
    data = bytearray(path.read_bytes())
    data[_in_state_section(data)] ^= 0x04
    path.write_bytes(bytes(data))
    log = storage / S / LOG_NAME
    raw = bytearray(log.read_bytes())
    first_nl = raw.index(b"\n")
    raw[first_nl + 100] ^= 0x01  # inside the messages_replaced record, which the checkpoint covers
    log.write_bytes(bytes(raw))
    async with await _open(storage, max_tokens=10_000) as store:
        assert store._state.is_lazy
        for _ in range(2):
            with pytest.raises(LogCorruptedError):
                await store.get_messages()


async def test_a_checkpoint_replaced_after_open_does_not_change_what_is_loaded(storage: Path) -> None:
    """The rest is read from the file opened at open: a checkpoint renamed over it later is not mixed in."""
    await _long_session(storage, max_tokens=10_000)
    path = storage / S / CHECKPOINT_NAME
    async with await _open(storage, max_tokens=10_000) as store:
        tmp = path.with_suffix(".other")
        tmp.write_bytes(b"something else entirely\n")
        os.replace(tmp, path)
        assert await store.get_messages() == _fold(storage).messages
        assert store.stats()["checkpoint"]["ignored"] is None


async def test_a_checkpoint_of_the_previous_layout_is_ignored(storage: Path) -> None:
    """A checkpoint written by the previous layout (1, no front section) is refused by its version."""
    await _long_session(storage, turns=100, checkpoint_every=1)
    path = storage / S / CHECKPOINT_NAME
    path.write_bytes(path.read_bytes().replace(b'{"checkpoint":%d,' % CHECKPOINT_VERSION, b'{"checkpoint":1,', 1))
    async with await _open(storage) as store:
        assert "payload layout 1" in store.stats()["checkpoint"]["ignored"]
        assert await store.get_messages() == _fold(storage).messages


async def test_a_replayed_transcript_is_recognised_on_a_lazy_store(storage: Path) -> None:
    """A host replaying the transcript through add_message (sub-session resume) is recognised as before."""
    await _long_session(storage, turns=1200)
    async with await _open(storage, recognise_replay=True) as store:
        assert store._state.is_lazy
        transcript = [m for m in _fold(storage).messages if m["role"] != "system"]
        for m in transcript:
            await store.add_message(m)
        await store.add_message({"role": "user", "content": "the new instruction"})  # confirms the replay
        head = store.head_seq
    async with await _open(storage) as store:
        assert store.head_seq == head and await store.get_messages() == _fold(storage).messages
        assert len(await store.get_messages()) == 4802  # nothing shown twice


async def test_a_readonly_store_opens_lazily_too(storage: Path) -> None:
    await _long_session(storage, max_tokens=10_000)
    async with await _open(storage, readonly=True, max_tokens=10_000) as store:
        assert store._state.is_lazy
        await store.get_messages_for_request(token_budget=8_000)
        assert await store.get_messages() == _fold(storage).messages


# -- the property: a lazily opened store is indistinguishable from one that loaded everything ------------
async def _same(messages: list[dict], pins: list[bool], split: int, budget: int, max_tokens: int,
                ops: list[tuple[str, int]]) -> bool:
    with tempfile.TemporaryDirectory() as d:
        storage = Path(d) / "store"
        cfg = dict(max_tokens=max_tokens, safety_margin=0, checkpoint_every=3)
        async with await _open(storage, window=4, **cfg) as w:
            for m in messages[:split]:
                await w.add_message(m)
            for i, p in enumerate(pins[:split]):
                if p:
                    await w.pin(i)
        lazy, eager = await _pair(storage, window=4, **cfg)
        try:
            was_lazy = lazy._state.is_lazy
            assert lazy.head_seq == eager.head_seq
            assert await lazy.get_messages_for_request(token_budget=budget) == \
                await eager.get_messages_for_request(token_budget=budget)
            stayed = lazy._state.is_lazy
            rest = iter(messages[split:])
            for op, arg in ops:
                n = len(eager._state.messages)
                m = next(rest, None) if op == "add" else None
                for s in (lazy, eager):
                    if op == "add":
                        if m is not None:
                            await s.add_message(m)
                    elif op in ("pin", "unpin", "redact") and n:
                        await getattr(s, op)(arg % n)
                    elif op == "clear":
                        await s.clear()
                assert await lazy.get_messages_for_request(token_budget=budget) == \
                    await eager.get_messages_for_request(token_budget=budget)
            assert await lazy.get_messages() == await eager.get_messages()
            assert await lazy.get_token_count() == await eager.get_token_count()
            assert lazy._state.pinned == eager._state.pinned
        finally:
            await lazy.close()
            await eager.close()
        return was_lazy and stayed


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "pin", "unpin", "redact", "clear"]),
                         st.integers(0, 10_000)), max_size=6)


@settings(max_examples=int(os.environ.get("CP_LAZY_EXAMPLES", "80")), deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(conv=conversations(max_segments=40), cut=st.floats(0.6, 1), budget=st.integers(100, 1_500),
       max_tokens=st.integers(100, 3_000), ops=OPS)
def test_a_lazy_store_equals_a_loaded_one(conv: tuple, cut: float, budget: int, max_tokens: int,
                                          ops: list[tuple[str, int]]) -> None:
    """Random histories (both tool formats, orphans, system messages anywhere, pins, huge outputs), a checkpoint
    whose front section covers a random part, then requests, appends, pins, unpins, redactions and clears:
    every request view, the history, the token count and the pins equal those of a fully loaded store."""
    messages, pins = conv
    assume(len(messages) >= 3)
    reps = -(-30 // len(messages))  # long enough for windowed rebuilds: repeat it (ids repeat too: any history goes)
    messages, pins = [dict(m) for m in messages * reps], pins * reps
    stayed = asyncio.run(_same(messages, pins, max(1, int(len(messages) * cut)), budget, max_tokens, ops))
    event(f"first request served lazily: {stayed}")


# -- LazyList behaves like the list it stands for -------------------------------------------------------------
LIST_OPS = st.lists(st.one_of(
    st.tuples(st.just("get"), st.integers(-40, 40)),
    st.tuples(st.just("slice"), st.integers(-40, 40), st.integers(-40, 40)),
    st.tuples(st.just("set"), st.integers(-40, 40), st.integers()),
    st.tuples(st.just("append"), st.integers()),
    st.tuples(st.just("len"),),
    st.tuples(st.just("known"), st.integers(-40, 40)),
    st.tuples(st.just("index"), st.integers(0, 40)),
    st.tuples(st.just("del"), st.integers(-40, 40)),
    st.tuples(st.just("iter"),),
), max_size=25)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 30), known=st.sets(st.integers(0, 29)), ops=LIST_OPS)
def test_a_lazy_list_behaves_like_a_list(n: int, known: set[int], ops: list[tuple]) -> None:
    """Every operation gives what the plain list gives; the rest is loaded only when an operation needs an item
    that is not in memory (never for items in memory or appended)."""
    full = [1000 + i for i in range(n)]
    loads: list[int] = []

    def loader() -> tuple[list, list, list]:
        loads.append(1)
        return list(full[:n]), list(full[:n]), list(full[:n])

    known = {i for i in known if i < n}
    p = Projection.lazy({"pinned": [], "head_seq": 1, "has_history": True, "session": {}}, n,
                        {i: (full[i], full[i], full[i]) for i in known}, [], loader)
    lazy, ref = p.messages, list(full)

    def same(f: Any) -> None:
        try:
            want: Any = f(ref)
        except (IndexError, ValueError) as e:
            with pytest.raises(type(e)):
                f(lazy)
            return
        assert f(lazy) == want

    for op in ops:
        before = lazy.loaded  # type: ignore[union-attr]
        if op[0] == "get":
            same(lambda x: x[op[1]])
        elif op[0] == "slice":
            same(lambda x: x[op[1]:op[2]])
        elif op[0] == "set":
            same(lambda x: x.__setitem__(op[1], op[2]))
        elif op[0] == "append":
            lazy.append(op[1])
            ref.append(op[1])
        elif op[0] == "len":
            assert len(lazy) == len(ref)
        elif op[0] == "known":
            i = op[1]
            if 0 <= i < len(ref):
                got = lazy.get_known(i, "absent")  # type: ignore[union-attr]
                assert got == ref[i] or (got == "absent" and i < n and i not in known and not lazy.loaded)
        elif op[0] == "index":
            same(lambda x: x.index(1000 + op[1]))
        elif op[0] == "del":
            same(lambda x: x.__delitem__(op[1]))
        elif op[0] == "iter":
            assert list(lazy) == ref
        if not before and lazy.loaded and op[0] in ("get", "set", "known"):
            i = op[1] + (len(ref) if op[1] < 0 else 0)
            assert 0 <= i < n and i not in known, "loaded although the item was in memory"
    assert len(loads) <= 1
    assert lazy == ref


async def test_imports_and_forks_of_long_sessions_start_with_a_checkpoint(storage: Path, tmp_path: Path) -> None:
    """An import or a fork of more than 1 MiB writes the new session's first checkpoint, so even its first
    resume is lazy; a short one writes none (its first close does, when worth it)."""
    from context_persistent import import_
    await _long_session(storage, max_tokens=10_000)
    async with await _open(storage, max_tokens=10_000) as store:
        await store.export(tmp_path / "snap.jsonl", format="jsonl")
        await store.fork("forked")
        await store.fork("short", at_seq=1)
    await import_(tmp_path / "snap.jsonl", session_id="imported", storage_path=storage)
    for sid in ("forked", "imported"):
        assert (storage / sid / CHECKPOINT_NAME).exists(), sid
        async with await PersistentContextManager.open(storage_path=storage, session_id=sid, **CONFIG) as s:
            assert s._state.is_lazy
            assert len(await s.get_messages()) == 6001
    assert not (storage / "short" / CHECKPOINT_NAME).exists()


def test_the_projection_knows_the_same_system_roles_as_grouping() -> None:
    from context_persistent.model import grouping
    from context_persistent.model import projection
    assert frozenset(projection.SYSTEM_ROLES) == grouping.SYSTEM_ROLES


async def test_the_system_prompt_factory_keeps_a_lazy_store_lazy(storage: Path) -> None:
    """The host's factory runs before the first request: the same prompt writes nothing, a changed one replaces
    the leading system message in place; neither loads the history, and the views match a whole load."""
    await _long_session(storage, max_tokens=10_000)
    for text in ("You are helpful.", "You are terse."):
        lazy, eager = await _pair(storage, max_tokens=10_000)
        try:
            for store in (lazy, eager):
                async def factory(text: str = text) -> str:
                    return text
                await store.set_system_prompt_factory(factory)
            before = lazy._state.counts.get("system_prompt_set", 0)
            view = await lazy.get_messages_for_request(token_budget=8_000)
            assert lazy._state.is_lazy, "the system prompt loaded the whole history"
            assert view == await eager.get_messages_for_request(token_budget=8_000)
            assert view[0] == {"role": "system", "content": text}
            assert [m["content"] for m in view if m["role"] == "system"] == [text]
            written = lazy._state.counts.get("system_prompt_set", 0) - before
            assert written == (0 if text == "You are helpful." else 1)
        finally:
            await lazy.close()
            await eager.close()
    async with await _open(storage) as store:
        assert await store.get_messages() == _fold(storage).messages
        assert (await store.get_messages())[0] == {"role": "system", "content": "You are terse."}


def test_a_replay_fold_on_a_lazy_projection_loads_nothing() -> None:
    """replay_recognised removes the newest messages: on a lazy projection they are all in memory."""
    loads = []
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

    def loader() -> tuple[list[Any], list[Any], list[Any]]:
        loads.append(1)
        return list(base), [1 << 20, 2 << 20, 3 << 20], [None, None, None]

    meta = {"pinned": [], "head_seq": 3, "has_history": True, "session": {}, "counts": {}}
    p = Projection.lazy(meta, 3, {0: (base[0], 1 << 20, None)}, [0], loader)
    p.apply({"seq": 4, "type": "message_added", "data": {"message": {"role": "system", "content": "S2"}}})
    p.apply({"seq": 5, "type": "message_added", "data": {"message": base[1]}})
    p.apply({"seq": 6, "type": "replay_recognised", "data": {"count": 2, "keys": [4 << 20, 5 << 20]}})
    assert not loads and p.is_lazy and len(p.messages) == 3
    assert p.messages.system_indices == [0]  # type: ignore[attr-defined]
    assert list(p.messages) == base and loads == [1]
