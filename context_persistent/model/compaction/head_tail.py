"""``head_tail``: the first messages (the task statement) and as many of the last ones as fit (pure)."""

from __future__ import annotations

from ._base import Plan, finish
from .request import CompactionRequest, CompactionResult


class HeadTailStrategy:
    """Keep the first ``keep_head`` non-system messages (whole groups) and the latest groups that fit.

    The head usually holds the task statement the whole session works toward. The tail is filled from the
    newest group backwards and stops at the first group that does not fit, so it stays contiguous. If the
    head itself does not fit the target, its groups are left out from the last one back.
    """

    name = "head_tail"

    def __init__(self, keep_head: int = 2) -> None:
        if isinstance(keep_head, bool) or not isinstance(keep_head, int) or keep_head < 0:
            raise ValueError(f"keep_head must be an int >= 0, got {keep_head!r}")
        self.keep_head = keep_head

    async def compact(self, request: CompactionRequest) -> CompactionResult:
        groups = request.groups
        keep = list(request.protected)
        head: list[int] = []
        seen = 0
        for g in range(request.tail_start):
            if groups[g].kind == "system":
                continue
            if seen + len(groups[g]) > self.keep_head:
                break
            seen += len(groups[g])
            if not keep[g]:
                keep[g] = True
                head.append(g)
        plan = Plan.start(request, keep)
        for g in reversed(head):
            if plan.total <= request.target:
                break
            plan.drop(g)
        for g in range(request.tail_start - 1, -1, -1):
            if plan.keep[g]:
                continue
            if plan.cost_if_added(g) > request.target:
                break
            plan.add(g)
        return await finish(plan)
