"""The invariants every request view satisfies, as a checker (used on custom strategies and in tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..grouping import result_block_id, result_key, tool_calls_of, validate_sequence
from ._base import Message, count_view

if TYPE_CHECKING:
    from .request import CompactionRequest


def skeleton(message: Message) -> tuple[Any, ...]:
    """What truncation and masking leave unchanged: role, name, and the tool ids a message carries."""
    content = message.get("content")
    blocks = content if isinstance(content, list) else ()
    return (
        message.get("role"), message.get("name"), result_key(message),
        tuple(k for k, _, _ in tool_calls_of(message)), tuple(result_block_id(b) for b in blocks),
    )


def check_view(request: CompactionRequest, out: Sequence[Message], *, allow_truncated: bool = False) -> list[str]:
    """Problems of ``out`` as a compacted view of ``request`` (empty when it satisfies every invariant).

    Checked: every item is a message; provider validity (no orphan result, no unanswered or split call);
    system/developer, pinned and tail messages all present, in order; the tail (latest real user message and
    all after it) is exactly the view's suffix; the view fits the budget whenever the kept-always part does.
    ``allow_truncated`` compares kept messages by :func:`skeleton` (smart's last-resort truncation).
    """
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in out):
        return ["the view contains an item that is not a message dict with a role"]
    problems = validate_sequence(out)
    same: Callable[[Message, Message], bool] = (
        (lambda a, b: skeleton(a) == skeleton(b)) if allow_truncated else (lambda a, b: a == b)
    )
    must = [
        request.messages[i]
        for g, group in enumerate(request.groups) if request.protected[g] for i in group.indices
    ]
    p = 0
    for m in out:
        if p < len(must) and same(m, must[p]):
            p += 1
    if p < len(must):
        problems.append(f"a message that must be kept is missing or out of order: {must[p]!r:.120}")
    tail = [request.messages[i] for g in request.groups[request.tail_start :] for i in g.indices]
    if tail and (len(out) < len(tail) or not all(same(a, b) for a, b in zip(out[len(out) - len(tail) :], tail))):
        problems.append("the latest user message and everything after it must be the unchanged end of the view")
    if request.protected_tokens <= request.budget:
        total = count_view(request, out)
        if total > request.budget:
            problems.append(f"the view needs {total:,} tokens, over the budget of {request.budget:,}")
    return problems
