"""Hypothesis generators of conversations: both tool formats, parallel calls, orphans, late results,
system messages anywhere, pinned messages, huge tool outputs (attrs-style ``tests/strategies.py``)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from context_persistent.model.tokens import message_text

Message = dict[str, Any]

WORDS = ["plan", "error", "we will", "read", "file", "ok", "Traceback", "decided", "result", "x" * 40]


def count(message: Message) -> int:
    """A fast, deterministic counter for tests (chars/4 plus the per-message overhead)."""
    return 4 + len(message_text(message)) // 4


texts = st.builds(
    lambda words, pad: " ".join(words) + "." * pad,
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=6),
    st.one_of(st.just(0), st.just(0), st.integers(0, 400), st.integers(2000, 12000)),  # some huge
)

# Abstract segments; ids are assigned by _build so that they are unique.
segment = st.one_of(
    st.tuples(st.just("user"), texts),
    st.tuples(st.just("user"), texts),
    st.tuples(st.just("assistant"), texts),
    st.tuples(st.just("system"), texts),
    st.tuples(st.just("developer"), texts),
    # (kind, n parallel calls, results present mask, sizes, late?, extra user text)
    st.tuples(st.just("openai"), st.lists(st.tuples(st.booleans() | st.just(True), texts), min_size=1, max_size=3),
              st.booleans(), st.booleans()),
    st.tuples(st.just("anthropic"), st.lists(st.tuples(st.booleans() | st.just(True), texts), min_size=1, max_size=3),
              st.booleans(), st.booleans()),
    st.tuples(st.just("function"), texts, st.booleans()),
    st.tuples(st.just("orphan_openai"), texts),
    st.tuples(st.just("orphan_anthropic"), texts, st.booleans()),
)


def _build(segments: list[tuple[Any, ...]]) -> list[Message]:
    out: list[Message] = []
    late: list[Message] = []  # results held back to appear after the next segment
    n = 0
    for seg in segments:
        held, late = late, []
        kind = seg[0]
        if kind in ("user", "assistant", "system", "developer"):
            out.append({"role": kind, "content": seg[1]})
        elif kind == "openai":
            _, calls, is_late, _extra = seg
            ids = [f"call_{n + j}" for j in range(len(calls))]
            n += len(calls)
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "read_file", "arguments": '{"p": 1}'}} for i in ids]})
            results = [{"role": "tool", "tool_call_id": i, "content": t} for i, (ok, t) in zip(ids, calls) if ok]
            (late if is_late else out).extend(results)
        elif kind == "anthropic":
            _, calls, is_late, extra = seg
            ids = [f"toolu_{n + j}" for j in range(len(calls))]
            n += len(calls)
            out.append({"role": "assistant", "content": [{"type": "text", "text": "calling"}] + [
                {"type": "tool_use", "id": i, "name": "grep", "input": {"q": "x"}} for i in ids]})
            blocks: list[Any] = [
                {"type": "tool_result", "tool_use_id": i, "content": t} for i, (ok, t) in zip(ids, calls) if ok]
            if extra:
                blocks.append({"type": "text", "text": "and also, please continue"})
            if blocks:
                (late if is_late else out).append({"role": "user", "content": blocks})
        elif kind == "function":
            out.append({"role": "assistant", "content": None, "function_call": {"name": "legacy", "arguments": "{}"}})
            if seg[2]:
                out.append({"role": "function", "name": "legacy", "content": seg[1]})
        elif kind == "orphan_openai":
            out.append({"role": "tool", "tool_call_id": f"ghost_{n}", "content": seg[1]})
            n += 1
        elif kind == "orphan_anthropic":
            blocks = [{"type": "tool_result", "tool_use_id": f"ghost_{n}", "content": seg[1]}]
            n += 1
            if seg[2]:
                blocks.append({"type": "text", "text": "here is my next question"})
            out.append({"role": "user", "content": blocks})
        out.extend(held)
    out.extend(late)
    return out


@st.composite
def conversations(draw: st.DrawFn, max_segments: int = 25) -> tuple[list[Message], list[bool]]:
    """A history and its pinned flags."""
    messages = _build(draw(st.lists(segment, max_size=max_segments)))
    pinned = draw(st.lists(st.integers(0, 5).map(lambda x: x == 0),
                           min_size=len(messages), max_size=len(messages)))
    return messages, pinned


def tool_turns(n: int, size: int = 300) -> list[Message]:
    """``n`` turns of user question, assistant tool call, tool result, assistant answer (OpenAI format)."""
    out: list[Message] = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i} " + "q" * size})
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}]})
        out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " + "r" * size})
        out.append({"role": "assistant", "content": f"answer {i} " + "a" * size})
    return out
