"""PersistentChatCompletionContext against AutoGen's ChatCompletionContext contract and, side by side, its
built-in contexts: the same messages into Unbounded/Buffered/HeadAndTail and into ours with the matching
strategy give the same get_messages; save_state/load_state interoperate; everything survives a reopen."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import PIL.Image
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from autogen_core import FunctionCall, Image
from autogen_core.model_context import (
    BufferedChatCompletionContext,
    ChatCompletionContext,
    HeadAndTailChatCompletionContext,
    UnboundedChatCompletionContext,
)
from autogen_core.models import (
    AssistantMessage,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    SystemMessage,
    UserMessage,
)

from context_persistent import PersistentContextManager
from context_persistent.integrations.autogen import (
    Buffered,
    HeadAndTail,
    PersistentChatCompletionContext,
    RequestView,
    Unbounded,
    from_stored,
    to_stored,
)


def dump(messages: list[LLMMessage]) -> list[dict[str, Any]]:
    return [m.model_dump() for m in messages]


def image(seed: int) -> Image:
    return Image.from_pil(PIL.Image.new("RGB", (4, 3), (seed % 256, 7, 200)))


def turn(i: int, results: int = 1) -> list[LLMMessage]:
    calls = [FunctionCall(id=f"c{i}-{k}", name=f"tool{k}", arguments=f'{{"i": {i}, "k": {k}}}') for k in range(results)]
    return [
        UserMessage(content=f"question {i}", source="user"),
        AssistantMessage(content=calls, thought=f"thinking {i}" if i % 2 else None, source="agent"),
        FunctionExecutionResultMessage(content=[
            FunctionExecutionResult(content=f"out {i}.{k}", name=f"tool{k}", call_id=f"c{i}-{k}",
                                    is_error=[None, False, True][k % 3])
            for k in range(results)]),
        AssistantMessage(content=f"answer {i}", source="agent"),
    ]


def conversation(n_turns: int, seed: int = 0) -> list[LLMMessage]:
    rng = random.Random(seed)
    out: list[LLMMessage] = [SystemMessage(content="be brief")]
    for i in range(n_turns):
        out += turn(i, results=rng.randint(1, 3))
        if rng.random() < 0.3:
            out.append(UserMessage(content=[f"see picture {i}", image(i)], source="user"))
    return out


def every_kind() -> list[LLMMessage]:
    return [
        SystemMessage(content="sys"),
        UserMessage(content="plain", source="user"),
        UserMessage(content=["text only list"], source="someone"),
        UserMessage(content=["a", image(1), "b", image(2)], source="user"),
        AssistantMessage(content="text", source="agent"),
        AssistantMessage(content="text with thought", thought="because", source="agent"),
        AssistantMessage(content=[FunctionCall(id="x", name="f", arguments="{}")], thought="call it", source="a"),
        AssistantMessage(content=[], source="agent"),
        FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="r", name="f", call_id="x")]),
        FunctionExecutionResultMessage(content=[]),
        FunctionExecutionResultMessage(content=[
            FunctionExecutionResult(content="e", name="g", call_id="", is_error=True),
            FunctionExecutionResult(content="", name="h", call_id="y", is_error=False)]),
        FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="next", name="f", call_id="z")]),
        UserMessage(content="ünïcödé ✓ \x00 nul", source="user"),
    ]


def test_mapping_is_exact_both_ways() -> None:
    messages = every_kind()
    stored = [m for message in messages for m in to_stored(message)]
    assert dump(from_stored(stored)) == dump(messages)


def test_two_result_messages_in_a_row_stay_two() -> None:
    a = FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="1", name="f", call_id="a")])
    b = FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="2", name="f", call_id="b")])
    stored = to_stored(a) + to_stored(b)
    assert dump(from_stored(stored)) == dump([a, b])


def test_is_a_chat_completion_context(tmp_path: Path) -> None:
    assert isinstance(PersistentChatCompletionContext(tmp_path, "s"), ChatCompletionContext)


async def test_every_kind_survives_a_reopen(tmp_path: Path) -> None:
    messages = every_kind()
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        for m in messages:
            await ctx.add_message(m)
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        assert dump(await ctx.get_messages()) == dump(messages)


STRATEGIES = [
    (lambda: UnboundedChatCompletionContext(), Unbounded()),
    *[(lambda n=n: BufferedChatCompletionContext(buffer_size=n), Buffered(n)) for n in (1, 2, 3, 5, 8, 50)],
    *[(lambda h=h, t=t: HeadAndTailChatCompletionContext(head_size=h, tail_size=t), HeadAndTail(h, t))
      for h, t in ((1, 1), (2, 3), (3, 2), (4, 4), (1, 7), (30, 30))],
]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("theirs,ours", STRATEGIES, ids=[repr(s[1]) for s in STRATEGIES])
async def test_same_outputs_as_autogens_own_contexts(tmp_path: Path, theirs: Any, ours: Any, seed: int) -> None:
    messages = conversation(6, seed)
    reference: ChatCompletionContext = theirs()
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=ours) as ctx:
        for i, m in enumerate(messages):  # compared after every add: each prefix, every boundary case
            await reference.add_message(m)
            await ctx.add_message(m)
            assert dump(await ctx.get_messages()) == dump(await reference.get_messages()), f"after {i + 1}"
        await reference.clear()
        await ctx.clear()
        assert await ctx.get_messages() == await reference.get_messages() == []
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=ours) as ctx:
        assert await ctx.get_messages() == []  # the clear is durable


async def test_state_interoperates_with_autogens_contexts(tmp_path: Path) -> None:
    messages = conversation(4, 3)
    theirs = UnboundedChatCompletionContext()
    for m in messages:
        await theirs.add_message(m)
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        await ctx.load_state(await theirs.save_state())
        assert dump(await ctx.get_messages()) == dump(messages)
        assert await ctx.save_state() == await theirs.save_state()
        back = BufferedChatCompletionContext(buffer_size=1000)
        await back.load_state(await ctx.save_state())
        assert dump(await back.get_messages()) == dump(messages)
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        assert dump(await ctx.get_messages()) == dump(messages)  # load_state is durable


async def test_load_state_of_the_same_history_writes_nothing(tmp_path: Path) -> None:
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        for m in conversation(2):
            await ctx.add_message(m)
        store = await ctx.store()
        head = store.head_seq
        await ctx.load_state(await ctx.save_state())
        assert store.head_seq == head
        await ctx.load_state({"messages": [SystemMessage(content="fresh").model_dump()]})
        assert store.head_seq == head + 1
        assert dump(await ctx.get_messages()) == dump([SystemMessage(content="fresh")])


async def test_load_state_keeps_the_earlier_history_in_the_log(tmp_path: Path) -> None:
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        first = conversation(1)
        for m in first:
            await ctx.add_message(m)
        store = await ctx.store()
        before = store.head_seq
        await ctx.load_state({"messages": []})
        assert await ctx.get_messages() == []
        old = await store.at(before)
        try:
            assert dump(from_stored(await old.get_messages())) == dump(first)
        finally:
            await old.close()


async def test_request_view_strategy_is_the_stores_request_view(tmp_path: Path) -> None:
    messages = conversation(40, 5)
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=RequestView(token_budget=400)) as ctx:
        for m in messages:
            await ctx.add_message(m)
        store = await ctx.store()
        view = await ctx.get_messages()
        assert dump(view) == dump(from_stored(await store.get_messages_for_request(token_budget=400)))
        assert len(view) < len(messages)
        assert isinstance(view[0], SystemMessage)  # the system message is always kept
        assert any(isinstance(m, UserMessage) and m.source == "context-persistent" for m in view)  # the note
        # Valid for a provider: every function result follows the call that asked for it.
        open_calls: set[str] = set()
        for m in view:
            if isinstance(m, AssistantMessage) and isinstance(m.content, list):
                open_calls = {c.id for c in m.content}
            elif isinstance(m, FunctionExecutionResultMessage):
                assert {r.call_id for r in m.content} <= open_calls
        assert dump(view[-1:]) == dump(messages[-1:])  # the newest message is there
        ctx.strategy = RequestView(token_budget=10**6)
        assert dump(await ctx.get_messages()) == dump(messages)


async def test_initial_messages_only_for_a_new_session(tmp_path: Path) -> None:
    initial: list[LLMMessage] = [SystemMessage(content="you are a test")]
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded(),
                                               initial_messages=initial) as ctx:
        await ctx.add_message(UserMessage(content="hi", source="user"))
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded(),
                                               initial_messages=initial) as ctx:
        assert dump(await ctx.get_messages()) == dump([*initial, UserMessage(content="hi", source="user")])
        await ctx.clear()
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded(),
                                               initial_messages=initial) as ctx:
        assert await ctx.get_messages() == []  # cleared is not new


async def test_returned_messages_are_copies(tmp_path: Path) -> None:
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        await ctx.add_message(AssistantMessage(content="x", thought="long thought", source="a"))
        got = await ctx.get_messages()
        got[0].thought = None  # what AutoGen's ReasoningModelContext example does to the messages it gets
        assert (await ctx.get_messages())[0].thought == "long thought"


async def test_an_open_store_can_be_shared(tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        ctx = PersistentChatCompletionContext(store=store, strategy=Unbounded())
        await ctx.add_message(UserMessage(content="hi", source="user"))
        await ctx.close()  # not ours to close
        assert await store.get_messages() == [{"role": "user", "content": "hi", "autogen": {"source": "user"}}]


async def test_bad_input_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        await ctx.add_message(UserMessage(content="kept", source="user"))
        with pytest.raises(ValueError, match="not an AutoGen LLMMessage"):
            await ctx.add_message({"role": "user", "content": "a dict"})  # type: ignore[arg-type]
        bad = UserMessage(content="x", source="user")
        object.__setattr__(bad, "content", [object()])
        with pytest.raises(ValueError, match="must be str or autogen_core.Image"):
            await ctx.add_message(bad)
        assert dump(await ctx.get_messages()) == dump([UserMessage(content="kept", source="user")])
    with pytest.raises(ValueError, match="buffer_size must be an int greater than 0"):
        Buffered(0)
    with pytest.raises(ValueError, match="tail_size must be an int greater than 0"):
        HeadAndTail(1, 0)
    with pytest.raises(ValueError, match="strategy must be"):
        PersistentChatCompletionContext(tmp_path, "s", strategy="buffered")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown configuration key"):
        PersistentChatCompletionContext(tmp_path, "s", fsyncc="always")
    with pytest.raises(ValueError, match="give storage_path and session_id, or an open store"):
        PersistentChatCompletionContext(tmp_path)


async def test_a_message_another_host_wrote_maps_by_role(tmp_path: Path) -> None:
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="s") as store:
        await store.add_message({"role": "system", "content": "s"})
        await store.add_message({"role": "user", "content": [{"type": "text", "text": "u"}]})
        await store.add_message({"role": "assistant", "content": "a"})
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        assert dump(await ctx.get_messages()) == dump([
            SystemMessage(content="s"), UserMessage(content=["u"], source="context-persistent"),
            AssistantMessage(content="a", source="assistant")])


async def test_dump_and_load_component_reopen_the_same_session(tmp_path: Path) -> None:
    ctx = PersistentChatCompletionContext(tmp_path, "s", strategy=HeadAndTail(2, 3), fsync="batch")
    await ctx.add_message(UserMessage(content="hi", source="user"))
    model = ctx.dump_component()
    assert model.provider == "context_persistent.integrations.autogen.PersistentChatCompletionContext"
    await ctx.close()
    again = ChatCompletionContext.load_component(model.model_dump())
    assert isinstance(again, PersistentChatCompletionContext) and again.strategy == HeadAndTail(2, 3)
    assert dump(await again.get_messages()) == dump([UserMessage(content="hi", source="user")])
    assert (await again.store()).config["fsync"] == "batch"
    await again.close()
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="t") as store:
        with pytest.raises(ValueError, match="no declarative form"):
            PersistentChatCompletionContext(store=store).dump_component()


def test_the_frameworks_load_only_when_used(subprocess_env: dict[str, str]) -> None:
    import subprocess
    import sys

    code = ("import sys, context_persistent, context_persistent.integrations\n"
            "assert not any(m.split('.')[0] in ('autogen_core', 'agent_framework') for m in sys.modules)\n"
            "sys.modules['autogen_core'] = None\n"
            "try:\n    import context_persistent.integrations.autogen\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'context-persistent[autogen]'" in out.stdout


texts = st.text(max_size=8)
calls = st.builds(FunctionCall, id=texts, name=texts, arguments=texts)
results = st.builds(FunctionExecutionResult, content=texts, name=texts, call_id=texts,
                    is_error=st.one_of(st.none(), st.booleans()))
llm_messages = st.one_of(
    st.builds(SystemMessage, content=texts),
    st.builds(UserMessage, content=st.one_of(texts, st.lists(st.one_of(texts, st.integers(0, 3).map(image)),
                                                            max_size=3)), source=texts),
    st.builds(AssistantMessage, content=st.one_of(texts, st.lists(calls, max_size=3)),
              thought=st.one_of(st.none(), texts), source=texts),
    st.builds(FunctionExecutionResultMessage, content=st.lists(results, max_size=3)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(llm_messages, max_size=12))
def test_any_sequence_maps_back_exactly(messages: list[LLMMessage]) -> None:
    """from_stored(to_stored(...)) is the identity on any sequence of AutoGen messages."""
    stored = [m for message in messages for m in to_stored(message)]
    assert dump(from_stored(stored)) == dump(messages)


async def test_an_erase_through_the_store_leaves_no_stale_copy_in_the_context(tmp_path: Path) -> None:
    async with PersistentChatCompletionContext(tmp_path, "s", strategy=Unbounded()) as ctx:
        await ctx.add_message(UserMessage(content="my passport is X1234567", source="user"))
        await ctx.add_message(UserMessage(content="thanks", source="user"))
        assert len(await ctx.get_messages()) == 2  # (the context's own copy of the history is built)
        await (await ctx.store()).erase(0)  # the seq does not move: the tombstone takes the record's place
        assert [m.content for m in await ctx.get_messages()] == ["thanks"]
        await ctx.add_message(UserMessage(content="next", source="user"))
        assert [m.content for m in await ctx.get_messages()] == ["thanks", "next"]
