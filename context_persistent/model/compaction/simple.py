"""``simple``: system messages plus the last ``keep_recent`` messages, in whole groups (pure)."""

from __future__ import annotations

from ._base import Plan, finish
from .request import CompactionRequest, CompactionResult


class SimpleStrategy:
    """Keep what must be kept plus the most recent ``keep_recent`` messages, never splitting a group.

    The kept-always part (system/developer, pinned, the latest user turn and after) counts toward
    ``keep_recent`` but is kept even beyond it. If the result is still above the target, the oldest
    remaining groups are left out until it fits.
    """

    name = "simple"

    def __init__(self, keep_recent: int = 20) -> None:
        if isinstance(keep_recent, bool) or not isinstance(keep_recent, int) or keep_recent < 1:
            raise ValueError(f"keep_recent must be an int >= 1, got {keep_recent!r}")
        self.keep_recent = keep_recent

    async def compact(self, request: CompactionRequest) -> CompactionResult:
        keep = list(request.protected)
        seen = 0
        for g in range(len(request.groups) - 1, -1, -1):
            group = request.groups[g]
            if group.kind == "system":
                continue  # system messages are kept anyway and do not use up the window
            if not keep[g]:
                if seen + len(group) > self.keep_recent:
                    break
                keep[g] = True
            seen += len(group)
        plan = Plan.start(request, keep)
        for g in range(len(keep)):  # oldest first
            if plan.total <= request.target:
                break
            if not request.protected[g]:
                plan.drop(g)
        return await finish(plan)
