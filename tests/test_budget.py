"""Which budget wins: explicit > provider (get_model_info, then get_info().defaults) > max_tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from context_persistent.model.budget import resolve_budget


def _r(token_budget=None, provider=None):
    return resolve_budget(token_budget, provider, max_tokens=200_000, safety_margin=1000)


def test_explicit_wins() -> None:
    """An explicit token_budget beats any provider."""
    p = SimpleNamespace(get_info=lambda: SimpleNamespace(defaults={"context_window": 10_000}))
    assert _r(5000, p) == (5000, "explicit")


def test_get_info_defaults() -> None:
    """get_info().defaults gives context_window - max_output_tokens - safety_margin."""
    p = SimpleNamespace(get_info=lambda: SimpleNamespace(defaults={"context_window": 200_000,
                                                                   "max_output_tokens": 8192}))
    assert _r(None, p) == (200_000 - 8192 - 1000, "provider")


def test_get_model_info_first() -> None:
    """get_model_info() is asked before get_info()."""
    p = SimpleNamespace(get_model_info=lambda: SimpleNamespace(context_window=50_000, max_output_tokens=4_000),
                        get_info=lambda: SimpleNamespace(defaults={"context_window": 1}))
    assert _r(None, p) == (45_000, "provider")


@pytest.mark.parametrize("provider", [
    SimpleNamespace(),                                                           # no info methods
    SimpleNamespace(get_info=lambda: 1 / 0),                                     # raises
    SimpleNamespace(get_info=lambda: SimpleNamespace(defaults=None)),            # no defaults
    SimpleNamespace(get_info=lambda: SimpleNamespace(defaults={"context_window": "big"})),  # wrong type
    SimpleNamespace(get_model_info=lambda: None, get_info=lambda: SimpleNamespace(defaults={})),
    SimpleNamespace(get_info=lambda: SimpleNamespace(defaults={"context_window": 500, "max_output_tokens": 600})),
])
def test_broken_providers_fall_back_to_max_tokens(provider: object) -> None:
    """A provider with missing, broken or useless info falls back cleanly to max_tokens."""
    assert _r(None, provider) == (200_000, "config")


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "100"])
def test_bad_explicit_budget(bad: object) -> None:
    """A token_budget that is not a positive int is refused with a clear ValueError."""
    with pytest.raises(ValueError, match="token_budget must be a positive int"):
        _r(bad)
