"""Request views made from an upper bound of the tokens (store/view_bound.py, #23)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager
from context_persistent.model.tokens import TokenCounter
from context_persistent.store import view_bound
from context_persistent.store.view_bound import bound

SAMPLES: list[dict[str, Any]] = [
    {"role": "user", "content": "hello"},
    {"role": "user", "content": ""},
    {"role": "assistant", "content": "日本語のテキスト、絵文字 🎉🎉 and ümlauts " * 20},
    {"role": "assistant", "content": "\n\t\u0000 control \u0007 characters"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "/a/b"}'}},
        {"id": "c2", "type": "function", "function": {"name": "x", "arguments": {"k": [1, 2.5, None, True]}}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "read", "content": "x" * 5000},
    {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "n",
                                                                      "input": {"q": "ü" * 300}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "1e16 " * 100}, "plain"]}]},
    {"role": "user", "content": {"odd": 1e16}},
    {"role": "user", "content": [{"type": "thinking", "thinking": "ab " * 400}, {"type": "image", "data": "QUJD"}]},
]


@pytest.mark.parametrize("encoding", ["cl100k_base", "o200k_base", "chars/4"])
def test_the_bound_is_never_below_a_count(encoding: str) -> None:
    """For every counter of ours, a message's bound (JSON bytes + overheads) is at least its count."""
    counter = TokenCounter(encoding)
    for m in SAMPLES:
        assert bound(m) >= counter.count_message(m), m


async def _store(path: Path, **config: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=path, session_id="s", fsync="never", **config)


def _turns(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i} " * 5})
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "look", "arguments": "{}"}}]})
        out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"found {i}"})
        out.append({"role": "assistant", "content": f"answer {i}"})
    return out


async def test_a_view_under_its_bound_loads_no_encoding_and_equals_the_counted_view(tmp_path: Path) -> None:
    """While the bound fits, the view is made without the tokenizer (none loads) and holds exactly the messages
    the counted view holds; ``compact()`` counts and finds the same messages."""
    store = await _store(tmp_path, tokenizer="o200k_base")
    await store.add_messages(_turns(20))
    await store.add_message({"role": "assistant", "content": None, "tool_calls": [  # (an open call: repaired)
        {"id": "open", "type": "function", "function": {"name": "look", "arguments": "{}"}}]})
    counter = store._s.counter
    view = await store.get_messages_for_request(token_budget=100_000)
    stats = store._views.cache[4].stats  # type: ignore[index]
    assert not counter.loaded and stats["token_count_exact"] is False
    assert stats["repairs"]["placeholders_added"] == ["open"]
    bounded_total = stats["token_count"]
    assert await store.compact(token_budget=100_000) == 0 and counter.loaded
    exact = store._views.cache[4]  # type: ignore[index]
    assert exact.messages == view and exact.stats.get("token_count_exact", True) is True
    assert exact.token_count <= bounded_total
    await store.close()


async def test_over_the_bound_the_view_is_counted_and_compacted_as_before(tmp_path: Path) -> None:
    """A history whose bound reaches the threshold is counted and compacted (the exact path)."""
    store = await _store(tmp_path)
    await store.add_messages(_turns(60))
    view = await store.get_messages_for_request(token_budget=600)
    cached = store._views.cache[4]  # type: ignore[index]
    assert cached.compacted and "token_count_exact" not in cached.stats and len(view) < 240
    await store.close()


async def test_a_report_after_a_bounded_view_pairs_the_exact_count(tmp_path: Path) -> None:
    """The calibration gets the store's exact count of a bounded view: when the provider's report arrives if
    the counts are made, else when the store next counts (the tokenizer is not loaded for the report)."""
    store = await _store(tmp_path)
    await store.add_messages(_turns(5))
    await store.get_messages_for_request(token_budget=100_000)
    assert store._views.cache[4].stats["token_count_exact"] is False  # type: ignore[index]
    data = await store.record_usage({"input_tokens": 900, "output_tokens": 5})
    assert data is not None and data["estimated_tokens"] is None and not store._s.counter.loaded
    assert await store.compact(token_budget=100_000) == 0  # (counts the view: the report is paired first)
    assert data["estimated_tokens"] == sum(store._token_counts())
    # counted already: the next report is paired at once
    await store.get_messages_for_request(token_budget=100_000)
    data = await store.record_usage({"input_tokens": 950, "output_tokens": 5})
    assert data is not None and data["estimated_tokens"] == sum(store._token_counts()) and "view" not in data
    await store.close()


async def test_a_resumed_process_analyses_only_the_messages_after_the_clean_prefix(tmp_path: Path,
                                                                                    monkeypatch: Any) -> None:
    """The checkpoint written at close keeps the view's clean prefix; after a reopen and two appends, the
    first view analyses only the messages from the prefix's user turn on and equals a full build's."""
    store = await _store(tmp_path)
    await store.add_messages(_turns(100))
    await store.get_messages_for_request(token_budget=1_000_000)
    prefix = store._views.bounds.hint()
    assert prefix is not None and prefix["h"] == 396  # (the latest user turn: the last four messages after it)
    await store.close()
    front = orjson.loads((tmp_path / "s" / "checkpoint.json").read_bytes().split(b"\n")[1])
    assert front["view_prefix"] == prefix

    seen: list[int] = []
    real = view_bound.analyse
    monkeypatch.setattr(view_bound, "analyse", lambda ms: (seen.append(len(ms)), real(ms))[1])
    store = await _store(tmp_path)
    await store.add_message({"role": "user", "content": "again"})
    await store.get_messages()  # (the host reads the history first: it is loaded)
    view = await store.get_messages_for_request(token_budget=1_000_000)
    assert seen == [5]
    full = await store._views._build(1_000_000, "explicit")
    assert view == full.messages
    await store.close()


async def test_a_prefix_whose_messages_changed_is_not_used(tmp_path: Path, monkeypatch: Any) -> None:
    """A redaction inside the recorded prefix moves its key: the next process analyses the whole history."""
    store = await _store(tmp_path)
    await store.add_messages(_turns(100))
    await store.get_messages_for_request(token_budget=1_000_000)
    await store.close()
    store = await _store(tmp_path)
    await store.redact(10)
    await store.close()

    seen: list[int] = []
    real = view_bound.analyse
    monkeypatch.setattr(view_bound, "analyse", lambda ms: (seen.append(len(ms)), real(ms))[1])
    store = await _store(tmp_path)
    await store.get_messages()
    view = await store.get_messages_for_request(token_budget=1_000_000)
    assert seen == []  # (the prefix path would have analysed the messages after it)
    assert store._views.cache[4].stats["token_count_exact"] is False  # type: ignore[index]
    assert view == (await store._views._build(1_000_000, "explicit")).messages
    await store.close()
