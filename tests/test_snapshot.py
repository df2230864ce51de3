"""Export: snapshot files (jsonl, json, markdown), their header and checksum, atomic writes, round trips
through import, and time travel (``at_seq`` equals a replay of the first N events)."""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent.operations.search.sqlite_index import INDEX_DIR
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent import MalformedInputError, PersistentContextManager, import_
from context_persistent.transfer import snapshot_codec as sc
from context_persistent.storage.log import scan
from context_persistent.model.projection import Projection
from context_persistent.model.views import conversation_view, reasoning_view

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Zoë says « bonjour » ✓ 谢谢", "metadata": {"source": "cli"}},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"p\": 1.5}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a\nb"},
    {"role": "assistant", "content": [{"type": "text", "text": "reading"},
                                      {"type": "tool_use", "id": "t1", "name": "cat", "input": {"f": "x"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "data"}]},
    {"role": "assistant", "content": "done"},
]


async def _session(storage: Path, sid: str = "s") -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid)
    for m in MESSAGES:
        await store.add_message(m)
    await store.pin(1)
    return store


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
async def test_export_then_import_gives_an_identical_history_with_pins(storage: Path, tmp_path: Path, fmt: str) -> None:
    """A jsonl or json snapshot of the full view imports into a session with the same messages and pins."""
    async with await _session(storage) as store:
        header = await store.export(tmp_path / f"snap.{fmt}", format=fmt)
        original = await store.get_messages()
        pinned_at = [i for i, k in enumerate(store._state.keys) if k in store._state.pinned]
    assert header["messages"] == len(MESSAGES) and header["pinned"] == [1] and header["session_id"] == "s"
    result = await import_(tmp_path / f"snap.{fmt}", session_id="copy", storage_path=storage)
    assert result["source"] == "snapshot"
    async with await PersistentContextManager.open(storage_path=storage, session_id="copy", readonly=True) as copy:
        assert await copy.get_messages() == original
        assert [i for i, k in enumerate(copy._state.keys) if k in copy._state.pinned] == pinned_at
        assert copy._state.session["imported"]["snapshot"]["session_id"] == "s"


async def test_header_names_session_range_version_time_and_checksum_of_the_body(storage: Path, tmp_path: Path) -> None:
    """The JSONL header carries session id, seq range, format version, creation time, view and a body digest."""
    async with await _session(storage) as store:
        await store.export(tmp_path / "s.jsonl")
        head = store.head_seq
    data = (tmp_path / "s.jsonl").read_bytes()
    first, _, body = data.partition(b"\n")
    header = orjson.loads(first)
    assert header[sc.MARKER] == sc.SNAPSHOT_VERSION
    assert header["seq_range"] == [1, head] and header["view"] == "full" and header["format"] == "jsonl"
    assert header["created_at"].endswith("+00:00")
    assert header["body_sha256"] == sc.sha256(body)
    assert [orjson.loads(line) for line in body.splitlines()] == MESSAGES


