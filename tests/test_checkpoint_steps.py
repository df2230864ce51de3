"""Checkpoints written in steps: Projection.capture() is a snapshot, dump_in_steps() gives the same state as
snapshot(), a write overlapping appends/pins/redactions/replacements/clears stays a valid checkpoint of its seq,
and the incremental system index and the bisection over pinned keys agree with a full scan (checkpoint/front.py)."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
from context_persistent.model import events as ev
from context_persistent.storage.checkpoint import front as cpfront
from context_persistent.storage.checkpoint import payload as cppayload
from context_persistent.storage.checkpoint import policy as cppolicy
from context_persistent.storage.checkpoint import (FRONT_EXTRA_TURNS, FRONT_MAX_SPAN, SystemIndex, decode, dump_in_steps,
                                           encode, front_of, snapshot)
from context_persistent.model.grouping import is_system
from context_persistent.storage.paths import CHECKPOINT_NAME
from context_persistent.model.projection import Projection, json_default

from strategies import conversations, tool_turns

S = "s"
TS = "2024-01-01T00:00:00.000000Z"
CONFIG: dict[str, Any] = dict(fsync="never", tokenizer="chars/4", recognise_replay=False)


# -- helpers -------------------------------------------------------------------------------------------
class Builder:
    """A Projection fed records as the manager would apply them (seq increasing by one)."""

    def __init__(self) -> None:
        self.p = Projection()
        self.seq = 0

    def apply(self, type_: str, data: dict[str, Any]) -> None:
        self.seq += 1
        self.p.apply({"seq": self.seq, "ts": TS, "type": type_, "data": data})

    def start(self) -> "Builder":
        self.apply(ev.SESSION_STARTED, {"format": 1, "tokenizer": "chars/4", "program": "tëst ✓"})
        return self

    def add(self, message: dict[str, Any]) -> None:
        self.apply(ev.MESSAGE_ADDED, {"message": message})

    def replace(self, messages: list[dict[str, Any]]) -> None:
        self.apply(ev.MESSAGES_REPLACED, {"messages": messages})

    def clear(self) -> None:
        self.apply(ev.CLEARED, {})

    def pin(self, key: int) -> None:
        self.apply(ev.PINNED, {"key": key})

    def unpin(self, key: int) -> None:
        self.apply(ev.UNPINNED, {"key": key})

    def redact(self, key: int) -> None:
        self.apply(ev.REDACTED, {"key": key})


def rich_message(i: int) -> dict[str, Any]:
    """Messages with unicode (incl. JSON-escaped characters), nested content lists, nulls and numbers."""
    kind = i % 4
    if kind == 0:
        return {"role": "user", "content": f"héllo {i} ✓ 日本語 🎉 \u2028 \"quoted\" \\ \n\t"}
    if kind == 1:
        return {"role": "assistant", "content": [
            {"type": "text", "text": f"calling {i} — ünïcode"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "grep", "input": {"q": ["a", {"deep": [1, 2.5, None]}]}},
        ]}
    if kind == 2:
        return {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i - 1}",
             "content": [{"type": "text", "text": "résultat " * (i % 5)}], "is_error": False},
        ]}
    return {"role": ("system", "developer", "assistant")[i % 3], "content": None if i % 2 else f"sys {i}",
            "name": "n\u00e9"}


def rich_state(n: int, *, replaced: bool = False) -> Projection:
    """``n`` rich messages, every third pinned, token counts a mix of None, 0 and ints."""
    b = Builder().start()
    if replaced:
        b.replace([rich_message(i) for i in range(n // 2)])
        rest = range(n // 2, n)
    else:
        rest = range(n)
    for i in rest:
        b.add(rich_message(i))
    p = b.p
    for key in p.keys[::3]:
        b.pin(key)
    for i in range(len(p.tokens)):
        p.tokens[i] = None if i % 3 == 1 else i * 7  # (0 for the first message)
    assert len(p.messages) == n
    return p


def plain(value: Any) -> Any:
    """A deep copy as JSON would give it back (a packed list as the list it stands for)."""
    return orjson.loads(orjson.dumps(value, default=json_default))


# -- 1. dump_in_steps == snapshot --------------------------------------------------------------------------
STEPS = (1, 2, 3, 7)


def _sizes(k: int) -> list[int]:
    return sorted({0, 1, 2, max(0, k - 1), k, k + 1, 5 * k + 3, 40})


@pytest.mark.parametrize("replaced", [False, True])
@pytest.mark.parametrize("k", STEPS)
async def test_dump_in_steps_parses_to_the_snapshot(k: int, replaced: bool) -> None:
    """For every size around the step (0, 1, 2, k-1, k, k+1, many), the joined pieces parse to exactly what
    snapshot() gives: same messages, keys, token counts (None and ints), pins, facts."""
    for n in _sizes(k):
        state = rich_state(n, replaced=replaced)
        pieces = await dump_in_steps(state.capture(), step=k)
        assert all(isinstance(piece, bytes) for piece in pieces)
        got = orjson.loads(b"".join(pieces))
        want = orjson.loads(snapshot(state))
        assert got == want, (n, k)
        assert list(got) == list(want)  # the same fields, in the same order
        assert len(got["messages"]) == len(got["keys"]) == len(got["tokens"]) == n
        if n >= 3:  # (the state does hold what the test is about)
            assert got["pinned"] and None in got["tokens"] and any(isinstance(t, int) for t in got["tokens"])


@pytest.mark.parametrize("k", STEPS)
async def test_encode_of_pieces_equals_encode_of_the_joined_bytes(k: int) -> None:
    """encode() with the pieces is byte-identical to encode() with their concatenation, and decodes (CRCs
    checked) to the snapshot's state."""
    for n in _sizes(k):
        state = rich_state(n)
        pieces = await dump_in_steps(state.capture(), step=k)
        fields: dict[str, Any] = dict(session_id=S, seq=state.head_seq, position=1234, first_crc="0badf00d",
                                      last_crc="deadbeef", tokenizer="chars/4", front_json=b'{"front":"\xc3\xa9"}')
        stepped = encode(state_json=pieces, **fields)
        joined = encode(state_json=b"".join(pieces), **fields)
        assert stepped == joined
        cp = decode(stepped)
        assert cp.state == orjson.loads(snapshot(state)) and cp.seq == state.head_seq
        assert cp.front == {"front": "é"}


