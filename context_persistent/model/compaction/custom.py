"""``custom``: a user's callable or ``"module:function"``, held to the same invariants as the built-ins."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from ._base import view_token_counts
from .request import CompactionRequest, CompactionResult
from .invariants import check_view


class InvalidViewError(ValueError):
    """A custom strategy returned a view that breaks an invariant."""


class CustomStrategy:
    """Run a third-party strategy and check its view.

    ``impl`` is an object with ``compact(request)`` or a callable ``(request) -> list[dict] |
    CompactionResult``, sync or async. It receives a request whose message list holds shallow copies, so it
    cannot reorder or rebind the stored ones. A view that breaks an invariant raises
    :class:`InvalidViewError`; ``build_request_view`` then uses ``smart`` and says so in the warning.
    """

    name = "custom"

    def __init__(self, impl: Any) -> None:
        fn = getattr(impl, "compact", impl)
        if not callable(fn):
            raise ValueError(f"a custom strategy must be callable or have a compact() method, got {impl!r}")
        self._fn = fn

    async def compact(self, request: CompactionRequest) -> CompactionResult:
        safe = replace(request, messages=[dict(m) for m in request.messages])
        out: Any = self._fn(safe)
        if inspect.isawaitable(out):
            out = await out
        result = out if isinstance(out, CompactionResult) else CompactionResult(messages=out)
        if not isinstance(result.messages, list):
            raise InvalidViewError(f"expected a list of messages, got {type(result.messages).__name__}")
        problems = check_view(safe, result.messages, allow_truncated=result.truncated > 0)
        if problems:
            raise InvalidViewError("; ".join(problems[:3]))
        return replace(result, token_counts=view_token_counts(safe, result.messages))
