"""One turn through the real Amplifier CLI on a long session: ours against context-simple, side by side.

The CLI (amplifier-app-cli, foundation, loop-basic, core 2.0.2 from the host archives, see tests/realhost.py)
and context-simple, the in-memory context module foundation's bundles mount by default (its archive is in
the same folder), are installed into their own environment under the scratch folder. For each size (1k, 10k,
100k messages of 40 B and of 300 B) a session of each module is started with ``amplifier run``, its history
grown to the size (our log through the package's API; the CLI's transcript.jsonl alike, which is what
context-simple resumes from), then ``amplifier run --resume <id> "<prompt>"`` is timed, each round a new
process, the rounds alternating between the two modules so both share the machine's noise. The context module
is wrapped by ``context-timed`` (tests/amplifier_host/modules), which adds up the seconds spent inside the
module: mount (our store opens there), every method the CLI and the orchestrator call, and cleanup.

Without compaction (the scripted provider reports a context window larger than the history, and both modules
take their budget from it) for every size; with compaction (the provider's 200k window: both compact) at 10k
messages of 300 B, where context-simple's compaction is what costs.

Before the timed rounds each session runs one untimed resumed turn: the session as a CLI user has it, which
the CLI has resumed before (ours then has the checkpoint its previous turn left; context-simple keeps nothing
between processes, so its warm-up turn is skipped where it would only compact for minutes).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import Ctx, Row, Skip, compare, info, median
from .workloads import sized_messages

GROUP = "amplifier-cli"
ROOT = Path(__file__).resolve().parent.parent
SIZES = (1_000, 10_000, 100_000)
BYTES = (40, 300)
MODULES = {"ours": "context-persistent", "simple": "context-simple"}
#: The provider's context window for turns without compaction: larger than any history measured.
NO_COMPACTION_WINDOW = 1_000_000_000


def _bundle(cli: Any, module: str, window: int) -> str:
    inner = f"      inner_config:\n        storage_path: {cli.storage}\n        fsync: always\n" \
        if module == "context-persistent" else ""
    host = cli.host
    return (
        "---\nbundle:\n  name: cp-bench\n  version: 0.1.0\n"
        "session:\n  orchestrator:\n    module: loop-basic\n"
        f"  context:\n    module: context-timed\n    source: {host.modules / 'context-timed'}\n"
        f"    config:\n      inner: {module}\n{inner}"
        f"providers:\n  - module: provider-scripted\n    source: {host.modules / 'provider-scripted'}\n"
        f"    config:\n      context_window: {window}\n"
        f"hooks:\n  - module: hooks-session-dir\n    source: {host.modules / 'hooks-session-dir'}\n"
        f"tools:\n  - module: tool-echo\n    source: {host.modules / 'tool-echo'}\n"
        "---\nYou are the benchmark agent.\n"
    )


async def _grow_log(storage: Path, session_id: str, messages: list[dict[str, Any]]) -> None:
    from context_persistent import PersistentContextManager
    store = await PersistentContextManager.open(storage_path=storage, session_id=session_id, fsync="never")
    try:
        for m in messages:
            await store.add_message(m)
    finally:
        await store.close()


def _session(ctx: Ctx, host: Any, realhost: Any, module: str, n: int, size: int, window: int) -> tuple[Any, str]:
    """A CLI session of ``module`` whose history has ``n`` messages of ``size`` bytes after the first turn."""
    cli = realhost.Cli(host, ctx.tempdir(f"{module}-{n}-{size}-{window}"))
    cli.bundle.write_text(_bundle(cli, module, window))
    (cli.home / ".amplifier" / "settings.yaml").write_text(
        "config:\n  providers:\n"
        f"    - module: provider-scripted\n      source: {host.modules / 'provider-scripted'}\n"
        f"      config:\n        context_window: {window}\n")
    cli.env["CP_BENCH_TIMING"] = str(cli.root / "timing.jsonl")
    sid = realhost.session_id_of(cli.run("run", "-B", cli.bundle_uri, "start").stdout)
    history = sized_messages(n, size)
    if module == "context-persistent":
        asyncio.run(_grow_log(cli.storage, sid, history))
    transcript = cli.sessions_dir() / sid / "transcript.jsonl"
    with transcript.open("a", encoding="utf-8") as f:
        for m in history:
            f.write(json.dumps(m, ensure_ascii=False) + "\n")
    return cli, sid


def _turn(cli: Any, sid: str, prompt: str) -> tuple[float, dict[str, list[float]]]:
    """One resumed turn: the process's wall time and the module's per-method totals."""
    timing = Path(cli.env["CP_BENCH_TIMING"])
    timing.unlink(missing_ok=True)
    t = time.perf_counter()
    cli.run("run", "--resume", sid, prompt, timeout=900)
    wall = time.perf_counter() - t
    # the kernel's validator also mounts the module, with its own test session: only the real one counts
    lines = [json.loads(line) for line in timing.read_text().splitlines()]
    mine = [line for line in lines if line["session_id"] == sid]
    if len(mine) != 1:
        raise RuntimeError(f"expected one timing line for session {sid}, got {lines}")
    return wall, mine[0]["totals"]


def ratio_interval(ours: list[float], ref: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the median per-round ratio ``ours/ref`` (rounds drawn with replacement, a fixed
    seed): where the median would fall in other runs of as many rounds on the same machine."""
    ratios = [o / r for o, r in zip(ours, ref)]
    rng = random.Random(23)
    meds = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    tail = (1 - level) / 2
    return meds[int(tail * draws)], meds[min(draws - 1, int((1 - tail) * draws))]


