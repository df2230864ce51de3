"""The ``expired`` event (segment retention): its fold drops the messages of the expired records except the
system prompt and pinned messages, and a replay that starts after the expired range (seeded from the record,
chain checked from its boundary crc) ends in the same views as the live fold (a Hypothesis property)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent.model import codec
from context_persistent.model import events as ev
from context_persistent.errors import InvalidRecordError
from context_persistent.model.projection import Projection, make_key
from context_persistent.model.retention import expired_data, fold_after_expiry

SID = "exp"

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(["user", "assistant", "tool", "system", "developer"])),
    st.tuples(st.just("add"), st.sampled_from(["user", "assistant"])),
    st.tuples(st.just("pin"), st.integers(0, 50)),
    st.tuples(st.just("unpin"), st.integers(0, 50)),
    st.tuples(st.just("redact"), st.integers(0, 50)),
    st.tuples(st.just("prompt"), st.integers(1, 3)),
    st.tuples(st.just("replace"), st.integers(0, 4)),
    st.tuples(st.just("clear"), st.just(0)),
), min_size=1, max_size=40)


class Log:
    """Records written the way the store writes them (chained), folded live as they are written."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.live = Projection()
        self.prev = codec.root_crc(SID)
        self.n = 0
        self.write(ev.SESSION_STARTED, {"format": 2, "tokenizer": "chars/4", "program": "test", "session_id": SID})

    def write(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        line = codec.encode_event(len(self.records) + 1, kind, data, prev=self.prev)
        rec = codec.decode(line)
        self.prev = codec.crc_of(line)
        self.records.append(rec)
        self.live.apply(rec)
        return rec

    def message(self, role: str) -> dict[str, Any]:
        self.n += 1
        return {"role": role, "content": f"{role} {self.n}"}

    def op(self, kind: str, arg: Any) -> None:
        keys = self.live.keys
        if kind == "add":
            self.write(ev.MESSAGE_ADDED, {"message": self.message(arg)})
        elif kind in ("pin", "unpin", "redact") and keys:
            key = keys[arg % len(keys)]
            seq, index = key >> 20, key & ((1 << 20) - 1)
            self.write({"pin": ev.PINNED, "unpin": ev.UNPINNED, "redact": ev.REDACTED}[kind],
                       {"key": key, "seq": seq, "index": index})
        elif kind == "prompt":
            self.write(ev.SYSTEM_PROMPT_SET, {"messages": [self.message("system") for _ in range(arg)],
                                              "source": "factory"})
        elif kind == "replace":
            roles = ["system", "user", "assistant", "user"]
            self.write(ev.MESSAGES_REPLACED, {"messages": [self.message(roles[i % 4]) for i in range(arg)]})
        elif kind == "clear":
            self.write(ev.CLEARED, {})


def _view(p: Projection) -> tuple[list[Any], list[int], list[int]]:
    return list(p.messages), list(p.keys), sorted(p.pinned)


def _expire(log: Log, boundary: int) -> dict[str, Any]:
    upto = Projection()
    for rec in log.records[:boundary]:
        upto.apply(rec)
    data = expired_data(upto, log.live, 1, boundary, log.records[boundary - 1]["crc"],
                        segments=[{"name": "seg-1", "first_seq": 1, "last_seq": boundary, "bytes": 0,
                                   "sha256": "sha256:" + "0" * 64}],
                        rule="max_segments", reason="test", policy={"max_segments": 1},
                        expired_at=codec.now_iso())
    return log.write(ev.EXPIRED, data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.data())
def test_replay_after_expiry_equals_the_live_fold(before: list[tuple[str, Any]], draw: Any) -> None:
    log = Log()
    for kind, arg in before:
        log.op(kind, arg)
    boundary = draw.draw(st.integers(1, len(log.records)))
    later = draw.draw(ops)
    cut = draw.draw(st.integers(0, len(later)))
    for kind, arg in later[:cut]:  # more records after the boundary, before the expiry is written
        log.op(kind, arg)
    rec = _expire(log, boundary)
    carried = {c["key"] for c in rec["data"]["carried"]}
    # every surviving message either came after the boundary or is carried (system prompt / pinned)
    for k in log.live.keys:
        assert k > make_key(boundary, (1 << 20) - 1) or k in carried
    disk = fold_after_expiry(SID, rec["data"], log.records)
    assert _view(disk) == _view(log.live)
    for kind, arg in later[cut:]:  # and they stay equal as the log goes on
        written = len(log.records)
        log.op(kind, arg)
        for r in log.records[written:]:
            disk.apply(r)
    assert _view(disk) == _view(log.live)


def test_system_prompt_and_pins_survive_others_go() -> None:
    log = Log()
    log.op("prompt", 1)          # seq 2: the system prompt
    log.op("add", "user")        # seq 3
    log.op("add", "assistant")   # seq 4
    log.op("pin", 1)             # seq 5: pins seq 3's message
    log.op("add", "user")        # seq 6
    rec = _expire(log, 5)
    assert [m["content"] for m in log.live.messages] == ["system 1", "user 2", "user 4"]
    assert [c["key"] for c in rec["data"]["carried"]] == [make_key(2), make_key(3)]
    assert sorted(log.live.pinned) == [make_key(3)]
    assert rec["data"]["layout"] == [{"key": make_key(2)}, {"key": make_key(3)}, {"run": "other"}]
    disk = fold_after_expiry(SID, rec["data"], log.records)
    assert _view(disk) == _view(log.live)
    # a later pin of an expired (not carried) message pins nothing
    log.write(ev.PINNED, {"key": make_key(4), "seq": 4, "index": 0})
    assert make_key(4) not in log.live.pinned


def test_replay_checks_the_chain_from_the_boundary() -> None:
    log = Log()
    for _ in range(4):
        log.op("add", "user")
    rec = _expire(log, 3)
    bad = dict(rec["data"], boundary_crc="00000000")
    with pytest.raises(ValueError, match="predecessor"):
        fold_after_expiry(SID, bad, log.records)
    with pytest.raises(ValueError, match="expected 4"):
        fold_after_expiry(SID, rec["data"], log.records[:3] + log.records[4:])


@pytest.mark.parametrize("change, words", [
    ({"first_seq": 0}, "range of earlier seqs"),
    ({"last_seq": 99}, "range of earlier seqs"),
    ({"carried": [{"key": make_key(9), "message": {"role": "user", "content": "x"}}]}, "carried keys"),
])
def test_a_malformed_expired_record_is_corrupt(change: dict[str, Any], words: str) -> None:
    log = Log()
    for _ in range(3):
        log.op("add", "user")
    rec = _expire(log, 2)
    p = Projection()
    for r in log.records[:-1]:
        p.apply(r)
    with pytest.raises(InvalidRecordError, match=words):
        p.apply({**rec, "data": {**rec["data"], **change}})


class _Pager:
    """A paged history's reader over records held by position (as pages.MessageReader reads the log). Reading a
    message of an expired record (``gone``: their positions) fails the test: with the segments in the trash,
    such a read would fail for real."""

    def __init__(self, by_position: dict[int, dict[str, Any]]) -> None:
        self.by_position = by_position
        self.gone: set[int] = set()

    def fetch(self, ref: int) -> dict[str, Any]:
        from context_persistent.storage.pages import message_of, split_ref

        position, index = split_ref(ref)
        assert position not in self.gone, f"a ref into expired record at {position} was read"
        message = message_of(self.by_position[position], index)
        assert isinstance(message, dict)
        return message

    def fetch_many(self, refs: list[int]) -> list[dict[str, Any]]:
        return [self.fetch(r) for r in refs]

    def put(self, ref: int, message: dict[str, Any], size: int) -> None:
        return None


def _position(i: int) -> int:
    return 1000 * (i + 1)  # (the byte position of the i-th record, 0-based; any increasing numbers do)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.data())
def test_paged_histories_point_carried_messages_into_the_expired_record(before: list[tuple[str, Any]],
                                                                         draw: Any) -> None:
    """With a paged history (refs into the log), the live fold re-points each carried message to its copy in
    the ``expired`` record, no ref into an expired record is left, and a replay seeded from the record at its
    position gives the same refs and views."""
    log = Log()
    for kind, arg in before:
        log.op(kind, arg)
    boundary = draw.draw(st.integers(1, len(log.records)))
    for kind, arg in draw.draw(ops):
        log.op(kind, arg)
    rec = _expire(log, boundary)
    for kind, arg in draw.draw(ops):
        log.op(kind, arg)
    by_position = {_position(i): r for i, r in enumerate(log.records)}
    live_pager = _Pager(by_position)
    live = Projection(live_pager)
    for i, r in enumerate(log.records):
        live.apply(r, _position(i), 100)
    at = _position(rec["seq"] - 1)
    disk_pager = _Pager(by_position)
    disk = Projection.seeded(rec["data"], disk_pager, at)
    for i, r in enumerate(log.records):
        if r["seq"] > boundary:
            disk.apply(r, _position(i), 100)
    expired = {_position(i) for i in range(boundary)}
    live_pager.gone = disk_pager.gone = expired
    items = live.messages.items  # type: ignore[attr-defined]
    assert not any(type(v) is int and v >> 20 in expired for v in items)
    assert disk.messages.items == items  # type: ignore[attr-defined]
    assert _view(live) == _view(disk) == _view(log.live)


def test_a_message_of_the_range_removed_before_a_prompt_change_is_removed_at_the_same_point_of_a_seeded_replay(
        ) -> None:
    """The expired message is redacted after the range and before a ``system_prompt_set``: in the live fold the
    redaction makes the later system message the leading one, which the prompt then replaces. A replay seeded
    from the record must remove the message's placeholder at the redaction too (it names its key), or the
    prompt is inserted before the system message instead of replacing it (found by the property above)."""
    log = Log()
    for kind, arg in [("add", "user"), ("add", "system"), ("redact", 0), ("prompt", 1), ("add", "user")]:
        log.op(kind, arg)
    rec = _expire(log, 2)
    assert {"run": "other", "named": make_key(2)} in rec["data"]["layout"]
    by_position = {_position(i): r for i, r in enumerate(log.records)}
    disk = Projection.seeded(rec["data"], _Pager(by_position), _position(rec["seq"] - 1))
    live = Projection(_Pager(by_position))
    for i, r in enumerate(log.records):
        live.apply(r, _position(i), 100)
        if r["seq"] > 2:
            disk.apply(r, _position(i), 100)
    assert _view(disk) == _view(live) == _view(log.live)
    assert [m["content"] for m in live.messages] == ["system 3", "user 4"]
