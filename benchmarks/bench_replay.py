"""Resuming: open + replay a session, peak memory, and the time to the first request view.

Every measurement runs in a fresh interpreter (so peak RSS, ``VmHWM``, is the measurement's own) on a
hot page cache: the file was just written. Floor: the same ``events.jsonl`` parsed line by line with
``orjson.loads``, every record kept (``[loads(l) for l in f]``, GC on: Python at its simplest); the same
with the GC disabled is shown too. Peers: the reference module's resume (stdlib json over its
``context-messages.jsonl``) and stdlib sqlite3 reading the rows back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from ._harness import CHILD_REPORT, Ctx, Row, compare, run_child
from .peers import sqlite_wal
from .workloads import sized_messages, write_reference, write_session

GROUP = "replay"

FLOOR = """
import gc, sys, time, orjson
path, gc_on = sys.argv[1], sys.argv[2] == "gc"
if not gc_on:
    gc.disable()
t = time.perf_counter()
loads = orjson.loads
with open(path, "rb") as f:
    recs = [loads(line) for line in f]
result = {"seconds": time.perf_counter() - t, "n": len(recs)}
""" + CHILD_REPORT

OURS = """
import asyncio, os, sys, time
from context_persistent import PersistentContextManager
from context_persistent.storage.paths import CHECKPOINT_NAME
storage, sid, mode, start = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
checkpoint = os.path.join(storage, sid, CHECKPOINT_NAME)
if start == "cold" and os.path.exists(checkpoint):
    os.remove(checkpoint)
async def main():
    out = {"checkpoint": os.path.exists(checkpoint)}
    t = time.perf_counter()
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid)
    out["open"] = time.perf_counter() - t
    out["open_maxrss_kb"] = peak_rss_kb()
    t = time.perf_counter()
    if mode == "replay":
        msgs = await store.get_messages()
        out["get_messages"] = time.perf_counter() - t
    else:
        msgs = await store.get_messages_for_request()
        out["first_request"] = time.perf_counter() - t
    out["n"] = len(msgs)
    await store.close()  # writes a checkpoint after a cold open (not timed)
    return out
result = asyncio.run(main())
""" + CHILD_REPORT

REFERENCE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from benchmarks.peers import ReferenceReRead
from pathlib import Path
t = time.perf_counter()
msgs = ReferenceReRead(Path(sys.argv[1])).read_all()
result = {"seconds": time.perf_counter() - t, "n": len(msgs)}
""" + CHILD_REPORT

SQLITE = """
import sqlite3, sys, time, orjson
t = time.perf_counter()
conn = sqlite3.connect(sys.argv[1])
loads = orjson.loads
msgs = [loads(row[0]) for row in conn.execute("SELECT data FROM messages WHERE session = 's' ORDER BY id")]
result = {"seconds": time.perf_counter() - t, "n": len(msgs)}
""" + CHILD_REPORT


def _build(ctx: Ctx, n: int, size: int) -> dict[str, Path]:
    folder = ctx.tempdir(f"replay-{n}-{size}")
    msgs = sized_messages(n, size)
    storage = folder / "store"
    log = write_session(storage, "s", msgs)
    ref = write_reference(folder / "context-messages.jsonl", msgs)
    conn = sqlite_wal(folder / "peer.db", "OFF")
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO messages (session, data) VALUES ('s', ?)", ((orjson.dumps(m).decode(),) for m in msgs))
    conn.execute("COMMIT")
    conn.close()
    return {"storage": storage, "log": log, "ref": ref, "db": folder / "peer.db"}


def _measure(ctx: Ctx, n: int, size: int, rounds: int) -> dict[str, list[Any]]:
    paths = _build(ctx, n, size)
    root = str(Path(__file__).resolve().parent.parent)
    store = str(paths["storage"])
    got: dict[str, list[Any]] = {k: [] for k in ("floor", "floor_nogc", "cold", "first_cold", "warm", "first_warm",
                                                  "ref", "sqlite")}
    for r in range(rounds):
        ctx.log(f"replay {n:,} x {size} B round {r + 1}/{rounds}")
        got["floor"].append(run_child(FLOOR, str(paths["log"]), "gc"))
        got["floor_nogc"].append(run_child(FLOOR, str(paths["log"]), "nogc"))
        # Order matters: the cold first request counts every token and its close writes the checkpoint
        # (with those counts) that the warm runs then resume from.
        got["cold"].append(run_child(OURS, store, "s", "replay", "cold"))
        if size == 300:  # (4 KB: tokenising 100k x 4 KB costs a minute a round and says nothing new)
            got["first_cold"].append(run_child(OURS, store, "s", "request", "cold"))
        got["warm"].append(run_child(OURS, store, "s", "replay", "warm"))
        if size == 300:
            got["first_warm"].append(run_child(OURS, store, "s", "request", "warm"))
        got["ref"].append(run_child(REFERENCE, str(paths["ref"]), root))
        got["sqlite"].append(run_child(SQLITE, str(paths["db"])))
    return got


