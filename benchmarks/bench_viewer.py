"""The viewer on a long session: opening it, paging through it, its request view, time travel, and memory.

The data: ``viewer_messages`` short messages (about 150 bytes each: a million is 400 MB of log) imported into a
session (as ``import`` writes it: segments and a checkpoint), generated once and cached between runs
(``.bench-cache/``, or ``$CP_BENCH_CACHE``). Each round runs in a FRESH interpreter, so its peak memory is its
own, and drives the viewer's API in process (Starlette's test client: no network, no browser) through the
requests a browser makes: opening the session (its facts and the last 200 events), the last page of the full
view, a timeline page and a view page from the middle, the first page of the view, the request view at an
8,000-token budget, time travel to the middle (the first: the history's refs load) and then to another seq.

The floor, measured in the same child: a raw read of the log's last 200 lines (seek to the end of the active
segment, read back, split the lines, parse each with orjson): what any viewer must at least do to show the
newest events. Memory: the child's peak RSS against its RSS once the viewer's modules are imported.
Targets (docs/performance.md) keep every step bounded: what grows with the session must not show up in them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ._harness import CHILD_PRELUDE, CHILD_REPORT, Ctx, Row, compare, run_child
from .long_data import cache_root

GROUP = "viewer"
VERSION = 1

CHILD = """
import json, os, sys, time
import orjson
from starlette.testclient import TestClient
from context_persistent.viewer.app import create_app
from context_persistent.viewer.source import Source

storage, n = sys.argv[1], int(sys.argv[2])
pc = time.perf_counter

def rss_hwm_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

def floor():
    folder = os.path.join(storage, "big")
    names = [f for f in os.listdir(folder) if f.endswith(".jsonl")]
    path = max((os.path.join(folder, f) for f in names), key=os.path.getmtime)
    t = pc()
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - 200 * 400))
        lines = f.read().split(b"\\n")[-201:-1]
    parsed = [orjson.loads(x) for x in lines]
    assert len(parsed) == 200
    return pc() - t

result = {"floor": min(floor() for _ in range(5)), "base_rss_kb": rss_hwm_kb()}
token = "benchmark-token-0123456789"
half = n // 2
steps = [
    ("open", ["/api/sessions/big", "/api/sessions/big/timeline?limit=200"]),
    ("last page", ["/api/sessions/big/messages?limit=200"]),
    ("timeline middle", [f"/api/sessions/big/timeline?after={half}&limit=200"]),
    ("view middle", [f"/api/sessions/big/messages?start={half}&limit=200"]),
    ("view start", ["/api/sessions/big/messages?start=0&limit=200"]),
    ("request view", ["/api/sessions/big/request?budget=8000"]),
    ("time travel", [f"/api/sessions/big/messages?at={half}&limit=200"]),
    ("time travel again", [f"/api/sessions/big/messages?at={n // 4}&limit=200"]),
    ("request view in the past", [f"/api/sessions/big/request?at={n // 4}&budget=8000"]),
]
with TestClient(create_app(Source(storage), token, port=1), headers={"authorization": f"Bearer {token}"}) as c:
    for name, paths in steps:
        t = pc()
        for p in paths:
            r = c.get(p)
            assert r.status_code == 200, (p, r.text[:300])
        result[name] = pc() - t
"""

#: (step, row name, target as a ratio to the floor). Generous: they catch a step that starts scaling with the
#: session (a whole-log read is thousands of times the floor at a million messages), not noise.
STEPS = (
    ("open", "open a session: facts + last 200 events", "<= 5000"),
    ("last page", "last page of the full view", "<= 200"),
    ("timeline middle", "timeline page from the middle", "<= 300"),
    ("view middle", "first view page from the middle (loads the history's refs)", None),
    ("view start", "first page of the full view", "<= 200"),
    ("request view", "request view at 8,000 tokens", "<= 1500"),
    ("time travel", "time travel to the middle, first (after the refs loaded)", "<= 1500"),
    ("time travel again", "time travel to another seq", "<= 1000"),
    ("request view in the past", "request view at 8,000 tokens in the past", "<= 3000"),
)
RSS_TARGET = "<= 8"


def _session(n: int) -> Path:
    """The cached storage folder holding the session ``big`` of ``n`` messages (built on first use)."""
    folder = cache_root() / f"viewer-{n}-v{VERSION}"
    storage = folder / "store"
    if (folder / "done").exists():
        return storage
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, mode=0o700)
    run_child("""
import asyncio, json, sys
import orjson
from context_persistent import import_
folder, n = sys.argv[1], int(sys.argv[2])
src = folder + "/source.jsonl"
with open(src, "wb") as f:
    f.write(orjson.dumps({"role": "system", "content": "You are a careful agent."}) + b"\\n")
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        f.write(orjson.dumps({"role": role, "content": f"message {i}: " + "lorem ipsum dolor sit amet " * 4}) + b"\\n")
asyncio.run(import_(src, session_id="big", storage_path=folder + "/store", source="reference"))
print(json.dumps({}))
""", str(folder), str(n), timeout=3600)
    os.unlink(folder / "source.jsonl")
    (folder / "done").write_text(json.dumps({"messages": n, "version": VERSION}))
    return storage


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"viewer_messages": 20_000}, full={"viewer_messages": 1_000_000})
    n = ctx.size("viewer_messages")
    if n <= 0:
        return []
    try:
        import starlette  # noqa: F401
    except ImportError:
        from ._harness import Skip

        raise Skip("the [viewer] extra (starlette) is not installed")
    ctx.log(f"viewer: the session of {n:,} messages")
    storage = _session(n)
    results = []
    for r in range(ctx.rounds):
        ctx.log(f"viewer {n:,} round {r + 1}/{ctx.rounds}")
        results.append(run_child(CHILD + CHILD_REPORT, str(storage), str(n)))
    floor = [x["floor"] * 1000 for x in results]
    size = f"{n:,} messages"
    rows = [compare(GROUP, f"{label}, {size}", [x[step] * 1000 for x in results], floor, unit="ms",
                    ref_name="raw read of the log's last 200 lines", target=target)
            for step, label, target in STEPS]
    rows.append(compare(GROUP, f"peak RSS, every step above, {size}", [x["maxrss_kb"] / 1024 for x in results],
                        [x["base_rss_kb"] / 1024 for x in results], unit="MiB",
                        ref_name="RSS with the viewer imported", target=RSS_TARGET))
    return rows


__all__ = ["run", "CHILD_PRELUDE"]