async def test_export_is_atomic_private_and_leaves_no_temp_file(storage: Path, tmp_path: Path) -> None:
    """The snapshot is mode 0600, replaces an older file whole, and no temp file remains."""
    out = tmp_path / "out"
    out.mkdir()
    target = out / "snap.jsonl"
    target.write_bytes(b"old contents")
    async with await _session(storage) as store:
        await store.export(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_bytes().startswith(b'{"context_persistent_snapshot"')
    assert os.listdir(out) == ["snap.jsonl"]


async def test_export_into_a_missing_folder_fails_cleanly(storage: Path, tmp_path: Path) -> None:
    """Exporting into a folder that does not exist raises FileNotFoundError naming it."""
    async with await _session(storage) as store:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            await store.export(tmp_path / "nope" / "snap.jsonl")


async def test_markdown_is_readable_and_one_way(storage: Path, tmp_path: Path) -> None:
    """A Markdown export shows the messages for people, and importing it is refused with a clear message."""
    async with await _session(storage) as store:
        await store.export(tmp_path / "chat.md", format="markdown", view="conversation")
    text = (tmp_path / "chat.md").read_text(encoding="utf-8")
    assert "« bonjour »" in text and "## 1. user" in text and "tool_use" not in text
    with pytest.raises(ValueError, match="one-way"):
        await import_(tmp_path / "chat.md", session_id="back", storage_path=storage)
    renamed = tmp_path / "chat.txt"
    renamed.write_bytes((tmp_path / "chat.md").read_bytes())
    with pytest.raises(ValueError, match="one-way"):
        await import_(renamed, session_id="back", storage_path=storage, source="snapshot")
    assert not (storage / "back").exists()


@pytest.mark.parametrize("view,fold", [("conversation", conversation_view), ("reasoning", reasoning_view)])
async def test_views_export_what_the_view_functions_return(storage: Path, tmp_path: Path, view: str, fold: Any) -> None:
    """The conversation and reasoning exports hold exactly those views of the history."""
    async with await _session(storage) as store:
        header = await store.export(tmp_path / "v.json", format="json", view=view)
    doc = orjson.loads((tmp_path / "v.json").read_bytes())
    assert doc["messages"] == fold(MESSAGES) and header["pinned"] == []


async def test_request_view_export_with_a_budget(storage: Path, tmp_path: Path) -> None:
    """A request-view export records its budget and holds what get_messages_for_request returns."""
    async with await _session(storage) as store:
        header = await store.export(tmp_path / "r.jsonl", view="request", token_budget=5000)
        expected = await store.get_messages_for_request(token_budget=5000)
    _, body = (tmp_path / "r.jsonl").read_bytes().split(b"\n", 1)
    assert header["token_budget"] == 5000
    assert [orjson.loads(x) for x in body.splitlines()] == expected


@pytest.mark.parametrize("damage", ["edit", "truncate", "drop_newline_and_line"])
async def test_damaged_snapshot_is_refused_and_nothing_is_created(storage: Path, tmp_path: Path, damage: str) -> None:
    """An edited or truncated snapshot fails its checks (naming the line when it can) and creates no session."""
    async with await _session(storage) as store:
        await store.export(tmp_path / "s.jsonl")
    data = (tmp_path / "s.jsonl").read_bytes()
    if damage == "edit":
        data = data.replace("bonjour".encode(), b"bonsoir")
        match = "checksum mismatch"
    elif damage == "truncate":
        data = data[:-20]
        match = "line 8: is truncated"
    else:
        data = data[: data.rstrip(b"\n").rfind(b"\n") + 1]
        match = "header says 7 messages but the file holds 6"
    (tmp_path / "s.jsonl").write_bytes(data)
    with pytest.raises(MalformedInputError, match=match):
        await import_(tmp_path / "s.jsonl", session_id="bad", storage_path=storage)
    assert not (storage / "bad").exists()
    assert not [p for p in storage.iterdir() if p.name.startswith(".") and p.name != INDEX_DIR]  # (the index is no leftover)


async def test_bad_arguments_are_value_errors_naming_the_choices(storage: Path, tmp_path: Path) -> None:
    """Unknown format/view and an out-of-range at_seq raise ValueError saying what is allowed."""
    async with await _session(storage) as store:
        with pytest.raises(ValueError, match="format must be one of jsonl, json, markdown"):
            await store.export(tmp_path / "x", format="yaml")
        with pytest.raises(ValueError, match="view must be one of"):
            await store.export(tmp_path / "x", view="everything")
        with pytest.raises(ValueError, match="beyond the last event"):
            await store.export(tmp_path / "x", at_seq=store.head_seq + 1)
        with pytest.raises(ValueError, match="integer >= 1"):
            await store.export(tmp_path / "x", at_seq=0)
        with pytest.raises(ValueError, match="only to view='request'"):
            await store.export(tmp_path / "x", token_budget=10)
    assert not (tmp_path / "x").exists()


# -- time travel ------------------------------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(MESSAGES)),
    st.tuples(st.just("replace"), st.lists(st.sampled_from(MESSAGES), max_size=3)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("pin"), st.integers(0, 5)),
    st.tuples(st.just("redact"), st.integers(0, 5)),
), min_size=1, max_size=12)


async def _apply_ops(store: PersistentContextManager, ops: list[tuple[str, Any]]) -> None:
    for op, arg in ops:
        n = len(await store.get_messages())
        if op == "add":
            await store.add_message(arg)
        elif op == "replace" and not store.loaded_from_file:
            await store.set_messages(arg)
        elif op == "clear":
            await store.clear()
        elif op == "pin" and n:
            await store.pin(arg % n)
        elif op == "redact" and n:
            await store.redact(arg % n)


async def _check_every_seq(storage: Path, out: Path) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="tt") as store:
        records = [rec for rec, _ in scan(store.path)]
        # A redaction hides its message (and, in the past, any identical copy of it) at every seq.
        by_key = {(r["seq"] << 20) + i: m for r in records if r["type"] in ("message_added", "messages_replaced")
                  for i, m in enumerate([r["data"]["message"]] if r["type"] == "message_added"
                                        else r["data"]["messages"])}
        hidden_keys = {r["data"]["key"] for r in records if r["type"] == "redacted"}
        hidden = [by_key[k] for k in hidden_keys]
        for n in range(1, store.head_seq + 1):
            fold = Projection()
            for rec in records[:n]:
                fold.apply(rec)
            shown = [(k, m) for k, m in zip(fold.keys, fold.messages) if k not in hidden_keys and m not in hidden]
            header = await store.export(out, at_seq=n)
            _, body = out.read_bytes().split(b"\n", 1)
            assert [orjson.loads(x) for x in body.splitlines()] == [m for _, m in shown], f"at_seq={n}"
            assert header["seq_range"] == [1, n]
            assert header["pinned"] == [i for i, (k, _) in enumerate(shown) if k in fold.pinned]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_at_seq_export_equals_a_replay_of_the_first_n_events(ops: list[tuple[str, Any]]) -> None:
    """For any history (adds, replacements, clears, pins, redactions), export at_seq=N equals folding N records,
    less the messages redacted at any seq."""
    with tempfile.TemporaryDirectory() as d:
        async def run() -> None:
            async with await PersistentContextManager.open(storage_path=d, session_id="tt") as store:
                await _apply_ops(store, ops)
            await _check_every_seq(Path(d), Path(d) / "snap.jsonl")

        asyncio.run(run())


async def test_time_travel_store_offers_every_view_and_leaves_the_writer_alone(storage: Path) -> None:
    """store.at(seq) is a read-only past store (views, stats); the live writer keeps writing meanwhile."""
    async with await _session(storage) as store:
        past = await store.at(4)
        try:
            assert await past.get_messages() == MESSAGES[:3]
            assert await past.get_conversation_view() == conversation_view(MESSAGES[:3])
            assert past.stats()["head_seq"] == 4
            await store.add_message({"role": "user", "content": "later"})
            assert len(await past.get_messages()) == 3
        finally:
            await past.close()
        assert (await store.get_messages())[-1] == {"role": "user", "content": "later"}
