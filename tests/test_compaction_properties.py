"""Properties: for random histories, budgets and configs, every strategy's view satisfies every invariant."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent.model.compaction import CompactionConfig, CompactionRequest, build_request_view
from context_persistent.model.compaction.invariants import skeleton
from context_persistent.model.grouping import group_messages, is_real_user_turn, repair, validate_sequence
from strategies import conversations, count

Message = dict[str, Any]


def _drop_oldest_half(request: CompactionRequest) -> list[Message]:
    """A third-party strategy that is sometimes valid and sometimes breaks the budget."""
    half = len(request.groups) // 2
    return [request.messages[i] for g, grp in enumerate(request.groups)
            if g >= half or request.protected[g] for i in grp.indices]


async def _summarize(dropped: list[Message]) -> str:
    return f"{len(dropped)} messages were about " + "things " * (len(dropped) % 7) * 20


configs = st.builds(
    lambda strategy, threshold, target_frac, keep_recent, keep_head, mask_min, summarize: CompactionConfig(
        strategy=strategy, compact_threshold=threshold, target_usage=threshold * target_frac,
        keep_recent=keep_recent, keep_head=keep_head, mask_min_tokens=mask_min,
        custom=_drop_oldest_half if strategy == "custom" else None,
        summarizer=_summarize if summarize else None),
    st.sampled_from(["simple", "smart", "head_tail", "custom"]),
    st.floats(0.05, 1.0), st.floats(0.1, 1.0), st.integers(1, 30), st.integers(0, 5),
    st.integers(10, 2000), st.booleans(),
)


def _is_note(m: Message) -> bool:
    return m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].startswith(
        "[context-persistent:")


def _kept_always(repaired: list[Message], pinned_ids: set[int], sources: list[Message]) -> tuple[list[int], int]:
    """Indices of repaired messages that must be kept (computed here, independently of the implementation)."""
    groups = group_messages(repaired)
    last_user = max((i for i, m in enumerate(repaired) if is_real_user_turn(m)), default=None)
    tail_g = len(groups) - 1 if last_user is None else next(g for g, grp in enumerate(groups) if last_user in grp.indices)
    keep: list[int] = []
    for g, grp in enumerate(groups):
        if g >= tail_g or any(repaired[i]["role"] in ("system", "developer") or id(sources[i]) in pinned_ids
                              for i in grp.indices if sources[i] is not None):
            keep.extend(grp.indices)
    tail_start = groups[tail_g].start if groups else 0
    return keep, tail_start


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversations(), configs, st.floats(0.02, 1.6))
def test_every_view_satisfies_every_invariant(conv: tuple[list[Message], list[bool]], config: CompactionConfig,
                                              budget_frac: float) -> None:
    """Valid for providers, keeps what must be kept in order, fits when it can, never mutates its input."""
    messages, pinned = conv
    tokens = [count(m) for m in messages]
    budget = max(1, int(sum(tokens) * budget_frac))
    before = copy.deepcopy(messages)
    view = asyncio.run(build_request_view(messages, tokens, pinned, budget, config, count))
    out = view.messages

    assert messages == before  # the stored history is never touched
    assert not any(o is m for o in out for m in messages)
    assert validate_sequence(out) == []  # no orphan, no unanswered or split call
    assert view.token_count == sum(count(m) for m in out) == view.stats["token_count"]

    # Map repaired messages back to their stored originals by position, via the grouping module itself.
    from context_persistent.model.grouping import analyse

    found = analyse(messages)
    repaired = found.messages
    srcs = [messages[s] if s is not None else None for s in found.sources]
    assert repair(messages)[0] == repaired
    pinned_ids = {id(m) for m, p in zip(messages, pinned) if p}
    keep, tail_start = _kept_always(repaired, pinned_ids, srcs)
    must_tokens = sum(count(repaired[i]) for i in keep)
    if not view.compacted:
        assert out == repaired
        assert sum(count(m) for m in repaired) < config.compact_threshold * budget or not config.auto_compact
        return
    truncated = view.stats["truncated"] > 0
    same = (lambda a, b: skeleton(a) == skeleton(b)) if truncated else (lambda a, b: a == b)
    # kept-always messages: all present, in order; the tail is exactly the end of the view
    p = 0
    for m in out:
        if p < len(keep) and same(m, repaired[keep[p]]):
            p += 1
    assert p == len(keep), f"missing kept-always message {repaired[keep[p]]!r:.200}"
    tail = repaired[tail_start:]
    assert len(out) >= len(tail) and all(same(a, b) for a, b in zip(out[len(out) - len(tail):], tail))
    # everything else is an original (maybe masked/truncated) message in original order, or a note
    q = 0
    for m in out:
        if _is_note(m):
            continue
        while q < len(repaired) and skeleton(repaired[q]) != skeleton(m):
            q += 1
        assert q < len(repaired), f"message not from the history or out of order: {m!r:.200}"
        q += 1
    # the aim: built-ins reach the target whenever the kept-always part plus room for notes fits it
    groups = group_messages(repaired)
    protected_runs = sum(1 for g in groups if any(i in set(keep) for i in g.indices)) + 1
    target = int(config.target_usage * budget)
    if config.strategy != "custom" and config.summarizer is None and must_tokens + 50 * protected_runs <= target:
        assert view.token_count <= target
    # the budget
    if must_tokens <= budget:
        assert view.token_count <= budget
        if config.strategy != "custom":
            assert view.stats["warning"] is None or "summar" in view.stats["warning"]
    else:
        assert view.stats["warning"] is not None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.sampled_from(["simple", "smart", "head_tail"]), st.integers(60, 400))
def test_extra_messages_after_a_tool_pair_never_orphan_it(extra: int, strategy: str, budget: int) -> None:
    """The contract's example, generalised: N user messages after a tool pair, any small budget."""
    msgs: list[Message] = [
        {"role": "user", "content": "Read file.txt"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_123", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_123", "content": "File contents..."},
    ] + [{"role": "user", "content": f"Message {i}"} for i in range(extra)]
    tokens = [count(m) for m in msgs]
    view = asyncio.run(build_request_view(msgs, tokens, [False] * len(msgs), budget,
                                          CompactionConfig(strategy=strategy, compact_threshold=0.5), count))
    used = {c["id"] for m in view.messages for c in m.get("tool_calls") or ()}
    answered = {m["tool_call_id"] for m in view.messages if m["role"] == "tool"}
    assert answered == used
    assert view.messages[-1] == msgs[-1] and view.token_count <= budget
