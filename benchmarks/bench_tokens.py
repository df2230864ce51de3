"""Token accounting over a session against raw tiktoken ``encode_ordinary`` of the same message texts.

The workload is the realistic agent mix (system prompt, user turns, assistant tool calls, tool results up
to 64 KB). Floor: ``len(enc.encode_ordinary(text))`` for each message's text, the texts prepared
beforehand. Ours: ``get_token_count()`` on a store holding those messages, the first call (every message
tokenised once) and a repeated call (cached). The encoding is loaded before either is timed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager
from context_persistent.model.tokens import DEFAULT_ENCODING, TokenCounter, message_text

from ._harness import Ctx, Row, compare, info, median
from .workloads import agent_mix, write_session

GROUP = "tokens"


async def _ours(storage: Path) -> tuple[float, float, int]:
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", fsync="never")
    try:
        t = time.perf_counter()
        total = await store.get_token_count()
        first = time.perf_counter() - t
        t = time.perf_counter()
        await store.get_token_count()
        again = time.perf_counter() - t
        return first, again, total
    finally:
        await store.close()


def _floor(enc: Any, texts: list[str]) -> tuple[float, int]:
    encode = enc.encode_ordinary
    t = time.perf_counter()
    total = 0
    for text in texts:
        total += len(encode(text))
    return time.perf_counter() - t, total


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"tokens_messages": 400}, full={"tokens_messages": 3000})
    msgs = agent_mix(ctx.size("tokens_messages"))
    texts = [message_text(m) for m in msgs]
    TokenCounter().count_text("")  # load the encoding once: every counter in this process shares it
    enc = TokenCounter._cache[DEFAULT_ENCODING]
    folder = ctx.tempdir("tokens")
    ours, again, floor = [], [], []
    totals: tuple[int, int] = (0, 0)
    for r in range(ctx.rounds):
        ctx.log(f"tokens {len(msgs):,} agent-mix messages round {r + 1}/{ctx.rounds}")
        storage = folder / f"store-{r}"
        write_session(storage, "s", msgs)
        first, second, ours_total = asyncio.run(_ours(storage))
        floor_s, floor_total = _floor(enc, texts)
        ours.append(first)
        again.append(second)
        floor.append(floor_s)
        totals = (ours_total, floor_total)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    return [
        compare(GROUP, f"token count, {len(msgs):,} agent-mix messages ({mb:.1f} MB), first call", ours, floor,
                unit="s", ref_name="floor: encode_ordinary of the same texts", target="<= 1.1",
                note=f"ours {totals[0]:,} tokens incl. per-message overhead; raw {totals[1]:,}"),
        info(GROUP, "token count again (cached per message)", median(again) * 1000, "ms", samples=again),
        info(GROUP, "tokenizer throughput (ours, first call)", totals[0] / median(ours), "tok/s"),
    ]
