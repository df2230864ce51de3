"""Segmented logs: the cost of sealing (a roll), of compressing a sealed segment, and of reading one record by
position from a plain and from a compressed sealed segment.

Each round runs in a fresh interpreter on its own copy of a session whose active segment holds
``segments_mb`` MiB (written with ``segment_bytes: 0``, so nothing rolled yet). References (floors):

- a roll of an active segment that held data when the writer opened it, before the writer's background hash
  has read it (the worst case: the seal reads it once, checking every record and hashing it): the floor is
  reading the same file and hashing it with SHA-256;
- the append that fills a segment the writer wrote itself and rolls it (the writer keeps a running SHA-256,
  so nothing is read back; with ``compress_sealed`` the compression runs in a worker thread): this is how long
  that append holds the event loop, against the median append of the same run;
- a compression reads, compresses and checks the segment: the floor is one ``zstandard`` compression of the
  same bytes at the same level, in one piece;
- a random read of one record: the floor is one ``os.pread`` of the same bytes from the plain file;
- opening a reader on a log of ``READER_SEGMENTS`` sealed segments (a reader opens every file its manifest
  lists, so that an erasure or expiry meanwhile changes nothing it reads): the floor is opening and closing
  each of those files once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ._harness import Ctx, Row, compare, run_child
from .workloads import sized_messages, write_session

GROUP = "segments"

ROLL = """
import asyncio, hashlib, json, os, sys, time
from context_persistent import PersistentContextManager
storage, compress = sys.argv[1], sys.argv[2] == "1"

async def main():
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                segment_bytes=0, compress_sealed=compress)
    try:
        path = store._log.path
        t = time.perf_counter()
        with open(path, "rb") as f:
            hashlib.sha256(f.read()).hexdigest()
        floor = time.perf_counter() - t
        size = store._log.size
        t = time.perf_counter()
        store._log.roll()
        took = time.perf_counter() - t
        store._log._wait_compressing()  # (the compression, in a worker thread)
        total = time.perf_counter() - t
        return {"roll": took, "total": total, "floor": floor, "bytes": size}
    finally:
        await store.close()

print(json.dumps(asyncio.run(main())))
"""

ROLL_APPEND = """
import asyncio, json, statistics, sys, time
from context_persistent import PersistentContextManager
storage, mb, compress = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"

async def main():
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never",
                                                segment_bytes=mb * 1024 * 1024, compress_sealed=compress)
    try:
        times, i = [], 0
        while True:
            body = "m%d " % i + "y" * 1000
            t = time.perf_counter()
            await store.add_message({"role": "user", "content": body})
            took = time.perf_counter() - t
            if store._log.base:
                return {"rolling": took, "median": statistics.median(times)}
            times.append(took)
            i += 1
    finally:
        await store.close()

print(json.dumps(asyncio.run(main())))
"""

COMPRESS_FLOOR = """
import json, sys, time
import zstandard
with open(sys.argv[1], "rb") as f:
    data = f.read()
t = time.perf_counter()
zstandard.ZstdCompressor(level=3).compress(data)
print(json.dumps({"floor": time.perf_counter() - t}))
"""

READS = """
import json, os, random, sys, time
from context_persistent.storage.segments import LogReader
folder = sys.argv[1]
with LogReader(folder) as reader:
    lines = list(reader.lines(0, reader.base))
    rng = random.Random(7)
    picks = [lines[rng.randrange(len(lines))] for _ in range(2000)]
    seg = reader.segments[0]
    plain = os.path.join(folder, seg.name)
    fd = os.open(plain, os.O_RDONLY) if os.path.exists(plain) else -1
    t = time.perf_counter()
    for pos, line in picks:
        assert reader.read_line_at(pos) == line
    ours = (time.perf_counter() - t) / len(picks)
floor = 0.0
if fd >= 0:
    t = time.perf_counter()
    for pos, line in picks:
        os.pread(fd, len(line), pos)
    floor = (time.perf_counter() - t) / len(picks)
    os.close(fd)
print(json.dumps({"read": ours, "floor": floor}))
"""


#: Sealed segments of the log a reader is opened on (``segment_bytes`` 4096: about 4 KiB each).
READER_SEGMENTS = 512

READER_OPEN = """
import json, os, sys, time
from context_persistent.storage.segments import LogReader
folder = sys.argv[1]
with LogReader(folder) as reader:
    files = [os.path.join(folder, s.file) for s in reader.segments]