@pytest.mark.parametrize("k", STEPS)
async def test_dump_in_steps_lets_other_tasks_run_between_steps(k: int) -> None:
    """The event loop gets control back between steps: another task runs at least once per step boundary of
    each of the three lists (messages, keys, tokens)."""
    n = 5 * k + 3
    task = asyncio.ensure_future(dump_in_steps(rich_state(n).capture(), step=k))
    turns = 0
    while not task.done():
        turns += 1
        await asyncio.sleep(0)
    await task
    assert turns >= 3 * (math.ceil(n / k) - 1)


# -- 2. capture() is a snapshot ------------------------------------------------------------------------
def test_capture_is_not_changed_by_later_events() -> None:
    """After capture(): appends, token counts, a redaction, pins, a new session_started, a replacement and a
    clear on the live projection leave the captured state equal to to_state() as it was at capture time."""
    b = Builder().start()
    for i in range(12):
        b.add(rich_message(i))
    p = b.p
    b.pin(p.keys[4])
    p.tokens[0], p.tokens[5] = 11, 55
    captured = p.capture()
    at_capture = plain(p.to_state())
    assert plain(captured) == at_capture

    b.add({"role": "user", "content": "appended after the capture"})
    b.add({"role": "system", "content": "another"})
    for i in range(len(p.tokens)):
        p.tokens[i] = 1000 + i  # counts filled in on the live lists
    b.redact(p.keys[2])  # del of list items
    b.redact(p.keys[-1])
    b.pin(p.keys[7])
    b.unpin(p.keys[4])
    b.apply(ev.SESSION_STARTED, {"format": 1, "tokenizer": "other"})
    mid = plain(p.to_state())
    b.replace([{"role": "user", "content": "replaced"}])
    p.tokens[0] = 3
    b.pin(p.keys[0])
    b.clear()
    b.add({"role": "user", "content": "after the clear"})

    assert plain(captured) == at_capture
    assert mid != at_capture and plain(p.to_state()) != at_capture  # (the live state did change)


