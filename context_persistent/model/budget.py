"""Which token budget applies to a request, and why (pure)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SOURCE_EXPLICIT = "explicit"
SOURCE_PROVIDER = "provider"
SOURCE_CONFIG = "config"


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _provider_limits(provider: Any) -> tuple[int, int] | None:
    """(context_window, max_output_tokens) from a provider, or None when it does not say."""
    candidates: list[Any] = []
    get_model_info = getattr(provider, "get_model_info", None)
    if callable(get_model_info):
        try:
            candidates.append(get_model_info())
        except Exception as e:
            logger.debug("provider.get_model_info() failed: %s", e)
    get_info = getattr(provider, "get_info", None)
    if callable(get_info):
        try:
            info = get_info()
            candidates.append(_field(info, "defaults"))
        except Exception as e:
            logger.debug("provider.get_info() failed: %s", e)
    for info in candidates:
        if info is None:
            continue
        window = _field(info, "context_window")
        out = _field(info, "max_output_tokens")
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            if not isinstance(out, int) or isinstance(out, bool) or out < 0:
                out = 0
            return window, out
    return None


def resolve_budget(
    token_budget: int | None, provider: Any, *, max_tokens: int, safety_margin: int
) -> tuple[int, str]:
    """The budget for a request and where it came from.

    Precedence: an explicit ``token_budget`` > the provider's ``context_window - max_output_tokens -
    safety_margin`` (``get_model_info()`` first, then ``get_info().defaults``) > the configured
    ``max_tokens``. A provider whose info is missing or broken falls through to ``max_tokens``.
    """
    if token_budget is not None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget <= 0:
            raise ValueError(f"token_budget must be a positive int or None, got {token_budget!r}")
        return token_budget, SOURCE_EXPLICIT
    if provider is not None:
        limits = _provider_limits(provider)
        if limits is not None:
            window, out = limits
            budget = window - out - safety_margin
            if budget > 0:
                return budget, SOURCE_PROVIDER
            logger.warning(
                "provider limits leave no room (context_window=%d, max_output_tokens=%d, safety_margin=%d); "
                "using max_tokens=%d",
                window, out, safety_margin, max_tokens,
            )
    return max_tokens, SOURCE_CONFIG