times, floors = [], []
for _ in range(20):
    t = time.perf_counter()
    with LogReader(folder) as reader:
        reader.read_line_at(reader.base - len(reader.line_ending_at(reader.base)))
    times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for f in files:
        os.close(os.open(f, os.O_RDONLY))
    floors.append(time.perf_counter() - t)
times.sort()
floors.sort()
print(json.dumps({"open": times[len(times) // 2], "floor": floors[len(floors) // 2], "segments": len(files)}))
"""


def _fresh(ctx: Ctx, template: Path, name: str) -> Path:
    target = ctx.tempdir(name) / "store"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(template, target)
    return target


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"segments_mb": 16}, full={"segments_mb": 64})
    mb = ctx.size("segments_mb")
    if mb <= 0:
        return []
    template = ctx.tempdir(f"segments-{mb}") / "store"
    if not template.exists():
        write_session(template, "s", sized_messages(mb * 1024 * 1024 // 1100, 1000))
    rolls: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    floors_zst: list[float] = []
    reads: dict[bool, dict[str, float]] = {}
    appends: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for compress in (False, True):
        for r in range(ctx.rounds):
            ctx.log(f"segments: the append that rolls {mb} MiB, compress_sealed={compress}, round {r + 1}/{ctx.rounds}")
            appends[compress].append(run_child(ROLL_APPEND, str(ctx.tempdir(f"segments-append-{int(compress)}-{r}")),
                                               str(mb), "1" if compress else "0"))
            ctx.log(f"segments: roll of {mb} MiB, compress_sealed={compress}, round {r + 1}/{ctx.rounds}")
            storage = _fresh(ctx, template, f"segments-roll-{int(compress)}")
            if compress:
                floors_zst.append(run_child(COMPRESS_FLOOR, str(storage / "s" / "events.jsonl"))["floor"])
            rolls[compress].append(run_child(ROLL, str(storage), "1" if compress else "0"))
        reads[compress] = run_child(READS, str(storage / "s"))
    many = ctx.tempdir(f"segments-reader-{READER_SEGMENTS}") / "store"
    if not many.exists():
        from context_persistent.storage.segment_store import migrate

        write_session(many, "s", sized_messages(READER_SEGMENTS * 4, 1000))
        migrate(many / "s", "s", 4096)
    opened = run_child(READER_OPEN, str(many / "s"))
    plain = rolls[False]
    zst = rolls[True]
    return [
        compare(GROUP, f"the append that fills a {mb} MiB segment and rolls it (event loop held)",
                [x["rolling"] * 1000 for x in appends[False]], [x["median"] * 1000 for x in appends[False]],
                unit="ms", ref_name="the median append of the same run (fsync never)"),
        compare(GROUP, f"the append that rolls a {mb} MiB segment, compress_sealed (event loop held)",
                [x["rolling"] * 1000 for x in appends[True]], [x["median"] * 1000 for x in appends[True]],
                unit="ms", ref_name="the median append of the same run (fsync never)",
                note="the compression runs in a worker thread"),
        compare(GROUP, f"roll (seal) of a {mb} MiB active segment opened with data, not yet hashed",
                [x["roll"] * 1000 for x in plain], [x["floor"] * 1000 for x in plain], unit="ms",
                ref_name="floor: read the file and SHA-256 it"),
        compare(GROUP, f"compress a sealed {mb} MiB segment (compress_sealed, worker thread)",
                [(x["total"] - p["roll"]) * 1000 for x, p in zip(zst, plain)], [f * 1000 for f in floors_zst],
                unit="ms", ref_name="floor: one zstd compression (level 3) of the same bytes, in one piece",
                note="compression only: the roll of the plain run subtracted"),
        compare(GROUP, "read_line_at, plain sealed segment, random records", [reads[False]["read"] * 1e6],
                [reads[False]["floor"] * 1e6], unit="µs", ref_name="floor: os.pread of the same bytes"),
        compare(GROUP, "read_line_at, compressed sealed segment (one frame each), random records",
                [reads[True]["read"] * 1e6], [reads[False]["floor"] * 1e6], unit="µs",
                ref_name="floor: os.pread of the same bytes from the plain file"),
        compare(GROUP, f"open a reader on {opened['segments']} sealed segments and read the last record",
                [opened["open"] * 1000], [opened["floor"] * 1000], unit="ms",
                ref_name="floor: open and close each segment file"),
    ]
