"""What a durable append costs on this disk, five ways: the measurements behind the log's reserved tail.

``python -m benchmarks.sync_probe [--n 2000] [--rounds 3]``: for 340-byte and 4 KB records, the median time of
one write + ``fdatasync`` per record, written

- ``append``: ``os.write`` to an ``O_APPEND`` file (the floor of ``make bench``; the file grows each time);
- ``o_dsync``: the same with ``O_DSYNC`` and no separate ``fdatasync``;
- ``keep_size``: ``fallocate(FALLOC_FL_KEEP_SIZE)`` ahead, then appends (space allocated, size still grows);
- ``fallocate``: ``posix_fallocate`` ahead (the size covers it), then ``pwrite`` at the data end;
- ``zeros``: zeros written ahead, then ``pwrite`` over them (what the log does with ``fsync="always"``).

Not part of ``make bench`` (no reference to the package, nothing to compare side by side); the figures it
printed are in docs/performance.md. Runs in a scratch folder on the same device as the benchmarks.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._harness import scratch_parent

AHEAD = 8 << 20  # space prepared ahead: more than any run writes, so no extension falls inside the timing
FALLOC_FL_KEEP_SIZE = 1


def _timed(fd: int, n: int, step: Callable[[int], None]) -> float:
    """Median microseconds of ``step(i)`` over ``n`` calls (after 10 warm-up calls)."""
    for i in range(10):
        step(i)
    pc = time.perf_counter_ns
    out = []
    for i in range(10, n + 10):
        t = pc()
        step(i)
        out.append(pc() - t)
    return statistics.median(out) / 1000


def probe(folder: Path, record: bytes, n: int) -> dict[str, float]:
    size = len(record)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    results = {}

    def appending(name: str, flags: int, prepare: Callable[[int], None] | None, sync: bool) -> None:
        fd = os.open(folder / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | flags, 0o600)
        try:
            if prepare:
                prepare(fd)

            def step(_: int) -> None:
                os.write(fd, record)
                if sync:
                    os.fdatasync(fd)
            results[name] = _timed(fd, n, step)
        finally:
            os.close(fd)

    def overwriting(name: str, prepare: Callable[[int], None]) -> None:
        fd = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            prepare(fd)
            os.fsync(fd)

            def step(i: int) -> None:
                os.pwrite(fd, record, i * size)
                os.fdatasync(fd)
            results[name] = _timed(fd, n, step)
        finally:
            os.close(fd)

    def keep_size(fd: int) -> None:
        if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(AHEAD)) != 0:
            raise OSError(ctypes.get_errno(), "fallocate(FALLOC_FL_KEEP_SIZE)")
        os.fsync(fd)

    appending("append", 0, None, True)
    appending("o_dsync", os.O_DSYNC, None, False)
    try:
        appending("keep_size", 0, keep_size, True)
    except OSError as e:
        print(f"  keep_size: not supported here ({e})")
    try:
        overwriting("fallocate", lambda fd: os.posix_fallocate(fd, 0, AHEAD))
    except OSError as e:
        print(f"  fallocate: not supported here ({e})")
    overwriting("zeros", lambda fd: os.pwrite(fd, bytes(AHEAD), 0))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sync_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="appends per measurement")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.n < 1 or args.rounds < 1 or args.n * 4096 > AHEAD:
        p.error(f"--n must be 1..{AHEAD // 4096} and --rounds at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="cp-sync-probe-", dir=scratch_parent()))
    try:
        for size in (340, 4096):
            record = b"x" * (size - 1) + b"\n"
            rows: dict[str, list[float]] = {}
            for r in range(args.rounds):
                folder = scratch / f"{size}-{r}"
                folder.mkdir()
                for name, us in probe(folder, record, args.n).items():
                    rows.setdefault(name, []).append(us)
            base = statistics.median(rows["append"])
            print(f"{size}-byte records, median µs per durable append over {args.rounds} rounds of {args.n}:")
            for name, values in rows.items():
                med = statistics.median(values)
                print(f"  {name:10} {med:8.1f} µs  {med / base:5.2f}x append   rounds: "
                      + ", ".join(f"{v:.0f}" for v in values))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
