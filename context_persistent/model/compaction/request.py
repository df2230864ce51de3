"""The request a compaction strategy gets and the result it gives (pure): the types of the ``custom`` strategy's
API (docs/compaction.md). Dataclasses, which a user's strategy may treat as such (``dataclasses.replace``); loaded
with the first compaction, not by a turn that needs none (docs/architecture.md, "Start-up cost")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..grouping import Group

Message = dict[str, Any]  # (as in _base.py, which loads this module: no cycle)


@dataclass(frozen=True, slots=True)
class CompactionRequest:
    """Everything a strategy needs; built once per request view by :func:`build_request_view`.

    ``messages`` is the repaired history (do not mutate it; return its dicts as they are or new ones).
    ``protected[g]`` is True for groups that must be kept: system/developer or pinned messages, and the
    tail (``groups[tail_start:]``: the latest real user message and everything after it).
    """

    messages: Sequence[Message]
    tokens: Sequence[int]
    pinned: Sequence[bool]
    groups: Sequence[Group]
    group_tokens: Sequence[int]
    protected: Sequence[bool]
    tail_start: int
    budget: int
    target: int
    count: Callable[[Message], int]
    config: Any  # CompactionConfig (not imported: avoids a cycle)

    @property
    def protected_tokens(self) -> int:
        return sum(t for t, p in zip(self.group_tokens, self.protected) if p)


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """A strategy's answer: the view plus what it did (for events)."""

    messages: list[Message]
    groups_dropped: int = 0
    outputs_masked: int = 0
    truncated: int = 0
    summarized: bool = False
    warning: str | None = None
    #: ``token_counts[i]`` = tokens of ``messages[i]``; None lets the caller count them.
    token_counts: list[int] | None = None


__all__ = ["CompactionRequest", "CompactionResult"]