async def test_a_step_dump_of_a_capture_is_not_changed_by_events_between_steps() -> None:
    """The same, with the events applied while dump_in_steps is between steps (as in a background write)."""
    b = Builder().start()
    for i in range(30):
        b.add(rich_message(i))
    p = b.p
    want = orjson.loads(snapshot(p))
    task = asyncio.ensure_future(dump_in_steps(p.capture(), step=2))
    await asyncio.sleep(0)
    changes = [
        lambda: b.add({"role": "user", "content": "new"}),
        lambda: b.redact(p.keys[1]),
        lambda: p.tokens.__setitem__(3, 42),
        lambda: b.pin(p.keys[0]),
        lambda: b.redact(p.keys[25]),
        lambda: b.replace([{"role": "assistant", "content": "x"}] * 3),
        lambda: b.clear(),
    ]
    for change in changes:
        assert not task.done()
        change()
        await asyncio.sleep(0)
    assert orjson.loads(b"".join(await task)) == want


# -- 3. a background write overlapping writes stays a valid checkpoint -----------------------------------
def _history() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. ✓"}]
    for i in range(100):
        out += [{"role": "user", "content": f"question {i} ü"},
                {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]},
                {"role": "developer", "content": "note"} if i % 17 == 0 else {"role": "user", "content": "ok"}]
    return out


EVERY = 20  # more than the concurrent writes below: close does not write another checkpoint over the one tested


@pytest.mark.parametrize("scenario", ["edits", "replace_and_clear"])
async def test_a_checkpoint_overlapping_writes_is_valid(storage: Path, monkeypatch: pytest.MonkeyPatch,
                                                        scenario: str) -> None:
    """A periodic checkpoint is serialised two list items per loop turn; meanwhile messages are added, pinned,
    redacted, the history replaced and cleared. The checkpoint written holds the state at its own seq (verify
    compares it with the log folded up to that seq), and resuming from it equals a full replay."""
    monkeypatch.setattr(cppayload, "DUMP_STEP", 2)
    phase: list[str] = []
    real_dump = cppolicy.dump_in_steps

    async def spy(captured: dict[str, Any], step: int | None = None) -> list[bytes]:
        phase.append("dumping")
        try:
            return await real_dump(captured, step)
        finally:
            phase.append("dumped")

    monkeypatch.setattr(cppolicy, "dump_in_steps", spy)

    store = await PersistentContextManager.open(storage_path=storage, session_id=S, checkpoint_every=EVERY,
                                                **CONFIG)
    try:
        await store.set_messages(_history())  # a fresh store: set_messages replaces the history
        i = 0
        while store._checkpoints._task is None:
            await store.add_message({"role": ("user", "assistant")[i % 2], "content": f"m{i} é"})
            i += 1
        task = store._checkpoints._task
        seq = store._state.head_seq
        assert seq == EVERY and not (storage / S / CHECKPOINT_NAME).exists()
        await asyncio.sleep(0)  # the write starts serialising what _prepare captured
        assert phase == ["dumping"]

        n = len(store._state.messages)
        ops: list[Any] = [
            lambda: store.add_message({"role": "user", "content": "during the checkpoint"}),
            lambda: store.pin(3),
            lambda: store.redact(1),  # a message the first steps already serialised
            lambda: store.redact(n - 5),  # one they have not reached yet
            lambda: store.add_message({"role": "system", "content": "late system"}),
            lambda: store.pin(n - 20),
        ]
        if scenario == "replace_and_clear":
            ops += [
                lambda: store.set_messages([{"role": "user", "content": "replaced"}, {"role": "assistant",
                                                                                      "content": "fine"}]),
                lambda: store.pin(0),
                lambda: store.clear(),
                lambda: store.add_message({"role": "user", "content": "after the clear"}),
            ]
        assert len(ops) < EVERY
        for op in ops:
            assert not task.done() and phase == ["dumping"], "the checkpoint write did not overlap the writes"
            await op()
            await asyncio.sleep(0)  # one more step of the dump
        assert not task.done() and phase == ["dumping"]
        assert store._state.head_seq == seq + len(ops)
        await task
        assert phase == ["dumping", "dumped"]
        written = (storage / S / CHECKPOINT_NAME).read_bytes()
        assert decode(written).seq == seq
    finally:
        await store.close()
    # The redactions came after the capture: the close wrote a newer checkpoint, without the redacted messages'
    # texts (docs/format.md, "The message section"); the one written meanwhile is put back to be checked below.
    final = (storage / S / CHECKPOINT_NAME).read_bytes()
    assert final != written and decode(final).seq == seq + len(ops)
    (storage / S / CHECKPOINT_NAME).write_bytes(written)

    from context_persistent.operations.repair import verify

    report = verify(storage / S, S)
    assert report.checkpoint["status"] == "valid", report.checkpoint
    assert report.ok and report.checkpoint["seq"] == seq and report.checkpoint["behind"] == len(ops)

    twin = storage.parent / "twin"
    shutil.copytree(storage, twin)
    (twin / S / CHECKPOINT_NAME).unlink()
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, **CONFIG) as resumed:
        assert resumed.stats()["checkpoint"]["loaded_seq"] == seq
        messages, pinned = await resumed.get_messages(), sorted(resumed._state.pinned)
    async with await PersistentContextManager.open(storage_path=twin, session_id=S, **CONFIG) as replayed:
        assert replayed.stats()["checkpoint"]["loaded_seq"] == 0
        assert messages == await replayed.get_messages()
        assert pinned == sorted(replayed._state.pinned)
    if scenario == "edits":  # two added, two redacted, two pinned
        assert len(messages) == n and len(pinned) == 2


