"""Retention: what ``apply_on_open`` adds to an open, and what moving a session to the trash costs.

A storage of N small sessions (a few messages each). Ours: open + close of one session with
``retention={"max_age_days": 3650, "apply_on_open": True}`` (nothing expires: the cost is reading the ledger,
listing the sessions, reading each one's last record and probing its lock). Reference: the same open + close
without retention. Then ``apply_file`` moving every other session to the trash (per session: hashing its log,
one ledger record with its fsync, one rename).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ._harness import Ctx, Row, compare, info, median

GROUP = "retention"


async def _populate(root: Path, n: int) -> None:
    from context_persistent import PersistentContextManager
    for i in range(n):
        store = await PersistentContextManager.open(storage_path=root, session_id=f"s{i:05d}", fsync="never")
        for j in range(4):
            await store.add_message({"role": "user" if j % 2 else "assistant", "content": f"message {j} " * 20})
        await store.close()


async def _open_close(root: Path, retention: dict[str, object] | None) -> float:
    from context_persistent import PersistentContextManager
    extra = {"retention": retention} if retention else {}
    t = time.perf_counter()
    store = await PersistentContextManager.open(storage_path=root, session_id="s00000", **extra)
    await store.close()
    return time.perf_counter() - t


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"retention_sessions": 200}, full={"retention_sessions": 2000})
    n = ctx.size("retention_sessions")
    root = ctx.tempdir("retention") / "store"
    ctx.log(f"writing {n} sessions")
    asyncio.run(_populate(root, n))
    policy = {"max_age_days": 3650, "apply_on_open": True}
    ours, ref = [], []
    for _ in range(ctx.rounds):
        ref.append(asyncio.run(_open_close(root, None)) * 1000)
        ours.append(asyncio.run(_open_close(root, policy)) * 1000)
    from context_persistent.model.retention import RetentionPolicy
    from context_persistent.operations.trash import apply_file

    t = time.perf_counter()
    report = asyncio.run(apply_file(root, RetentionPolicy(max_sessions=n // 2)))
    per = (time.perf_counter() - t) / max(1, len(report["trashed"])) * 1000
    return [
        compare(GROUP, f"open + close with apply_on_open, {n:,} sessions, nothing expires", ours, ref, unit="ms",
                ref_name="open + close without retention"),
        info(GROUP, f"apply_on_open overhead per session in the storage ({n:,})",
             (median(ours) - median(ref)) / n * 1000, "µs"),
        info(GROUP, f"retention apply: per session moved to the trash ({len(report['trashed']):,} moved)", per, "ms"),
    ]