def _scenarios(ctx: Ctx) -> list[tuple[int, int, int, str]]:
    """(messages, bytes each, provider window, label) of the run."""
    out = [(n, b, NO_COMPACTION_WINDOW, f"{n:,} x {b} B, no compaction")
           for n in SIZES if n <= ctx.size("cli_max_messages") for b in BYTES]
    if ctx.size("cli_compaction"):
        out.append((10_000, 300, 200_000, "10,000 x 300 B, both compact"))
    return out


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"cli_max_messages": 10_000, "cli_rounds": 2, "cli_rounds_small": 6, "cli_compaction": 1},
                 full={"cli_max_messages": 100_000, "cli_rounds": 9, "cli_rounds_small": 16, "cli_compaction": 1})
    sys.path.insert(0, str(ROOT / "tests"))
    import realhost

    try:
        realhost.find_archives(realhost.host_dir(), realhost.ARCHIVES + ("amplifier-module-context-simple",))
    except realhost.HostUnavailable as e:
        raise Skip(str(e)) from None
    ctx.log("installing the Amplifier CLI and context-simple into their own environment")
    assert ctx.scratch is not None
    host = realhost.build_host(ctx.tempdir("amplifier-host"), more_archives=("amplifier-module-context-simple",))
    rows: list[Row] = [info(GROUP, "installing the CLI and the package (pip, cached wheels)",
                            host.install_seconds, "s")]
    # A CLI process of a small session takes about a second and moves by 10-40 % from one to the next (the
    # CLI's own start-up): a ratio of medians at the 1.1 target needs more rounds there than at 100k.
    small_rounds = max(ctx.size("cli_rounds"), ctx.size("cli_rounds_small"))
    for n, size, window, label in _scenarios(ctx):
        walls: dict[str, list[float]] = {k: [] for k in MODULES}
        inside: dict[str, list[float]] = {k: [] for k in MODULES}
        methods: dict[str, list[float]] = {}
        calls: dict[str, int] = {}
        sessions = {}
        for key, module in MODULES.items():
            ctx.log(f"{module}: a session of {label}")
            sessions[key] = _session(ctx, host, realhost, module, n, size, window)
        for key in MODULES:  # one untimed turn each: a session the CLI has run before
            if key == "ours" or window == NO_COMPACTION_WINDOW:
                ctx.log(f"{label}, warm-up turn: {MODULES[key]}")
                _turn(*sessions[key], "warm-up")
        rounds = small_rounds if n <= 10_000 and window == NO_COMPACTION_WINDOW else ctx.size("cli_rounds")
        for r in range(rounds):
            # alternate, so both share the machine's noise, each going first every other round
            for key in (list(MODULES) if r % 2 == 0 else list(MODULES)[::-1]):
                ctx.log(f"{label}, round {r + 1}/{rounds}: {MODULES[key]}")
                cli, sid = sessions[key]
                wall, totals = _turn(cli, sid, f"turn {r}")
                walls[key].append(wall)
                inside[key].append(sum(t for _, t in totals.values()))
                if key == "ours":
                    for name, (count, t) in totals.items():
                        methods.setdefault(name, []).append(t * 1000)
                        calls[name] = int(count)
        low, high = ratio_interval(walls["ours"], walls["simple"])
        rows.append(compare(GROUP, f"{label}: one resumed turn, whole CLI process", walls["ours"],
                            walls["simple"], unit="s", ref_name="same CLI, context-simple",
                            target="<= 1.1" if window == NO_COMPACTION_WINDOW else "<= 0.1",
                            note=f"90 % bootstrap interval of the median ratio: {low:.2f}-{high:.2f}",
                            extra={"ratio_interval_90": [round(low, 4), round(high, 4)]}))
        rows.append(info(GROUP, f"{label}: time inside the module, ours", median(inside["ours"]) * 1000, "ms",
                         samples=[t * 1000 for t in inside["ours"]],
                         note="mount (open + load) + every method call + cleanup"))
        rows.append(info(GROUP, f"{label}: time inside the module, context-simple",
                         median(inside["simple"]) * 1000, "ms", samples=[t * 1000 for t in inside["simple"]]))
        for name in sorted(methods, key=lambda k: -median(methods[k])):
            rows.append(info(GROUP, f"{label}: ours, {name} ({calls[name]} calls)", median(methods[name]),
                             "ms", samples=methods[name]))
    return rows