# -- 4. SystemIndex == a full scan -------------------------------------------------------------------------
ROLES = ("user", "assistant", "system", "developer", "tool")
INDEX_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(ROLES)),
    st.tuples(st.just("add"), st.sampled_from(ROLES)),
    st.tuples(st.just("redact"), st.integers(-1, 60)),  # -1: a key that is not in the history
    st.tuples(st.just("replace"), st.lists(st.sampled_from(ROLES), max_size=8)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("pin"), st.integers(0, 60)),
    st.tuples(st.just("count"), st.integers(0, 60)),
    st.tuples(st.just("check"), st.none()),
    st.tuples(st.just("check"), st.none()),
), max_size=60)


def brute(state: Projection) -> list[int]:
    return [i for i, m in enumerate(state.messages) if is_system(m)]


@settings(max_examples=400, deadline=None)
@given(ops=INDEX_OPS)
def test_the_system_index_equals_a_full_scan(ops: list[tuple[str, Any]]) -> None:
    """Whatever events happen between two calls, SystemIndex.of() gives the indices a full scan gives."""
    b = Builder().start()
    p = b.p
    index = SystemIndex()
    for op, arg in ops:
        n = len(p.messages)
        if op == "add":
            b.add({"role": arg, "content": f"{arg} {b.seq}"})
        elif op == "redact":
            b.redact(p.keys[arg % n] if n and arg >= 0 else (b.seq + 5) << 20)
        elif op == "replace":
            b.replace([{"role": r, "content": r} for r in arg])
        elif op == "clear":
            b.clear()
        elif op == "pin" and n:
            b.pin(p.keys[arg % n])
        elif op == "count" and n:
            p.tokens[arg % n] = arg
        elif op == "check":
            assert index.of(p) == brute(p)
    assert index.of(p) == brute(p)
    assert index.of(p) == brute(p)  # (twice: nothing changed)


