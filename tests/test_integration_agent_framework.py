"""PersistentHistoryProvider: every Agent Framework content type stored losslessly, session ids, concurrent
saves, compaction of stored history with Agent Framework's own strategies, bad input. (Agent Framework's own
history-provider tests run against it in tests/test_peer_agent_framework.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from context_persistent.operations.search.sqlite_index import INDEX_DIR
from hypothesis import given, settings
from hypothesis import strategies as st
from agent_framework import (
    AgentResponse,
    AgentSession,
    CharacterEstimatorTokenizer,
    ChatResponse,
    Content,
    Message,
    SelectiveToolCallCompactionStrategy,
    SessionContext,
    SlidingWindowStrategy,
    SummarizationStrategy,
    ToolResultCompactionStrategy,
    TruncationStrategy,
    annotate_message_groups,
)
from agent_framework._compaction import annotate_token_counts

from context_persistent import PersistentContextManager
from context_persistent.integrations.agent_framework import (
    PersistentHistoryProvider,
    encode_message,
    store_session_id,
)


def canon(messages: list[Message]) -> str:
    """A comparable form of messages (json keeps NaN, which == does not compare equal)."""
    return json.dumps([m.to_dict() for m in messages], sort_keys=True)


def every_content() -> list[Message]:
    call = Content.from_function_call(call_id="c1", name="search", arguments={"q": "x", "n": 2})
    request = Content.from_function_approval_request(id="ap1", function_call=call)
    return [
        Message(role="system", contents=["be brief"]),
        Message(role="user", contents=[
            Content.from_text(text="hello ✓"),
            Content.from_uri(uri="data:image/png;base64,iVBORw0KGgo=", media_type="image/png"),
            Content.from_uri(uri="https://example.invalid/a.pdf", media_type="application/pdf"),
            Content.from_hosted_file(file_id="file-1")],
                author_name="ann", message_id="m-1"),
        Message(role="assistant", contents=[Content.from_text_reasoning(text="think", protected_data="opaque"),
                                            call, request],
                additional_properties={"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                                       "$cp": {"$cp": "looks like our tag"}, "nested": [1.5, {"x": None}],
                                       "big": 2**70, "-big": -(2**70)}),
        Message(role="user", contents=[request.to_function_approval_response(approved=True)]),
        Message(role="tool", contents=[Content.from_function_result(call_id="c1", result={"hits": [1, 2]}),
                                       Content.from_function_result(call_id="c2", result="plain",
                                                                    exception="boom")]),
        Message(role="assistant", contents=[
            Content.from_mcp_server_tool_call(call_id="m1", tool_name="t", server_name="srv", arguments='{"a":1}'),
            Content.from_mcp_server_tool_result(call_id="m1", output="ok"),
            Content.from_code_interpreter_tool_call(call_id="ci", inputs=[Content.from_text(text="1+1")]),
            Content.from_code_interpreter_tool_result(call_id="ci", outputs=[Content.from_text(text="2")]),
            Content.from_usage(usage_details={"input_token_count": 3, "output_token_count": 4}),
            Content.from_error(message="rate limited", error_code="429"),
        ]),
        Message(role="assistant", contents=["done"]),
        Message(role="custom-role", contents=["a role the store does not know"]),
    ]


async def test_every_content_type_survives_a_reopen(tmp_path: Path) -> None:
    messages = every_content()
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", messages)
    async with PersistentHistoryProvider(tmp_path) as provider:
        loaded = await provider.get_messages("s")
    assert canon(loaded) == canon(messages)
    assert [str(m.role) for m in loaded][-1] == "custom-role"


async def test_the_store_sees_roles_and_text(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", every_content())
        store = await provider.store("s")
        assert store is not None
        stored = await store.get_messages()
    assert [m["role"] for m in stored] == ["system", "user", "assistant", "user", "tool", "assistant", "assistant",
                                           "user"]
    assert stored[1]["content"] == "hello ✓" and stored[-2]["content"] == "done"


async def test_session_ids(tmp_path: Path) -> None:
    assert store_session_id(None) == "default"
    assert store_session_id("abc-123") == "abc-123"
    ids = ["../unsafe/session", ".hidden", "a b", "af=x", "AF=x", "é", "y" * 60 + "/"]
    mapped = [store_session_id(i) for i in ids]
    assert len(set(mapped)) == len(ids) and all(m.startswith("af=") for m in mapped if m != "AF=x")
    async with PersistentHistoryProvider(tmp_path) as provider:
        for i, sid in enumerate([None, *ids]):
            await provider.save_messages(sid, [Message(role="user", contents=[f"m{i}"])])
        for i, sid in enumerate([None, *ids]):
            assert [m.text for m in await provider.get_messages(sid)] == [f"m{i}"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != INDEX_DIR) == sorted(["default", *mapped])
    with pytest.raises(ValueError, match="too long"):
        store_session_id("y" * 100 + "/")
    with pytest.raises(ValueError, match="non-empty string"):
        store_session_id("")


async def test_reading_a_missing_session_creates_nothing(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path / "root") as provider:
        assert await provider.get_messages("nobody") == []
        assert await provider.compact_storage("nobody", SlidingWindowStrategy(keep_last_groups=1)) is False
    assert list((tmp_path / "root").iterdir()) == []
    assert stat.S_IMODE(os.stat(tmp_path / "root").st_mode) == 0o700


async def test_concurrent_saves_all_land_in_order(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path) as provider:
        await asyncio.gather(*(provider.save_messages("s", [Message(role="user", contents=[f"{i}a"]),
                                                            Message(role="assistant", contents=[f"{i}b"])])
                               for i in range(20)))
        texts = [m.text for m in await provider.get_messages("s")]
    assert sorted(texts) == sorted(f"{i}{x}" for i in range(20) for x in "ab")
    assert all(texts.index(f"{i}a") < texts.index(f"{i}b") for i in range(20))


async def test_a_second_process_cannot_write_the_same_session(tmp_path: Path) -> None:
    from context_persistent import SessionLockedError
    async with PersistentHistoryProvider(tmp_path) as first:
        await first.save_messages("s", [Message(role="user", contents=["x"])])
        async with PersistentHistoryProvider(tmp_path) as second:
            with pytest.raises(SessionLockedError):
                await second.save_messages("s", [Message(role="user", contents=["y"])])


async def test_bad_messages_are_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", [Message(role="user", contents=["kept"])])
        with pytest.raises(ValueError, match="expected an agent_framework.Message"):
            mixed: list[Any] = [Message(role="user", contents=["ok"]), {"role": "user"}]
            await provider.save_messages("s", mixed)
        assert [m.text for m in await provider.get_messages("s")] == ["kept"]
    with pytest.raises(ValueError, match="unknown configuration key"):
        PersistentHistoryProvider(tmp_path, fsyncc="always")


async def test_messages_another_host_wrote_are_read_as_text(tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "user", "content": "from amplifier"})
        await store.add_message({"role": "assistant", "content": [{"type": "text", "text": "blocks"}]})
    async with PersistentHistoryProvider(tmp_path) as provider:
        with pytest.raises(ValueError, match="message 1 of session 's' was not written by the Agent Framework"):
            await provider.get_messages("s")


# -- compaction ---------------------------------------------------------------------------------------------------
def history() -> list[Message]:
    out = [Message(role="system", contents=["sys"])]
    for i in range(6):
        out += [Message(role="user", contents=[f"question {i} " + "words " * 30]),
                Message(role="assistant", contents=[Content.from_function_call(call_id=f"c{i}", name="tool",
                                                                               arguments='{"v": 1}')]),
                Message(role="tool", contents=[Content.from_function_result(call_id=f"c{i}",
                                                                            result="result " * 40)]),
                Message(role="assistant", contents=[f"answer {i}"])]
    return out


class FakeSummarizer:
    async def get_response(self, messages: Any, **kwargs: Any) -> ChatResponse:
        return ChatResponse(messages=[Message(role="assistant", contents=[f"summary of {len(messages)}"])])


STRATEGIES = {
    "sliding_window": lambda: SlidingWindowStrategy(keep_last_groups=3, preserve_system=True),
    "selective_tool_calls": lambda: SelectiveToolCallCompactionStrategy(keep_last_tool_call_groups=1),
    "tool_result_summary": lambda: ToolResultCompactionStrategy(keep_last_tool_call_groups=1),
    "truncation": lambda: TruncationStrategy(max_n=600, compact_to=300, tokenizer=CharacterEstimatorTokenizer()),
    "summarization": lambda: SummarizationStrategy(client=FakeSummarizer(), target_count=4, threshold=2),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
async def test_compact_storage_stores_what_the_strategy_does_in_memory(tmp_path: Path, name: str) -> None:
    expected = history()
    annotate_message_groups(expected)
    annotate_token_counts(expected, tokenizer=CharacterEstimatorTokenizer())
    assert await STRATEGIES[name]()(expected)  # Agent Framework's own result, in memory
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", history())
        store = await provider.store("s")
        assert store is not None
        before = store.head_seq
        assert await provider.compact_storage("s", STRATEGIES[name](), tokenizer=CharacterEstimatorTokenizer())
        assert store.head_seq == before + 1  # one messages_replaced event
        old = await store.at(before)
        try:
            assert len(await old.get_messages()) == len(history())  # the log keeps the history before it
        finally:
            await old.close()
    async with PersistentHistoryProvider(tmp_path) as provider:
        stored = await provider.get_messages("s")
    ids = lambda ms: [m.message_id for m in ms]  # noqa: E731 - message ids are generated: compare the rest
    assert len(stored) == len(expected) and all(ids(stored))
    for got, want in zip(stored, expected):
        g, w = got.to_dict(), want.to_dict()
        for d in (g, w):
            d.pop("message_id", None)
            d["additional_properties"].get("_group", {}).pop("id", None)
            for key in ("_summary_of_message_ids", "_summary_of_group_ids", "_summarized_by_summary_id"):
                d["additional_properties"].pop(key, None)
        assert g == w
    assert any(m.additional_properties.get("_excluded") for m in stored)


async def test_skip_excluded_loads_what_compaction_kept(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path) as provider:
        await provider.save_messages("s", history())
        await provider.compact_storage("s", SlidingWindowStrategy(keep_last_groups=3, preserve_system=True))
    async with PersistentHistoryProvider(tmp_path, skip_excluded=True) as provider:
        kept = await provider.get_messages("s")
    assert [m.text for m in kept][0] == "sys" and len(kept) < len(history())
    assert kept[-1].text == "answer 5"


async def test_compaction_strategy_runs_after_every_run(tmp_path: Path) -> None:
    strategy = SelectiveToolCallCompactionStrategy(keep_last_tool_call_groups=0)
    async with PersistentHistoryProvider(tmp_path, compaction_strategy=strategy, skip_excluded=True) as provider:
        session = AgentSession(session_id="s")
        for i in range(2):
            call = Content.from_function_call(call_id=f"c{i}", name="tool", arguments="{}")
            ctx = SessionContext(session_id="s", input_messages=[Message(role="user", contents=[f"q{i}"])])
            ctx._response = AgentResponse(messages=[
                Message(role="assistant", contents=[call]),
                Message(role="tool", contents=[Content.from_function_result(call_id=f"c{i}", result="r")]),
                Message(role="assistant", contents=[f"a{i}"])])
            await provider.after_run(agent=None, session=session, context=ctx, state={})
        assert [m.text for m in await provider.get_messages("s")] == ["q0", "a0", "q1", "a1"]
    with pytest.raises(ValueError, match="no compaction strategy"):
        await PersistentHistoryProvider(tmp_path / "x").compact_storage("s")


def test_encode_keeps_everything_under_one_key() -> None:
    stored = encode_message(Message(role="user", contents=["hi"], author_name="a"))
    assert set(stored) == {"role", "content", "agent_framework"}
    assert stored["agent_framework"]["author_name"] == "a"


async def test_close_session_releases_the_lock(tmp_path: Path) -> None:
    async with PersistentHistoryProvider(tmp_path) as first, PersistentHistoryProvider(tmp_path) as second:
        await first.save_messages("s", [Message(role="user", contents=["1"])])
        await first.close_session("s")
        await second.save_messages("s", [Message(role="user", contents=["2"])])
        assert [m.text for m in await second.get_messages("s")] == ["1", "2"]


def test_the_framework_loads_only_when_used(subprocess_env: dict[str, str]) -> None:
    import subprocess
    import sys

    code = ("import sys, context_persistent, context_persistent.integrations\n"
            "assert not any(m.split('.')[0] in ('autogen_core', 'agent_framework') for m in sys.modules)\n"
            "sys.modules['agent_framework'] = None\n"
            "try:\n    import context_persistent.integrations.agent_framework\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'context-persistent[agent-framework]'" in out.stdout


json_leaves = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True),
                        st.integers(min_value=-(2**80), max_value=2**80))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "$cp", "v", "float", "x"]), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_values_the_log_cannot_hold_are_kept(value: Any) -> None:
    """Whatever Message.to_dict can produce (NaN, infinities, big ints, dicts using our tag) comes back equal."""
    from context_persistent.model.codec import dumps
    from context_persistent.integrations.agent_framework import _decode_value, _encode_value

    encoded = _encode_value(value)
    dumps(encoded)  # the log accepts it
    assert json.dumps(_decode_value(json.loads(dumps(encoded)))) == json.dumps(value)
