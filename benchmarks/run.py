"""Run the benchmark plug-ins, print one table, write the JSON file.

``python -m benchmarks.run [--quick] [--json PATH] [--only append,replay] [--size key=value ...] [--rounds N]``

Exit status: 0 when every plug-in ran (targets missed or not: the table says which), 1 when a plug-in
failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ._harness import Ctx, Row, Skip, machine, row_dict


def plugins() -> list[str]:
    """The ``bench_*`` module names in this package, in name order."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if m.name.startswith("bench_"))


def _parse_size(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--size takes key=value (an integer), got {text!r}")
    try:
        return key, int(value.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size {key}: {value!r} is not an integer") from None


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None or x != x:
        return "-"
    if unit in ("ev/s", "msg/s", "tok/s"):
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def table(rows: list[Row]) -> str:
    """The results as one fixed-width text table."""
    head = ("group", "measurement", "ours", "reference", "unit", "ratio", "target", "ok", "spread", "reference is")
    body = []
    for r in rows:
        ok = "-" if r.ok is None else ("yes" if r.ok else "MISS")
        spread = "-" if r.spread is None else f"{r.spread * 100:.0f}%"
        ratio = "-" if r.ratio != r.ratio else (f"{r.ratio:.3g}" if r.ratio < 1000 else f"{r.ratio:,.0f}")
        body.append((r.group, r.name, _fmt(r.ours, r.unit), _fmt(r.ref, r.unit), r.unit, ratio, r.target or "",
                     ok, spread, r.ref_name))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, fewer rounds (under a minute)")
    p.add_argument("--json", default="bench-results.json", metavar="PATH", help="where to write the results")
    p.add_argument("--only", default="", help="comma-separated plug-in names (e.g. append,replay)")
    p.add_argument("--size", action="append", type=_parse_size, default=[], metavar="KEY=N",
                   help="override a workload size (keys are listed in the JSON output)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measurement (default 3 quick, 5 full)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    names = plugins()
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if f"bench_{w}" not in names]
        if unknown:
            p.error(f"unknown plug-in(s) {', '.join(unknown)}; available: "
                    f"{', '.join(n.removeprefix('bench_') for n in names)}")
        names = [n for n in names if n.removeprefix("bench_") in wanted]

    ctx = Ctx(quick=args.quick, overrides=dict(args.size), rounds_override=args.rounds, verbose=not args.quiet)
    started = time.time()
    rows: list[Row] = []
    status: dict[str, Any] = {}
    before = machine()
    try:
        for name in names:
            t = time.perf_counter()
            print(f"[{name}]", file=sys.stderr, flush=True)
            try:
                mod = importlib.import_module(f"{__package__}.{name}")
                got = mod.run(ctx)
                rows += got
                status[name] = {"status": "ok", "rows": len(got)}
            except Skip as e:
                status[name] = {"status": "skipped", "reason": str(e)}
                print(f"  skipped: {e}", file=sys.stderr)
            except Exception as e:
                status[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
            status[name]["seconds"] = round(time.perf_counter() - t, 2)
    finally:
        ctx.cleanup()
    elapsed = time.time() - started
    print(table(rows))
    for name, st in status.items():
        if st["status"] != "ok":
            print(f"{name}: {st['status']}: {st.get('reason') or st.get('error')}")
    missed = [r.name for r in rows if r.ok is False]
    print(f"{len(rows)} rows in {elapsed:.0f} s; targets met {sum(r.ok is True for r in rows)}"
          f"/{sum(r.ok is not None for r in rows)}" + (f"; missed: {'; '.join(missed)}" if missed else ""))
    result = {
        "quick": args.quick, "started": started, "elapsed_s": round(elapsed, 1), "rounds": ctx.rounds,
        "sizes": ctx.sizes(), "machine": before, "loadavg_after": list(os.getloadavg()),
        "plugins": status, "rows": [row_dict(r) for r in rows],
    }
    Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.json}")
    return 1 if any(st["status"] == "failed" for st in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
