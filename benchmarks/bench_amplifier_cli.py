"""One turn through the real Amplifier CLI on a long session: what our store adds, against a floor.

The CLI (amplifier-app-cli, foundation, loop-basic, core 2.0.2 from the host archives, see
tests/realhost.py) is installed into its own environment under the scratch folder. For each size (1k, 10k,
100k messages of 300 B) a session is started with ``amplifier run``, its history is grown to the size (our
log through the package's API, the CLI's transcript.jsonl alike), then ``amplifier run --resume <id>
"<prompt>"`` is timed, each round a new process. The context module is wrapped by ``context-timed``
(tests/amplifier_host/modules), which adds up the seconds spent inside the module: mount (our store opens
and loads its log there), every method the CLI and the orchestrator call, and cleanup.

The floor is ``context-memory``: a list in memory with the same five methods and the system prompt
factory, no file, no counting, no compaction. Its process time is what the CLI costs by itself (it reads
the whole transcript on resume and rewrites it after the turn); the reference module context-simple is not
on the package index nor in the archives, so it cannot be installed here and is not measured.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import Ctx, Row, Skip, compare, info, median
from .workloads import sized_messages

GROUP = "amplifier-cli"
ROOT = Path(__file__).resolve().parent.parent
SIZES = (1_000, 10_000, 100_000)
MODULES = {"ours": "context-persistent", "floor": "context-memory"}


def _bundle(cli: Any, module: str) -> str:
    inner = f"      inner_config:\n        storage_path: {cli.storage}\n        fsync: always\n" \
        if module == "context-persistent" else ""
    host = cli.host
    return (
        "---\nbundle:\n  name: cp-bench\n  version: 0.1.0\n"
        "session:\n  orchestrator:\n    module: loop-basic\n"
        f"  context:\n    module: context-timed\n    source: {host.modules / 'context-timed'}\n"
        f"    config:\n      inner: {module}\n{inner}"
        f"providers:\n  - module: provider-scripted\n    source: {host.modules / 'provider-scripted'}\n"
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


def _session(ctx: Ctx, host: Any, realhost: Any, module: str, n: int) -> tuple[Any, str]:
    """A CLI session of ``module`` whose history has ``n`` messages after the first turn."""
    cli = realhost.Cli(host, ctx.tempdir(f"{module}-{n}"))
    cli.bundle.write_text(_bundle(cli, module))
    cli.env["CP_BENCH_TIMING"] = str(cli.root / "timing.jsonl")
    sid = realhost.session_id_of(cli.run("run", "-B", cli.bundle_uri, "start").stdout)
    history = sized_messages(n, 300)
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


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"cli_max_messages": 10_000, "cli_rounds": 2},
                 full={"cli_max_messages": 100_000, "cli_rounds": 3})
    sys.path.insert(0, str(ROOT / "tests"))
    import realhost

    try:
        realhost.find_archives(realhost.host_dir())
    except realhost.HostUnavailable as e:
        raise Skip(str(e)) from None
    ctx.log("installing the Amplifier CLI into its own environment")
    assert ctx.scratch is not None
    host = realhost.build_host(ctx.tempdir("amplifier-host"))
    rows: list[Row] = [info(GROUP, "installing the CLI and the package (pip, cached wheels)",
                            host.install_seconds, "s")]
    rounds = ctx.size("cli_rounds")
    for n in [s for s in SIZES if s <= ctx.size("cli_max_messages")]:
        walls: dict[str, list[float]] = {k: [] for k in MODULES}
        inside: dict[str, list[float]] = {k: [] for k in MODULES}
        methods: dict[str, list[float]] = {}
        calls: dict[str, int] = {}
        sessions = {}
        for key, module in MODULES.items():
            ctx.log(f"{module}: a session of {n:,} messages")
            sessions[key] = _session(ctx, host, realhost, module, n)
        for r in range(rounds):
            for key in MODULES:  # alternate, so both share the machine's noise
                ctx.log(f"{n:,} messages, round {r + 1}/{rounds}: {MODULES[key]}")
                cli, sid = sessions[key]
                wall, totals = _turn(cli, sid, f"turn {r}")
                walls[key].append(wall)
                inside[key].append(sum(t for _, t in totals.values()))
                if key == "ours":
                    for name, (count, t) in totals.items():
                        methods.setdefault(name, []).append(t * 1000)
                        calls[name] = int(count)
        rows.append(compare(GROUP, f"{n:,} msgs: one resumed turn, whole CLI process", walls["ours"],
                            walls["floor"], unit="s", ref_name="same CLI, in-memory list context"))
        rows.append(compare(GROUP, f"{n:,} msgs: time inside the context module", inside["ours"],
                            inside["floor"], unit="s", ref_name="in-memory list context",
                            note="mount (open + load) + every method call + cleanup"))
        rows.append(info(GROUP, f"{n:,} msgs: our share of the turn (inside / whole process)",
                         median([i / w for i, w in zip(inside["ours"], walls["ours"])]) * 100, "%"))
        for name in sorted(methods, key=lambda k: -median(methods[k])):
            rows.append(info(GROUP, f"{n:,} msgs: ours, {name} ({calls[name]} calls)", median(methods[name]),
                             "ms", samples=methods[name]))
    return rows
