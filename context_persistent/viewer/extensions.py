"""Plug points for what other parts of the project will add to the viewer: full-text search over the sessions
(the search projection, issue #25) and provider-reported token usage (the usage ledger, issue #22).

The viewer works without them: the sessions page shows its search box only when a search provider is
given (``create_app(..., extensions=Extensions(...))``). Without a usage provider the token chart draws the
session's own ``usage_reported`` records (usage.py's :class:`LogUsage`); another provider replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class SearchProvider(Protocol):
    """Finds sessions and events matching a query (read-only)."""

    async def search(self, query: str, *, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` hits, best first, each a dict with at least ``session_id`` and ``seq`` (the event
        that matched) and optionally ``snippet`` (plain text; shown as text, never as HTML)."""
        ...


class UsageProvider(Protocol):
    """Token usage a provider reported for a session's requests (read-only)."""

    async def usage(self, session_id: str, *, at_seq: int | None, limit: int) -> list[dict[str, Any]]:
        """At most ``limit`` dicts, one per request (or per run of requests), oldest first, made at or before
        ``at_seq`` (all when None): ``seq`` (the report's event), ``request_seq`` (the last event the
        request saw; ``seq`` when missing), ``input_tokens`` (the provider's count of the request),
        ``estimated_tokens`` (the store's), ``output_tokens`` (ints or None) and ``reports`` (how many
        reports the entry stands for). The chart draws them beside the counted tokens."""
        ...


@dataclass(frozen=True, slots=True)
class Extensions:
    """The optional providers a viewer is given (None: the feature is not offered)."""

    search: SearchProvider | None = None
    usage: UsageProvider | None = None

    def features(self) -> dict[str, bool]:
        return {"search": self.search is not None, "usage": self.usage is not None}
