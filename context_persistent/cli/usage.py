"""``context-persistent usage``: the tokens and cost providers reported, per session, day or model, across every
session of a storage (or one), on files or PostgreSQL (docs/cli.md, docs/tokens.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

EXAMPLES = """examples:
  context-persistent usage                          every session of the storage, a row per session
  context-persistent usage my-session --by model    one session, a row per model
  context-persistent usage --by day --since 2025-06-01
  context-persistent usage --prices prices.json     price reports that carry no cost (docs/tokens.md, "Prices")
  context-persistent usage --json | jq .total.cost_usd
"""

_COLUMNS = ("reports", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    return "\n".join(lines)


def _cost(row: dict[str, Any]) -> str:
    if row["cost_usd"] is None:
        return "-"
    text = f"${row['cost_usd']:,.4f}"
    return text + (f" (+{row['uncosted']} unpriced)" if row["uncosted"] else "")


def _run(args: argparse.Namespace) -> int:
    from . import backend_of, require_storage
    from ..store.usage_read import read_usage

    backend = backend_of(args)
    storage = "." if backend else require_storage(args)
    result = asyncio.run(read_usage(storage, args.session, since=args.since, by=args.by, prices=args.prices,
                                    **backend))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if not result["rows"]:
        print(f"no usage reported in {result['sessions']} session(s)"
              + (f" since {args.since}" if args.since else ""))
        return 0
    headers = [args.by.upper(), "REPORTS", "INPUT", "OUTPUT", "CACHE READ", "CACHE WRITE", "COST (USD)"]
    rows = [[str(r[args.by]), *(f"{r[c]:,}" for c in _COLUMNS), _cost(r)] for r in result["rows"]]
    rows.append(["total", *(f"{result['total'][c]:,}" for c in _COLUMNS), _cost(result["total"])])
    print(_table(headers, rows))
    total = result["total"]
    print(f"tokens as reported by the providers; cost: {total['cost_reported']} report(s) priced by the provider, "
          f"{total['cost_priced']} by the price table, {total['uncosted']} without a price"
          + ("" if args.prices or not total["uncosted"] else " (give --prices FILE)"))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("usage", parents=[common], help="tokens and cost the providers reported, per session, day "
                       "or model", description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("session", nargs="?", metavar="SESSION", help="one session (default: every session of the storage)")
    p.add_argument("--since", metavar="DATE", help="only reports from this ISO date or time (UTC) on")
    p.add_argument("--by", choices=("session", "day", "model"), default="session", help="one row per "
                   "session (default), day (UTC) or model")
    p.add_argument("--prices", metavar="FILE", help="a JSON price table (USD per million tokens per model) for "
                   "the reports without a cost_usd; the package ships none")
    p.set_defaults(func=_run)
