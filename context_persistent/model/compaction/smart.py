"""``smart``: mask old large tool outputs, then drop the lowest-value groups, then truncate (pure)."""

from __future__ import annotations

from ..grouping import is_system, tool_calls_of
from ._base import Plan, finish, truncate_message
from .request import CompactionRequest, CompactionResult
from .masking import is_decision, is_error, masked_copy


class SmartStrategy:
    """Staged: (1) mask old large tool outputs, (2) drop low-value groups, (3) truncate long text.

    (1) Tool outputs of at least ``mask_min_tokens`` before the latest user turn (the execution boundary:
    outputs of the current turn stay whole) and not pinned are masked, oldest first, until the view fits
    the target. (2) Groups are scored by recency (0..1, +1 within the last ``keep_recent`` messages) and
    importance (+3 the first task statement, +0.25 errors, +0.25 decisions) and dropped lowest first until
    it fits. (3) Only when the kept-always part alone exceeds the budget: the longest non-system texts are
    cut (head and tail kept), largest first and the newest group last, until it fits; system and developer
    messages are never cut.
    """

    name = "smart"

    def __init__(self, keep_recent: int = 20, mask_min_tokens: int = 500) -> None:
        for key, value in (("keep_recent", keep_recent), ("mask_min_tokens", mask_min_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        self.keep_recent = keep_recent
        self.mask_min_tokens = mask_min_tokens

    async def compact(self, request: CompactionRequest) -> CompactionResult:
        plan = Plan.start(request, [True] * len(request.groups))
        recent = len(request.messages) - self.keep_recent  # messages from here on are "recent"
        masked = self._mask(request, plan)
        droppable = [g for g, p in enumerate(request.protected) if not p]
        first_task = next((g for g, group in enumerate(request.groups) if group.kind == "user"), None)
        scores = {g: self._score(request, g, recent, first_task) for g in droppable}
        for g in sorted(droppable, key=lambda g: (scores[g], g)):
            if plan.total <= request.target:
                break
            plan.drop(g)
        warning, truncated = None, 0
        if plan.kept_tokens > request.budget:
            need = plan.kept_tokens
            truncated = self._truncate(request, plan)
            warning = (f"the messages that must be kept (system, pinned, latest turn) need {need:,} tokens, more "
                       f"than the budget of {request.budget:,}; {truncated} long texts were truncated")
        kept_masks = sum(1 for i in masked if plan.keep[plan.group_of(i)])
        return await finish(plan, outputs_masked=kept_masks, truncated=truncated, warning=warning)

    def _mask(self, request: CompactionRequest, plan: Plan) -> list[int]:
        done: list[int] = []
        for g, group in enumerate(request.groups[: request.tail_start]):
            if plan.total <= request.target:
                break
            if request.protected[g] or group.kind != "tool":
                continue
            names = {key: name for key, name, _ in tool_calls_of(request.messages[group.start])}
            for i in group.indices:
                if request.tokens[i] >= self.mask_min_tokens:
                    masked = masked_copy(request.messages[i], request.tokens[i], names)
                    if masked is not None:
                        tokens = request.count(masked)
                        if tokens < request.tokens[i]:
                            plan.replace(i, masked, tokens)
                            done.append(i)
        return done

    def _score(self, request: CompactionRequest, g: int, recent: int, first_task: int | None) -> float:
        group = request.groups[g]
        score = g / len(request.groups) + (1.0 if group.stop > recent else 0.0)
        if g == first_task:
            score += 3.0
        msgs = [request.messages[i] for i in group.indices]
        score += 0.25 * any(is_error(m) for m in msgs) + 0.25 * any(is_decision(m) for m in msgs)
        return score

    def _truncate(self, request: CompactionRequest, plan: Plan) -> int:
        candidates = [
            i for g, group in enumerate(request.groups) if plan.keep[g] for i in group.indices
            if not is_system(request.messages[i])
        ]
        current = {i: plan.replaced.get(i, (request.messages[i], request.tokens[i])) for i in candidates}
        newest = request.groups[-1].start  # the newest group (what the model is acting on) is cut last
        done = 0
        for i in sorted(candidates, key=lambda i: (i >= newest, -current[i][1])):
            excess = plan.kept_tokens - request.budget
            if excess <= 0:
                break
            msg, tokens = current[i]
            cut = truncate_message(msg, tokens, max(tokens - excess, 0), request.count)
            if cut is not None and cut[1] < tokens:
                plan.replace(i, *cut)
                done += 1
        return done
