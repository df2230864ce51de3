"""Start-up: ``import context_persistent`` against importing our four dependencies, each in a fresh interpreter.

Rounds alternate ours and the floor so they share the machine's noise. Also checked: no tokenizer
encoding is loaded by the import (it loads on the first count), and what that first load costs.
"""

from __future__ import annotations

from ._harness import CHILD_REPORT, Ctx, Row, compare, info, median, run_child

GROUP = "import"

OURS = """
import sys, time
t = time.perf_counter()
import context_persistent
result = {"seconds": time.perf_counter() - t}
reg = sys.modules.get("tiktoken.registry")
tok = sys.modules.get("context_persistent.model.tokens")
result["encodings_loaded"] = ((len(getattr(reg, "ENCODINGS", {})) if reg else 0)
                              + (len(tok.TokenCounter._cache) if tok else 0))
""" + CHILD_REPORT

FLOOR = """
import time
t = time.perf_counter()
import orjson, tiktoken, aiofiles, watchfiles
result = {"seconds": time.perf_counter() - t}
""" + CHILD_REPORT

ENCODING = """
import time, tiktoken
from context_persistent.model.tokens import TokenCounter
t = time.perf_counter()
TokenCounter().count_text("")  # loads the default encoding from its bundled file
result = {"seconds": time.perf_counter() - t}
""" + CHILD_REPORT


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"import_rounds": 5}, full={"import_rounds": 15})
    ours, floor, enc = [], [], []
    loaded = 0
    rounds = ctx.size("import_rounds")
    for r in range(rounds):
        if r % 5 == 0:
            ctx.log(f"import round {r + 1}/{rounds}")
        o = run_child(OURS)
        ours.append(o["seconds"] * 1000)
        loaded = max(loaded, o["encodings_loaded"])
        floor.append(run_child(FLOOR)["seconds"] * 1000)
    for _ in range(min(3, rounds)):
        enc.append(run_child(ENCODING)["seconds"] * 1000)
    return [
        compare(GROUP, "import context_persistent", ours, floor, unit="ms",
                ref_name="floor: import orjson, tiktoken, aiofiles, watchfiles", target="<= 1.5"),
        Row(group=GROUP, name="tokenizer encodings loaded by the import", ours=loaded, ref=0, unit="count",
            ref_name="lazy: none until the first count", ratio=loaded, target="<= 0", ok=loaded == 0),
        info(GROUP, "first tokenizer load (once per process, on first count)", median(enc), "ms", samples=enc),
    ]
