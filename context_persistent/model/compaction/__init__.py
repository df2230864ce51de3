"""The request view: the stored history made valid for providers and, over the threshold, fitted to the budget.

Pure: no file I/O, no asyncio (``build_request_view`` is ``async`` only so an async summariser can be awaited).
The pipeline and its invariants are described in ``docs/compaction.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..grouping import Analysis, Group, RepairReport, analyse, is_real_user_turn, is_system
from ._base import Plan, count_view, finish, marker_message, summary_message, truncate_message
from .invariants import check_view
from ..values import Frozen, set_field as _set

if TYPE_CHECKING:
    from .request import CompactionRequest, CompactionResult

__all__ = [
    "STRATEGIES",
    "CompactionConfig",
    "CompactionRequest",
    "CompactionResult",
    "CompactionStrategy",
    "Plan",
    "RequestView",
    "build_request_view",
    "check_view",
    "finish",
    "make_strategy",
    "marker_message",
    "summary_message",
    "truncate_message",
]

STRATEGIES = ("simple", "smart", "head_tail", "custom")
Message = dict[str, Any]
#: The fields of a CompactionConfig (the arguments of its ``__init__``, in order).
_CONFIG_FIELDS = ("auto_compact", "compact_threshold", "target_usage", "strategy", "keep_recent", "keep_head",
                  "mask_min_tokens", "custom", "summarizer")


@runtime_checkable
class CompactionStrategy(Protocol):
    """A compaction strategy: one async method from a request to a view.

    It may return a plain list of messages. Third-party output is checked against the invariants
    (``docs/compaction.md``); a view that breaks one is rejected and ``smart`` is used instead.
    """

    async def compact(self, request: CompactionRequest) -> CompactionResult | list[Message]: ...


def _positive_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def resolve_callable(spec: Any) -> Any:
    """A callable, an object with ``compact``, or a ``"module:function"`` string resolved by import."""
    if isinstance(spec, str):
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"custom must be a callable or a 'module:function' string, got {spec!r}")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"custom strategy {spec!r} could not be imported: {e}") from e
        spec = obj
    if not (callable(spec) or callable(getattr(spec, "compact", None))):
        raise ValueError(f"custom must be callable or have a compact() method, got {spec!r}")
    return spec


class CompactionConfig(Frozen):
    """How request views are compacted. Every field is validated here; a ``ValueError`` states the rule.

    - ``compact_threshold``: compact when the view's tokens reach ``compact_threshold * budget``.
    - ``target_usage``: compact down to ``target_usage * budget`` (``0 < target_usage <= compact_threshold <= 1``).
    - ``keep_recent`` (default 20 messages): ``simple`` keeps the last ``keep_recent`` messages (whole groups);
      ``smart`` drops groups in that window last.
    - ``keep_head`` (default 2 messages): ``head_tail`` keeps the first ``keep_head`` non-system messages.
    - ``mask_min_tokens`` (default 500): ``smart`` masks only tool outputs at least this large.
    - ``custom``: a callable ``(CompactionRequest) -> list | CompactionResult`` (sync or async), an object
      with such a ``compact`` method, or a ``"module:function"`` string; required for ``strategy="custom"``.
    - ``summarizer``: optional ``async (dropped_messages: list[dict]) -> str``; its summary replaces the marker.
    """

    __slots__ = ("auto_compact", "compact_threshold", "target_usage", "strategy", "keep_recent", "keep_head",
                 "mask_min_tokens", "custom", "summarizer", "custom_impl")
    auto_compact: bool
    compact_threshold: float
    target_usage: float
    strategy: str
    keep_recent: int
    keep_head: int
    mask_min_tokens: int
    custom: Callable[..., Any] | str | None
    summarizer: Callable[[list[Message]], Awaitable[str] | str] | None
    custom_impl: Any  #: ``custom`` resolved (not an argument; not compared or printed)

    def __init__(self, auto_compact: bool = True, compact_threshold: float = 0.92, target_usage: float = 0.5,
                 strategy: str = "smart", keep_recent: int = 20, keep_head: int = 2, mask_min_tokens: int = 500,
                 custom: Callable[..., Any] | str | None = None,
                 summarizer: Callable[[list[Message]], Awaitable[str] | str] | None = None) -> None:
        for name, value in zip(_CONFIG_FIELDS, (auto_compact, compact_threshold, target_usage, strategy, keep_recent,
                                                keep_head, mask_min_tokens, custom, summarizer)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "custom_impl", None)
        if not isinstance(self.auto_compact, bool):
            raise ValueError(f"auto_compact must be a bool, got {self.auto_compact!r}")
        _fraction("compact_threshold", self.compact_threshold)
        _fraction("target_usage", self.target_usage)
        if self.target_usage > self.compact_threshold:
            raise ValueError(
                f"target_usage ({self.target_usage}) must not exceed compact_threshold ({self.compact_threshold})"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        _positive_int("keep_recent", self.keep_recent, 1)
        _positive_int("keep_head", self.keep_head, 0)
        _positive_int("mask_min_tokens", self.mask_min_tokens, 1)
        if self.summarizer is not None and not callable(self.summarizer):
            raise ValueError(f"summarizer must be a callable or None, got {self.summarizer!r}")
        if self.strategy == "custom":
            if self.custom is None:
                raise ValueError("strategy='custom' needs custom: a callable or a 'module:function' string")
            object.__setattr__(self, "custom_impl", resolve_callable(self.custom))
        elif self.custom is not None:
            raise ValueError(f"custom is set but strategy is {self.strategy!r}; set strategy='custom' to use it")

    def _fields(self) -> tuple[str, ...]:
        return _CONFIG_FIELDS

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CompactionConfig:
        """Pick the known keys of a module config (unknown keys are ignored: they belong to others).

        ``compaction_strategy`` is read as ``strategy`` (the Amplifier key; either spelling works),
        ``compaction_threshold`` as ``compact_threshold``, and ``custom_strategy`` as ``custom``.
        """
        aliases = {"compaction_strategy": "strategy", "compaction_threshold": "compact_threshold",
                   "custom_strategy": "custom"}
        known = set(_CONFIG_FIELDS)
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            name = aliases.get(key, key)
            if name in known and value is not None:
                if name in kwargs and kwargs[name] != value:
                    raise ValueError(f"config sets {name!r} twice with different values (via {key!r})")
                kwargs[name] = value
        return cls(**kwargs)


class RequestView(Frozen):
    """What a provider receives: new message dicts, their token count, and stats for events."""

    __slots__ = ("messages", "token_count", "compacted", "stats")
    messages: list[Message]
    token_count: int
    compacted: bool
    stats: dict[str, Any]

    def __init__(self, messages: list[Message], token_count: int, compacted: bool, stats: dict[str, Any]) -> None:
        _set(self, "messages", messages)
        _set(self, "token_count", token_count)
        _set(self, "compacted", compacted)
        _set(self, "stats", stats)


def make_strategy(config: CompactionConfig) -> CompactionStrategy:
    """The strategy object ``config`` names."""
    from .custom import CustomStrategy
    from .head_tail import HeadTailStrategy
    from .simple import SimpleStrategy
    from .smart import SmartStrategy

    if config.strategy == "simple":
        return SimpleStrategy(keep_recent=config.keep_recent)
    if config.strategy == "head_tail":
        return HeadTailStrategy(keep_head=config.keep_head)
    if config.strategy == "custom":
        return CustomStrategy(config.custom_impl)
    return SmartStrategy(keep_recent=config.keep_recent, mask_min_tokens=config.mask_min_tokens)


def _request(
    messages: Sequence[Message], tokens: Sequence[int], pinned: Sequence[bool], budget: int,
    config: CompactionConfig, count: Callable[[Message], int],
) -> tuple[CompactionRequest, RepairReport]:
    """Repair, count (reusing ``tokens`` for unchanged messages), group, and mark what must be kept."""
    found, toks, pins = _repaired(messages, tokens, pinned, count)
    return _made_request(found, toks, pins, budget, config, count), found.report


def _repaired(messages: Sequence[Message], tokens: Sequence[int], pinned: Sequence[bool],
              count: Callable[[Message], int]) -> tuple[Analysis, list[int], list[bool]]:
    """The repaired sequence and its groups, with each message's count and pin (of the message it came from)."""
    found = analyse(messages)
    toks: list[int] = []
    pins: list[bool] = []
    for m, src in zip(found.messages, found.sources):
        toks.append(tokens[src] if src is not None and m is messages[src] else count(m))
        pins.append(bool(pinned[src]) if src is not None else False)
    return found, toks, pins