def test_the_system_index_scans_only_what_was_appended(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of SystemIndex: after appends only the new messages are looked at; after a redaction,
    everything again."""
    calls: list[int] = []

    def counting(message: dict[str, Any]) -> bool:
        calls.append(1)
        return is_system(message)

    monkeypatch.setattr(cpfront, "is_system", counting)
    b = Builder().start()
    for i in range(200):
        b.add({"role": ("system", "user", "assistant", "developer")[i % 7 % 4], "content": str(i)})
    index = SystemIndex()
    assert index.of(b.p) == brute(b.p) and len(calls) == 200
    for i in range(3):
        b.add({"role": "developer", "content": "more"})
    assert index.of(b.p) == brute(b.p) and len(calls) == 203
    b.redact(b.p.keys[10])
    assert index.of(b.p) == brute(b.p) and len(calls) == 203 + 202


async def test_seed_takes_the_system_indices_of_a_lazy_history(storage: Path) -> None:
    """On a lazily opened store, seed() takes the indices the front section knows (plus appended ones) without
    loading anything; after materialising, of() equals a full scan, and keeps doing so after more events."""
    history = [{"role": "system", "content": "You are helpful."}]
    for i, m in enumerate(tool_turns(500)):
        history.append(m)
        if i % 397 == 5:
            history.append({"role": ("developer", "system")[i % 2], "content": f"rule {i}"})
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, max_tokens=10_000,
                                                   checkpoint_every=1, **CONFIG) as store:
        await store.set_messages(history)
    assert decode((storage / S / CHECKPOINT_NAME).read_bytes()).front is not None
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, max_tokens=10_000,
                                                   **CONFIG) as store:
        state = store._state
        assert state.is_lazy
        await store.add_message({"role": "developer", "content": "appended while lazy"})
        await store.add_message({"role": "user", "content": "and a question"})
        index = SystemIndex()
        index.seed(state)
        assert state.is_lazy and index.scanned == len(state.messages)
        seeded = list(index.found)
        assert index.of(state) == seeded and state.is_lazy  # nothing appended since: nothing loaded
        state.materialise()
        assert not state.is_lazy
        assert seeded == brute(state) and len(seeded) >= 4
        assert index.of(state) == brute(state)
        assert store._checkpoints._system.of(state) == brute(state)  # (the store's own, seeded at open)
        await store.add_message({"role": "system", "content": "after loading"})
        assert index.of(state) == brute(state)
        await store.redact(0)
        assert index.of(state) == brute(state)


# -- 5. front_of: pinned spans found by bisection == a linear scan -------------------------------------------
def recent_start(state: Projection, recent_tokens: int) -> int:
    """Where front_of's newest-messages span starts (pinned spans are added only before it)."""
    messages, tokens = state.messages, state.tokens
    acc, r = 0, len(messages)
    while r > 0 and acc < recent_tokens:
        r -= 1
        t = tokens[r]
        acc += t if t is not None else cpfront._low_estimate(messages[r])
    return cpfront._turns_back(messages, r, FRONT_EXTRA_TURNS + 1, max(0, r - FRONT_MAX_SPAN))


def reference_idx(state: Projection, keep_head: int, recent_tokens: int) -> list[int]:
    """front_of's idx computed with the former linear scan over the keys for pinned messages."""
    unpinned = Projection.from_state(state.capture())
    unpinned.pinned = set()
    keep = set(front_of(unpinned, keep_head=keep_head, recent_tokens=recent_tokens)["idx"])
    messages, keys = state.messages, state.keys
    n, r = len(messages), recent_start(state, recent_tokens)
    for p, k in enumerate(keys):
        if k in state.pinned and p < r:
            lo = cpfront._turns_back(messages, p, FRONT_EXTRA_TURNS + 1, max(0, p - FRONT_MAX_SPAN))
            hi = min(cpfront._turns_ahead(messages, p, FRONT_EXTRA_TURNS, min(n, p + FRONT_MAX_SPAN)) + 1, n)
            keep.update(range(lo, hi))
    return sorted(keep)


def _check_front(state: Projection, keep_head: int, recent_tokens: int) -> list[int]:
    front = front_of(state, keep_head=keep_head, recent_tokens=recent_tokens)
    idx = front["idx"]
    at = {k: i for i, k in enumerate(state.keys)}
    for k in state.pinned:
        if k in at:
            assert at[k] in idx, f"pinned message {at[k]} is not in the front section"
    assert idx == reference_idx(state, keep_head, recent_tokens)
    with_index = front_of(state, keep_head=keep_head, recent_tokens=recent_tokens, system=SystemIndex().of(state))
    assert with_index == front
    assert front["keys"] == [state.keys[i] for i in idx] and front["messages"] == [state.messages[i] for i in idx]
    return idx


@pytest.mark.parametrize("recent_tokens", [1, 3_000, 60_000])
def test_front_of_keeps_every_pinned_span_of_a_long_history(recent_tokens: int) -> None:
    """Pins spread through a long history (keys from a replacement, then appends; redactions leave gaps; pins
    of keys that are not in the history) give the spans the linear scan gave, each pinned message included."""
    b = Builder().start()
    turns = tool_turns(1500, size=40)
    b.replace(turns[:2000])
    for m in turns[2000:]:
        b.add(m)
    p = b.p
    redacted = []
    for i in range(0, len(p.messages), 397):
        redacted.append(p.keys[i + 1])
        b.redact(redacted[-1])
    for i in (0, 1, 2, 97, 1999, 2000, 2001, 3333, 4100, len(p.keys) - 30, len(p.keys) - 1):
        b.pin(p.keys[i])
    for key in redacted[::2]:
        b.pin(key)  # between two keys: not in the history
    b.pin((b.seq + 10) << 20)  # after every key
    for i in range(0, len(p.tokens), 5):
        p.tokens[i] = 30
    r = recent_start(p, recent_tokens)
    for i in (r, r + 1, r + 5):  # at the start of the newest-messages span: their turns reach before it
        if 0 <= i < len(p.keys):
            b.pin(p.keys[i])
    assert len(p.messages) > 5000 and recent_start(p, recent_tokens) == r
    idx = _check_front(p, keep_head=2, recent_tokens=recent_tokens)
    assert len(idx) < len(p.messages) or recent_tokens == 60_000


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conv=conversations(max_segments=30), reps=st.integers(1, 4), keep_head=st.integers(0, 4),
       recent_tokens=st.integers(1, 4_000), split=st.floats(0, 1), redactions=st.lists(st.integers(0, 10_000),
                                                                                      max_size=5),
       strays=st.lists(st.integers(0, 10_000), max_size=3))
