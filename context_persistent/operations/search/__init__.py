"""Finding any session: a search projection of every log of a storage, and the session index ``ls`` reads.

The index is one more projection of the logs (docs/search.md): rebuildable from them at any time
(``rebuild``), caught up from each session's last indexed record by the store's writer (``background``, off
the request path) and by every reader that finds it behind (``catch_up_storage``), and never trusted where it
disagrees with them (a damaged file is built again; a hit is checked against its log before it is returned).

Why it sits in ``operations`` and not above the store: the store's writer keeps it current, and erasure,
redaction and retention must take text out of it, so the store (above) and erasure and trash (its siblings
here) call into it; it imports only ``storage`` and ``model``, and no sibling (it is not allowed to import
``erasure``, which imports it).

Modules: ``text`` (what a message contributes, the query language; pure), ``fold`` (a session's documents from
its log), ``sqlite_index`` (the embedded FTS5 index), ``indexer`` (catching up, rebuilding, forgetting),
``erasing`` (the index's part in an erasure), ``background`` (the writer's thread), ``api`` (``search``,
``list_sessions``).

The names below load ``api`` on first use: the writer's thread (``background``, started by every store that
appends) imports the package for ``indexer`` alone, and a CLI turn need not pay for the query side (#23).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import RANK_WINDOW, SearchHit, SearchResults, list_sessions, parse_since, rebuild_index, search
    from .text import QueryError

__all__ = ["RANK_WINDOW", "QueryError", "SearchHit", "SearchResults", "list_sessions", "parse_since",
           "rebuild_index", "search"]
_HOME = {name: ".text" if name == "QueryError" else ".api" for name in __all__}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