def _made_request(found: Analysis, toks: list[int], pins: list[bool], budget: int, config: CompactionConfig,
                  count: Callable[[Message], int]) -> CompactionRequest:
    """The request of a compaction (request.py loads with the first one)."""
    from .request import CompactionRequest

    msgs, groups = found.messages, found.groups
    group_tokens = [sum(toks[g.start : g.stop]) for g in groups]
    tail_start = _tail_start(msgs, groups)
    protected = [
        gi >= tail_start or any(pins[i] or is_system(msgs[i]) for i in g.indices) for gi, g in enumerate(groups)
    ]
    return CompactionRequest(
        messages=msgs, tokens=toks, pinned=pins, groups=groups, group_tokens=group_tokens,
        protected=protected, tail_start=tail_start, budget=budget,
        target=int(config.target_usage * budget), count=count, config=config,
    )


def _tail_start(messages: Sequence[Message], groups: Sequence[Group]) -> int:
    """Index of the group holding the latest real user message (the last group when there is none)."""
    for gi in range(len(groups) - 1, -1, -1):
        if any(is_real_user_turn(messages[i]) for i in groups[gi].indices):
            return gi
    return max(len(groups) - 1, 0)


async def build_request_view(
    messages: Sequence[Message],
    tokens: Sequence[int],
    pinned: Sequence[bool],
    budget: int,
    config: CompactionConfig,
    count: Callable[[Message], int],
    copy: bool = True,
) -> RequestView:
    """The request view of ``messages`` (the full stored history, in order); the input is never mutated.
    Its dicts are new (shallow copies); with ``copy`` False a message kept unchanged is the input's own dict
    (for a caller that copies the view itself and tells the history's messages by identity).

    ``tokens[i]`` is the cached count of ``messages[i]``; ``count`` is used only for new messages
    (placeholders, markers, summaries, masked or truncated copies). O(n) apart from the strategy's sort.
    """
    if not (len(messages) == len(tokens) == len(pinned)):
        raise ValueError(
            f"messages, tokens and pinned must have the same length ({len(messages)}, {len(tokens)}, {len(pinned)})"
        )
    _positive_int("budget", budget, 1)
    found, toks, pins = _repaired(messages, tokens, pinned, count)
    before = sum(toks)
    stats: dict[str, Any] = {
        "budget": budget, "strategy": config.strategy, "strategy_used": None,
        "before_tokens": sum(tokens), "before_messages": len(messages),
        "groups_dropped": 0, "outputs_masked": 0, "truncated": 0, "summarized": False,
        "warning": None, "repairs": found.report.as_dict(),
    }
    if not config.auto_compact or before < config.compact_threshold * budget:
        out = [dict(m) for m in found.messages] if copy else list(found.messages)
        if before > budget:
            stats["warning"] = f"view needs {before:,} tokens, over the budget of {budget:,} (auto_compact is off)"
        return _view(out, before, False, stats)
    request = _made_request(found, toks, pins, budget, config, count)
    result = await _run(make_strategy(config), request, stats)
    total = sum(result.token_counts) if result.token_counts is not None else count_view(request, result.messages)
    for key in ("groups_dropped", "outputs_masked", "truncated", "summarized"):
        stats[key] = getattr(result, key)
    warning = result.warning or stats["warning"]
    if total > budget:
        warning = (warning + "; " if warning else "") + (
            f"the messages that must be kept (system, pinned, latest turn) need {request.protected_tokens:,} "
            f"tokens, more than the budget of {budget:,}; this is the smallest valid view ({total:,} tokens)"
        )
    stats["warning"] = warning
    return _view([dict(m) for m in result.messages] if copy else list(result.messages), total, True, stats)


