"""The resume rule's cost: classifying the host's ``set_messages`` on a loaded store (resume.classify).

On every resume the Amplifier CLI hands its saved transcript to ``set_messages``; the store decides whether it
is a filtered transcript of the history (ignored) by comparing it with the history, message by message, in the
CLI's normal form where the two differ. Workload: a system prompt and user/assistant turns whose assistant
messages carry a ``None`` field (as loop-basic's content blocks do), so every assistant message needs the
normal-form comparison (the worst case); and the same with a transcript equal to the history. Info rows only:
there is no reference implementation to compare with (the reference module accepts the transcript as is).
"""

from __future__ import annotations

import time
from typing import Any

from context_persistent.model.replay import normalise
from context_persistent.model.resume import FILTERED, classify

from ._harness import Ctx, Row, info, median

GROUP = "resume"


def _history(n: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."}]
    for i in range(n // 2):
        history.append({"role": "user", "content": f"question {i} " + "q" * 200})
        history.append({"role": "assistant",
                        "content": [{"type": "text", "text": f"answer {i} " + "a" * 200, "visibility": None}]})
    return history


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"resume_messages": 2_000}, full={"resume_messages": 100_000})
    n = ctx.size("resume_messages")
    history = _history(n)
    equal = [m for m in history if m["role"] != "system"]
    saved = [normalise(m) for m in equal]
    rows = []
    for name, transcript in (("in the CLI's normal form", saved), ("equal to the history", equal)):
        times = []
        for r in range(ctx.rounds):
            ctx.log(f"resume rule, {n:,} messages, transcript {name}, round {r + 1}/{ctx.rounds}")
            t = time.perf_counter()
            kind, _ = classify(history, transcript)
            times.append(time.perf_counter() - t)
            assert kind == FILTERED
        rows.append(info(GROUP, f"classify the host's transcript ({name}), {n:,} messages", median(times) * 1000,
                         "ms", samples=times))
    return rows
