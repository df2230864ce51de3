"""What a CLI turn of the Amplifier module loads: every ``amplifier run`` is a new process, so each module it
imports and each pattern it compiles is paid on every turn (docs/performance.md, "The fixed cost of a turn").

The turn is run in a fresh interpreter the way the host runs it: amplifier_core's validator mounts the module
(a throwaway store), then a new session is mounted, given a transcript, appended to, asked for a request view
and cleaned up, then the same session is resumed for a second turn, whose model reply takes longer than the
writer's search-indexing thread waits before it works: the thread runs (its index is written), so what must not
load is what only a query, a trash, a fit or a tokenizer file needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TURN = r"""
import asyncio, json, os, sys
import amplifier_module_context_persistent as entry
from context_persistent.operations.search import text

storage = sys.argv[1]

class Coordinator:
    session_id = "turn-imports"
    hooks = None
    async def mount(self, point, instance):
        self.context = instance

async def turn(n, reply):
    c = Coordinator()
    cleanup = await entry.mount(c, {"storage_path": storage, "fsync": "always"})
    await c.context.get_messages()
    await c.context.set_messages([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    await c.context.add_message({"role": "user", "content": f"turn {n}: about herons"})
    await c.context.get_messages_for_request()
    await asyncio.sleep(reply)  # (the model's reply: the indexer's thread works meanwhile once its quiet ends)
    await c.context.add_message({"role": "assistant", "content": "herons wade"})
    await cleanup()

async def main():
    try:
        from amplifier_core.validation import ContextValidator
    except ImportError:
        validated = None
    else:
        result = await ContextValidator().validate(os.path.dirname(entry.__file__), config={"storage_path": storage})
        validated = result.passed
    from context_persistent.operations.search import background
    quiet, background.QUIET, background.MAX_DELAY = background.QUIET, 30.0, 60.0
    await turn(1, 0.0)  # (a reply faster than the indexer's quiet period: the close leaves its work to readers)
    global quick
    quick = sorted(m for m in sys.modules if m == "sqlite3" or m.startswith("context_persistent.operations.search.")
                   and m.rsplit(".", 1)[1] in ("indexer", "sqlite_index", "fold"))
    background.QUIET, background.MAX_DELAY = quiet, 2.0
    await turn(2, quiet + 0.3)
    return validated

validated = asyncio.run(main())
compiled = {name: getattr(text, name).cache_info().currsize if hasattr(text, name) else None
            for name in ("cjk", "query_patterns")}
dataclasses = sorted(f"{m.__name__}.{v.__qualname__}" for name, m in list(sys.modules.items())
                     if name.startswith("context_persistent") for v in vars(m).values()
                     if isinstance(v, type) and v.__module__ == name and "__dataclass_fields__" in vars(v))
print(json.dumps({"modules": sorted(sys.modules), "validated": validated, "dataclasses": dataclasses, "quick": quick,
                  **compiled}))
"""

#: Loaded by a query, a trash, a calibration fit, a gzipped tokenizer file, a token count, an erase, a
#: retention policy or a compaction: never by a turn (that compacts nothing).
NOT_ON_THE_TURN_PATH = ("context_persistent.operations.search.api", "context_persistent.operations.search.opening",
                        "context_persistent.model.retention", "statistics", "gzip", "tiktoken",
                        "context_persistent.store.erase", "context_persistent.operations.retention_on_open",
                        "context_persistent.model.compaction.request")


@pytest.fixture(scope="module")
def turn(tmp_path_factory: pytest.TempPathFactory) -> dict:
    storage = tmp_path_factory.mktemp("turn-imports") / "store"
    proc = subprocess.run([sys.executable, "-c", TURN, str(storage)], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(storage.parent)},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    out["storage"] = storage
    return out


def test_a_turn_loads_neither_the_query_side_nor_what_only_rare_paths_need(turn: dict) -> None:
    loaded = set(turn["modules"])
    # (the turn did what a CLI turn does: the store's parts, the request view and the writer's indexer ran)
    assert {"context_persistent.store.request_views", "context_persistent.operations.search.indexer",
            "context_persistent.operations.search.sqlite_index"} <= loaded
    assert (turn["storage"] / ".search" / "index.sqlite3").exists()
    assert turn["validated"] in (True, None)
    assert sorted(loaded & set(NOT_ON_THE_TURN_PATH)) == []


def test_a_turn_closed_before_the_indexers_quiet_period_ends_loads_no_indexing_side(turn: dict) -> None:
    """The writer's thread imports the indexing side (and sqlite3) when it first has work to do, after the quiet
    period that follows an append: a CLI turn whose reply is faster, closed meanwhile (its close leaves the work
    to readers: docs/search.md), imports none of it."""
    assert turn["quick"] == []


def test_the_classes_a_turn_loads_are_not_dataclasses(turn: dict) -> None:
    """``@dataclass`` compiles a class's methods from source at import (0.5-1 ms each, every turn): the value
    classes a turn loads are plain slotted classes (model/values.py). The dataclasses a custom compaction
    strategy gets and returns (compaction/request.py) load with the first compaction."""
    assert turn["dataclasses"] == []


def test_a_turn_of_ascii_text_compiles_no_search_pattern(turn: dict) -> None:
    """The CJK character class (about 4 ms to compile) is compiled for non-ASCII text only, the query
    language's patterns for the first query: the indexer of an ASCII turn compiles neither."""
    assert turn["cjk"] == 0
    assert turn["query_patterns"] == 0


def test_opening_a_store_leaves_the_indexing_modules_to_the_writers_thread(tmp_path: Path) -> None:
    """The indexing side (and sqlite3) is imported by the search index's thread when the first append starts
    it, not by the open of an existing session in the caller's thread (where the host's turn waits for it)."""
    code = ("import asyncio, sys\n"
            "from context_persistent import PersistentContextManager\n"
            "async def main():\n"
            "    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id='s')\n"
            "    loaded = sorted(m for m in sys.modules if m == 'sqlite3' or m.startswith('context_persistent.op'))\n"
            "    await store.close()\n"
            "    print(' '.join(loaded))\n"
            "asyncio.run(main())\n")
    for _ in range(2):  # (the first run creates the session: its first record starts the thread at once)
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], capture_output=True, text=True,
                              cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(proc.stdout.split())
    assert "context_persistent.operations.search.background" in loaded  # (the store has an indexer)
    assert not loaded & {"sqlite3", "context_persistent.operations.search.indexer",
                         "context_persistent.operations.search.sqlite_index"}