async def _run(strategy: CompactionStrategy, request: CompactionRequest, stats: dict[str, Any]) -> CompactionResult:
    """Run ``strategy``; an exception or an invalid view from a custom strategy falls back to smart."""
    from .custom import CustomStrategy, InvalidViewError
    from .request import CompactionResult
    from .smart import SmartStrategy

    name = request.config.strategy
    try:
        answer = await strategy.compact(request)
        result = answer if isinstance(answer, CompactionResult) else CompactionResult(messages=list(answer))
    except Exception as e:
        if not isinstance(strategy, CustomStrategy):
            raise
        reason = str(e) if isinstance(e, InvalidViewError) else f"{type(e).__name__}: {e}"
        stats["warning"] = f"custom strategy rejected ({reason}); used smart instead"
        config = request.config
        result = await SmartStrategy(config.keep_recent, config.mask_min_tokens).compact(request)
        name = "smart"
    stats["strategy_used"] = name
    return result


def _view(out: list[Message], total: int, compacted: bool, stats: dict[str, Any]) -> RequestView:
    stats.update(message_count=len(out), token_count=total, after_tokens=total, after_messages=len(out))
    return RequestView(out, total, compacted, stats)


def __getattr__(name: str) -> Any:
    """``CompactionRequest`` and ``CompactionResult`` load from request.py on first use (a turn that compacts
    nothing does not pay for their dataclasses)."""
    if name in ("CompactionRequest", "CompactionResult"):
        from . import request

        return getattr(request, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