def test_front_of_pinned_spans_equal_a_linear_scan(conv: tuple, reps: int, keep_head: int, recent_tokens: int,
                                                   split: float, redactions: list[int], strays: list[int]) -> None:
    """Random histories (both tool formats, system messages anywhere), random pins, redactions and pins of keys
    not in the history: front_of's idx equals the linear scan's and holds every pinned message."""
    messages, pins = conv
    messages, pins = [dict(m) for m in messages * reps], pins * reps
    cut = int(len(messages) * split)
    b = Builder().start()
    b.replace(messages[:cut])
    for m in messages[cut:]:
        b.add(m)
    p = b.p
    for i, pinned in enumerate(pins):
        if pinned:
            b.pin(p.keys[i])
    for r in redactions:
        if p.keys:
            b.redact(p.keys[r % len(p.keys)])
    for s in strays:
        b.pin(p.keys[s % len(p.keys)] + 1 if p.keys and s % 2 else (b.seq + 1 + s) << 20)
    _check_front(p, keep_head=keep_head, recent_tokens=recent_tokens)


def test_front_of_with_no_recent_budget_keeps_only_the_head_and_pins() -> None:
    """recent_tokens=0 used to read one past the end (IndexError); now the newest span is simply empty."""
    state = rich_state(50)
    state.pinned = set()
    front = cpfront.front_of(state, keep_head=1, recent_tokens=0)
    assert front["n"] == 50
    assert max(front["idx"]) < 49  # nothing kept for recency: the last message is not in the front
    assert set(front["system"]) <= set(front["idx"])
    pinned = state.keys[40]
    state.pinned = {pinned}
    assert 40 in cpfront.front_of(state, keep_head=1, recent_tokens=0)["idx"]  # a pin is kept all the same