def _secs(xs: list[dict[str, Any]], *keys: str) -> list[float]:
    return [sum(x[k] for k in keys) for x in xs]


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"replay_small": 0, "replay_mid": 10_000, "replay_large": 30_000, "replay_4k": 2000,
                        "replay_rounds": 2, "replay_large_rounds": 2},
                 full={"replay_small": 10_000, "replay_mid": 100_000, "replay_large": 1_000_000,
                       "replay_4k": 100_000, "replay_rounds": 3, "replay_large_rounds": 2})
    rows: list[Row] = []
    cases = [(ctx.size("replay_small"), 300), (ctx.size("replay_mid"), 300), (ctx.size("replay_4k"), 4096),
             (ctx.size("replay_large"), 300)]
    largest = ctx.size("replay_large")
    floor_name = "floor: orjson.loads per line, keep all (GC on)"
    for n, size in cases:
        if not n:
            continue
        rounds = ctx.size("replay_rounds") if n * size < 100_000_000 else ctx.size("replay_large_rounds")
        got = _measure(ctx, n, size, rounds)
        key = largest == n and size == 300
        label = f"{n:,} x {size} B"
        quick_note = "target is for 1M x 300 B; quick size" if key and largest < 1_000_000 else ""
        floor = _secs(got["floor"], "seconds")
        cold_ready = _secs(got["cold"], "open", "get_messages")
        # close() writes a checkpoint only past a minimum number of events (checkpoint.CLOSE_MIN_EVENTS).
        warm_note = "" if all(x["checkpoint"] for x in got["warm"]) else "no checkpoint was written (tiny session)"
        rows += [
            compare(GROUP, f"open+replay {label}, no checkpoint", _secs(got["cold"], "open"), floor, unit="s",
                    ref_name=floor_name, target="<= 1.5" if key else None, note=quick_note),
            compare(GROUP, f"open+replay {label}, no checkpoint, vs GC-off floor", _secs(got["cold"], "open"),
                    _secs(got["floor_nogc"], "seconds"), unit="s", ref_name="floor with gc.disable()"),
            compare(GROUP, f"open {label} from a checkpoint", _secs(got["warm"], "open"), floor, unit="s",
                    ref_name=floor_name, note=warm_note or "reads the front section only (lazy open)"),
            compare(GROUP, f"open + get_messages() {label} from a checkpoint", _secs(got["warm"], "open", "get_messages"),
                    floor, unit="s", ref_name=floor_name, target="<= 0.6" if (n, size) == (100_000, 300) else None,
                    note=warm_note or "the rest of the checkpoint loads here"),
            compare(GROUP, f"open + get_messages() {label}, no checkpoint", cold_ready, floor, unit="s",
                    ref_name=floor_name, note="get_messages() returns a copy"),
            compare(GROUP, f"peak RSS after open {label}, no checkpoint",
                    [x["open_maxrss_kb"] / 1024 for x in got["cold"]], [x["maxrss_kb"] / 1024 for x in got["floor"]],
                    unit="MB", ref_name="floor process peak RSS", target="<= 2" if key else None, note=quick_note),
            compare(GROUP, f"peak RSS after open {label} from a checkpoint",
                    [x["open_maxrss_kb"] / 1024 for x in got["warm"]], [x["maxrss_kb"] / 1024 for x in got["floor"]],
                    unit="MB", ref_name="floor process peak RSS"),
        ]
        if size == 300:
            rows += [
                compare(GROUP, f"open + first request {label} from a checkpoint / replay",
                        _secs(got["first_warm"], "open", "first_request"), cold_ready, unit="s",
                        ref_name="ours: open + get_messages(), no checkpoint", target="<= 0.1" if key else None,
                        note=warm_note or quick_note or "the session as the store leaves it: with its checkpoint"),
                compare(GROUP, f"open + first request {label}, no checkpoint / replay",
                        _secs(got["first_cold"], "open", "first_request"), cold_ready, unit="s",
                        ref_name="ours: open + get_messages(), no checkpoint",
                        note="checkpoint deleted first: the whole log is read once"),
            ]
        rows += [
            compare(GROUP, f"resume {label}: reference module / ours (no checkpoint)", _secs(got["cold"], "open"),
                    _secs(got["ref"], "seconds"), unit="s", invert=True,
                    ref_name="reference: stdlib json re-read of context-messages.jsonl"),
            compare(GROUP, f"resume {label}: sqlite3 read-back / ours (no checkpoint)", _secs(got["cold"], "open"),
                    _secs(got["sqlite"], "seconds"), unit="s", invert=True,
                    ref_name="sqlite3 SELECT all rows + orjson.loads"),
        ]
    return rows
