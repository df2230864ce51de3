"""The secret scanner (``secret_scanner``): what it adds to an append, off and on.

``add_message`` with ``fsync="never"`` (no disk sync: the scanner's CPU cost is what is left) for messages
without secrets (the common case) of 300 B and 4 KB, with the scanner off, on with the built-in patterns
(a prefix search of the JSON, then nothing) and on with one extra pattern (every string matched against every
pattern), and for a 4 KB message holding an AWS key (found, redacted, recorded). Each against the scanner off;
then a durable append (``fsync="always"``, what an agent waits for) of 4 KB with the built-in patterns.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._harness import Ctx, Row, compare, percentile
from .bench_append import add_latencies
from .workloads import sized_message

GROUP = "secrets"

EXTRA = [{"name": "ticket", "pattern": r"\bTCK-[0-9]{8}\b"}]


def _with_secret(size: int) -> dict[str, Any]:
    msg = sized_message(size)
    msg["content"] = "deploy with AKIAIOSFODNN7EXAMPLE " + msg["content"][40:]
    return msg


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"secrets_n": 2000}, full={"secrets_n": 10_000})
    n = ctx.size("secrets_n")
    rows: list[Row] = []
    cases = [("300 B, no secret, builtin", sized_message(300), "builtin"),
             ("4 KB, no secret, builtin", sized_message(4096), "builtin"),
             ("4 KB, no secret, builtin + 1 pattern", sized_message(4096), EXTRA),
             ("4 KB holding an AWS key, builtin", _with_secret(4096), "builtin")]
    for name, msg, scanner in cases:
        on, off = [], []
        for r in range(ctx.rounds):
            ctx.log(f"secrets {name} round {r + 1}/{ctx.rounds}")
            off.append(percentile(asyncio.run(add_latencies(ctx.tempdir("off"), msg, n, fsync="never")), 50))
            on.append(percentile(asyncio.run(add_latencies(ctx.tempdir("on"), msg, n, fsync="never",
                                                           secret_scanner=scanner)), 50))
        rows.append(compare(GROUP, f"add_message fsync=never p50: {name}", on, off, unit="µs",
                            ref_name="the same with secret_scanner off"))
    msg = sized_message(4096)  # what an agent sees: a durable append, with and without the scanner
    on, off = [], []
    for r in range(ctx.rounds):
        ctx.log(f"secrets fsync=always round {r + 1}/{ctx.rounds}")
        off.append(percentile(asyncio.run(add_latencies(ctx.tempdir("off"), msg, n // 10, fsync="always")), 50))
        on.append(percentile(asyncio.run(add_latencies(ctx.tempdir("on"), msg, n // 10, fsync="always",
                                                       secret_scanner="builtin")), 50))
    rows.append(compare(GROUP, "add_message fsync=always p50: 4 KB, no secret, builtin", on, off, unit="µs",
                        ref_name="the same with secret_scanner off"))
    return rows
