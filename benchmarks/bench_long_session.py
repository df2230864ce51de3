"""A long session, step by step: time and peak memory of each step at 10k, 100k and 1M messages, with peers.

The data: a realistic agent mix averaging about 4 KB a message (long_data.py; 1M messages is about 4 GB of
log), generated once and cached between runs (``.bench-cache/``, or ``$CP_BENCH_CACHE``), in our log, the
reference module's ``context-messages.jsonl`` and openai-agents ``SQLiteSession``'s database.

Each run first opens and closes the session once (a cold replay of the log, then a request view and a token
count, which count every message once, and the close, which writes the checkpoint the steps then open from, as
after any normal close). Then every step runs in a FRESH interpreter, so
its peak memory is its own; steps that need an open store open it first, untimed:

- open: ``PersistentContextManager.open`` (durable defaults);
- first request: ``get_messages_for_request()`` at the default budget, right after the open;
- compaction: after that first request (untimed), ``compact()`` at half the default budget: the request view
  compacted again over the long history;
- appends: 1,000 ``add_message`` calls of new messages of the same mix (``fsync="always"``);
- checkpoint: a periodic checkpoint (``checkpoint_every=1000``, started by the 1,000th append of the step,
  ``fsync="never"`` for those appends), timed from its start to its end;
- stats: ``stats()``.

Memory is the child's peak RSS (``VmHWM``, read before the store is closed) and its growth over the
interpreter's RSS before the step began (imports done). A child whose RSS passes ``long_rss_cap_mb`` is
stopped (the row then shows the cap and MISS): a step that holds the whole history must not exhaust the
machine. Appends go to hard links of the cached files, cut back to their cached length afterwards
(SQLiteSession's appends go to a copy: SQLite rewrites pages in place).

Targets (docs/performance.md): each step's peak RSS <= 256 MB at every size, and each step's time at
100k and 1M <= 2 x its time at 10k. Peers on the same messages: the reference module's path (open is
nothing; its first request re-reads and parses the whole file; an append opens the file and writes a line)
and SQLiteSession (WAL, ``synchronous=FULL``; first read ``get_items()``, appends ``add_items`` of one item).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import CHILD_PRELUDE, ROOT, Ctx, Row, compare, info, median
from .long_data import SESSION_ID, Dataset

GROUP = "long session"
STEPS = ("open", "first request", "compaction", "appends", "checkpoint", "stats")
PEER_STEPS = ("open", "first request", "appends")
RSS_TARGET_MB = 256.0
REFERENCE = "reference module"
SQLITE = "SQLiteSession"

CHILD = """
import asyncio, json, sys, time
from benchmarks.long_data import new_messages

def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

kind, step, path, appends = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pc = time.perf_counter
fresh = new_messages(appends) if step in ("appends", "checkpoint") else []
result = {}

async def first_read(read):  # seconds read() takes (awaited if it must be); its length goes in the result
    t = pc()
    got = read()
    if asyncio.iscoroutine(got):
        got = await got
    took = pc() - t
    result["request_messages"] = len(got)
    return took

async def append_each(add):  # seconds adding the fresh messages takes, one add() call each
    t = pc()
    for m in fresh:
        done = add(m)
        if asyncio.iscoroutine(done):
            await done
    return pc() - t

async def ours():
    from context_persistent import PersistentContextManager
    cfg = {}
    if step == "checkpoint":
        cfg = {"checkpoint_every": appends, "fsync": "never"}
    base = rss_kb()
    t = pc()
    store = await PersistentContextManager.open(storage_path=path, session_id="s", **cfg)
    opened = pc() - t
    try:
        if step == "open":
            took = opened
        elif step == "first request":
            took = await first_read(store.get_messages_for_request)
        elif step == "compaction":
            await store.get_messages_for_request()
            budget = store.resolve_budget(None, None)[0] // 2
            t = pc()
            result["request_tokens"] = await store.compact(token_budget=budget)
            took = pc() - t
        elif step == "appends":
            took = await append_each(store.add_message)
        elif step == "checkpoint":
            cps = store._checkpoints
            before = cps.seq
            started = None
            for m in fresh:
                await store.add_message(m)
                if started is None and cps._task is not None:
                    started = pc()
            if started is None:
                raise SystemExit("no periodic checkpoint started")
            while cps._task is not None:
                await asyncio.sleep(0.001)
            took = pc() - started
            if cps.seq <= before:
                raise SystemExit(f"the checkpoint was not written: {cps.error}")
        elif step == "stats":
            t = pc()
            st = store.stats()
            took = pc() - t
            result["messages"] = st["messages"]
        result.update(seconds=took, base_kb=base, peak_kb=peak_rss_kb())
    finally:
        await store.close()

async def reference():
    from benchmarks.peers import ReferenceReRead
    base = rss_kb()
    t = pc()
    ref = ReferenceReRead(__import__("pathlib").Path(path))
    took = pc() - t
    if step == "first request":
        took = await first_read(ref.get_messages_for_request)
    elif step == "appends":
        took = await append_each(ref.add_message)
    result.update(seconds=took, base_kb=base, peak_kb=peak_rss_kb())

async def sqlite():
    from benchmarks.peers import durable_sqlite_session_class
    cls = durable_sqlite_session_class()
    base = rss_kb()
    t = pc()
    session = cls("bench", db_path=path)
    took = pc() - t
    try:
        if step == "first request":
            took = await first_read(session.get_items)
        elif step == "appends":
            took = await append_each(lambda m: session.add_items([m]))
        result.update(seconds=took, base_kb=base, peak_kb=peak_rss_kb())
    finally:
        session.close()

asyncio.run({"ours": ours, "reference": reference, "sqlite": sqlite}[kind]())
print(json.dumps(result))
"""

#: Command-line commands measured on the same session (each in a fresh interpreter, output to /dev/null;
#: ``{out}`` is a file in the working folder, ``{near_end}`` the seq 10 below the number of messages: at least
#: the last 10 events come after it; ``{half}`` the seq halfway through the session).
CLI_COMMANDS = (("verify", ["verify", "s"]), ("export to JSONL", ["export", "s", "{out}.jsonl"]),
                ("show --at (halfway)", ["show", "s", "--at", "{half}"]),
                ("export to JSON", ["export", "s", "{out}.json"]), ("tail", ["tail", "s"]),
                ("tail --after SEQ", ["tail", "s", "--after", "{near_end}"]),
                ("show --view request", ["show", "s", "--view", "request"]),
                ("export --view request", ["export", "s", "{out}.jsonl", "--view", "request"]),
                ("show -n 20", ["show", "s", "-n", "20"]), ("stats", ["stats", "s"]),
                ("stats --tokens", ["stats", "s", "--tokens"]), ("ls", ["ls"]))

CLI_CHILD = """
import json, os, sys, time
from context_persistent.cli import main
base = peak_rss_kb()
out = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
t = time.perf_counter()
rc = main(sys.argv[1:])
took = time.perf_counter() - t
sys.stdout.flush()
os.dup2(out, 1)
if rc not in (0, 1):
    raise SystemExit(f"exit status {rc}")
print(json.dumps({"seconds": took, "base_kb": base, "peak_kb": peak_rss_kb(), "rc": rc}))
"""

PREPARE = """
import asyncio, json, sys, time
from context_persistent import PersistentContextManager
async def main():
    t = time.perf_counter()
    store = await PersistentContextManager.open(storage_path=sys.argv[1], session_id="s")
    opened = time.perf_counter() - t
    peak = peak_rss_kb()
    t = time.perf_counter()
    await store.get_messages_for_request()  # (a windowed rebuild on a long history: counts only its window)
    # The first token count after a replay counts what no request view did, once; the close then records the
    # counts and their total with the checkpoint the steps open from.
    await store.get_token_count()
    counted = time.perf_counter() - t
    await store.close()
    return {"seconds": opened, "count_seconds": counted, "peak_kb": peak, "close_peak_kb": peak_rss_kb()}
print(json.dumps(asyncio.run(main())))
"""


def run_capped(code: str, args: list[str], cap_mb: int, timeout: float) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; stop it if its RSS passes ``cap_mb`` or it runs ``timeout`` seconds.
    The result is the child's JSON, or ``{"stopped": "memory" | "time", "peak_kb": ..., "seconds": ...}``
    (seconds: how long it ran until stopped, a lower bound of the step's time)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    cap_kb = cap_mb * 1024
    started = time.monotonic()
    seen = 0
    stopped = False
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            rss = _rss_kb(proc.pid)
            seen = max(seen, rss)
            if rss > cap_kb or time.monotonic() > deadline:
                proc.kill()
                stopped = True
                break
            time.sleep(0.02)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:  # (interrupted: the child goes too)
            proc.kill()
            proc.wait()
    if stopped:
        return {"stopped": "memory" if seen > cap_kb else "time", "peak_kb": seen,
                "seconds": time.monotonic() - started}
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}):\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _Session:
    """The cached data of one size, lent to a working session folder for the steps.

    The cached log is moved (renamed) into the working folder for the duration and moved back at the end:
    the store refuses to write a log that has other names (hard links). After every step the log is cut
    back to its cached length and the checkpoint the first open wrote is put back (a hard link kept aside;
    the store replaces checkpoints by renaming, so the kept one never changes); anything else a step created
    is removed."""

    def __init__(self, ctx: Ctx, n: int, cap_mb: int, timeout: float, prepare_timeout: float) -> None:
        self.ctx, self.n, self.cap_mb, self.timeout = ctx, n, cap_mb, timeout
        self.data = Dataset(n)
        t = time.perf_counter()
        self.manifest, self.built = self.data.ensure(ctx.log)
        self.build_s = time.perf_counter() - t
        ctx.log(f"{n:,} messages: {'generated in ' + format(self.build_s, '.0f') + ' s' if self.built else 'cached'}"
                f" ({self.manifest['message_bytes'] / 1e6:,.0f} MB of messages, "
                f"{self.manifest['average_message_bytes']:,} B average) in {self.data.folder}")
        # The working folder is inside the cache folder: the same file system, so moving the log is a rename.
        self.work = self.data.folder / f"run-{os.getpid()}"
        shutil.rmtree(self.work, ignore_errors=True)
        self.session = self.work / "ours" / SESSION_ID
        self.keep = self.work / "keep"
        for folder in (self.work, self.work / "ours", self.session):
            folder.mkdir(mode=0o700)
        self.keep.mkdir(mode=0o700)
        self.log_path = self.session / self.data.log.name
        os.rename(self.data.log, self.log_path)
        self._log_inode = self.log_path.stat().st_ino
        try:
            ctx.log(f"{_label(n)} messages: first open (replay) and close, writing the checkpoint")
            self.prepare = run_capped(PREPARE, [str(self.work / "ours")], cap_mb, prepare_timeout)
            ctx.log(_said(self.prepare))
            self._snapshot()
            self._reset()
        except BaseException:
            self.close()
            raise

    def _snapshot(self) -> None:
        """Record the session folder as the first open left it (it may have sealed the cached log into a
        segment): the lent log's name, mode and size; a copy of every other small file; a hard link to every
        other large one (sealed segments and checkpoints, which the store never changes in place)."""
        self._lent: tuple[str, int, int] | None = None
        self._kept: dict[str, tuple[int, str]] = {}  # name -> (inode, "copy" | "link")
        for entry in os.scandir(self.session):
            if entry.name == "lock" or not entry.is_file():
                continue
            st = entry.stat()
            if st.st_ino == self._log_inode:
                self._lent = (entry.name, st.st_mode & 0o777, st.st_size)
            elif st.st_size < (8 << 20) and not entry.name.startswith("checkpoint"):
                shutil.copy2(entry.path, self.keep / entry.name)
                self._kept[entry.name] = (st.st_ino, "copy")
            else:
                os.link(entry.path, self.keep / entry.name)
                self._kept[entry.name] = (st.st_ino, "link")
        if self._lent is None:
            raise RuntimeError(f"the first open replaced the cached log in {self.session}; delete {self.data.folder}")

    def _find_lent(self) -> os.DirEntry[str] | None:
        return next((e for e in os.scandir(self.session) if e.inode() == self._log_inode), None)

    def _reset(self) -> None:
        """The working session as the first open left it (see ``_snapshot``); the cached peers' files as the
        manifest says."""
        assert self._lent is not None
        name, mode, size = self._lent
        lent = self._find_lent()
        if lent is None:
            raise RuntimeError(f"the cached log lent to {self.session} is gone (rewritten?); delete {self.data.folder}")
        target = self.session / name
        if lent.path != str(target):
            os.replace(lent.path, target)
        os.chmod(target, 0o600)
        if target.stat().st_size != size:
            os.truncate(target, size)
        os.chmod(target, mode)
        for entry in os.scandir(self.session):
            if entry.name in (name, "lock"):
                continue
            kept = self._kept.get(entry.name)
            if kept is None or kept[0] != entry.inode() or kept[1] == "copy":
                os.chmod(entry.path, 0o600)
                os.unlink(entry.path)
        for kept_name, (_, how) in self._kept.items():
            path = self.session / kept_name
            if path.exists():
                continue
            if how == "link":
                os.link(self.keep / kept_name, path)
            else:
                shutil.copy2(self.keep / kept_name, path)
        self.data.restore(skip=(self.data.log,))

    def close(self) -> None:
        """Move the log back into the cache (cut back to its cached length) and remove the working folder."""
        for entry in os.scandir(self.session):
            if entry.inode() == self._log_inode:
                os.chmod(entry.path, 0o600)
                os.replace(entry.path, self.log_path)
        if self.log_path.exists() and self.log_path.stat().st_ino == self._log_inode:
            size = self.manifest["files"][self.data.log.name]["size"]
            os.truncate(self.log_path, size)
            os.rename(self.log_path, self.data.log)
        shutil.rmtree(self.work, ignore_errors=True)

    def run_cli(self, argv: list[str]) -> dict[str, Any]:
        out = self.work / "cli-out"
        try:
            args = ["--storage", str(self.work / "ours"),
                    *(a.replace("{out}", str(out)).replace("{near_end}", str(max(0, self.n - 10)))
                      .replace("{half}", str(max(1, self.n // 2))) for a in argv)]
            return run_capped(CLI_CHILD, args, self.cap_mb, self.timeout)
        finally:
            for p in self.work.glob("cli-out*"):
                p.unlink()
            for p in self.work.glob(".cli-out*"):
                p.unlink()
            self._reset()

    def run(self, kind: str, step: str, appends: int) -> dict[str, Any]:
        scratch = self.work / f"{kind}-{step.replace(' ', '-')}"
        scratch.mkdir(mode=0o700)
        try:
            if kind == "ours":
                target = str(self.work / "ours")
            elif kind == "reference":
                target = str(scratch / "context-messages.jsonl")
                os.link(self.data.reference, target)
            else:
                target = str(scratch / "agents.db")
                if step == "appends":  # SQLite rewrites pages in place: appends need a real copy
                    shutil.copyfile(self.data.agents_db, target)
                else:
                    os.link(self.data.agents_db, target)
            return run_capped(CHILD, [kind, step, target, str(appends)], self.cap_mb, self.timeout)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._reset()


def _mb(kb: float) -> float:
    return kb / 1024


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n))


def run(ctx: Ctx) -> list[Row]:
    # long_rounds: rounds at each size under 1M (at most the run's rounds); long_peers, long_cli: the peers' steps
    # and the command-line commands run at every size of at least that many messages (0: at none).
    ctx.defaults(quick={"long_small": 1_000, "long_medium": 5_000, "long_large": 0, "long_appends": 200,
                        "long_large_rounds": 1, "long_rss_cap_mb": 6144, "long_step_timeout_s": 300, "long_cli": 1, "long_prepare_timeout_s": 1800,
                        "long_rounds": 3, "long_peers": 1},
                 full={"long_small": 10_000, "long_medium": 100_000, "long_large": 1_000_000, "long_appends": 1_000,
                       "long_large_rounds": 1, "long_rss_cap_mb": 6144, "long_step_timeout_s": 300, "long_cli": 1, "long_prepare_timeout_s": 1800,
                       "long_rounds": 3, "long_peers": 1})
    sizes = [n for n in (ctx.size("long_small"), ctx.size("long_medium"), ctx.size("long_large")) if n > 0]
    if not sizes:
        return []
    appends = ctx.size("long_appends")
    cap = ctx.size("long_rss_cap_mb")
    timeout = ctx.size("long_step_timeout_s")
    base_n = sizes[0]
    # results[n][kind][step] = list of child results (one per round)
    results: dict[int, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    sessions: dict[int, _Session] = {}
    for n in sizes:
        s = _Session(ctx, n, cap, timeout, ctx.size("long_prepare_timeout_s"))
        sessions[n] = s
        rounds = ctx.size("long_large_rounds") if n >= 1_000_000 else min(ctx.rounds, ctx.size("long_rounds"))
        got: dict[str, dict[str, list[dict[str, Any]]]] = {"ours": {}, "reference": {}, "sqlite": {}, "cli": {}}
        kinds = (("ours", STEPS), ("reference", PEER_STEPS), ("sqlite", PEER_STEPS))
        if not 0 < ctx.size("long_peers") <= n:
            kinds = kinds[:1]
        try:
            for r in range(rounds):
                for kind, steps in kinds:
                    for step in steps:
                        ctx.log(f"{_label(n)} messages, {kind}: {step} (round {r + 1}/{rounds})")
                        got[kind].setdefault(step, []).append(s.run(kind, step, appends))
                        ctx.log(_said(got[kind][step][-1]))
            if 0 < ctx.size("long_cli") <= n:
                for name, argv in CLI_COMMANDS:
                    ctx.log(f"{_label(n)} messages, command line: {name}")
                    got["cli"][name] = [s.run_cli(argv)]
                    ctx.log(_said(got["cli"][name][-1]))
        finally:
            s.close()
        results[n] = got
    return _rows(results, sessions, base_n, appends, cap, timeout)


def _said(x: dict[str, Any]) -> str:
    """One measurement as a progress line (so a run stopped early still leaves its figures)."""
    stop = f", stopped ({x['stopped']})" if x.get("stopped") else ""
    return f"  -> {x['seconds'] * 1000:,.1f} ms, peak RSS {_mb(x['peak_kb']):,.0f} MB{stop}"


def _seconds(xs: list[dict[str, Any]]) -> float:
    return median([x["seconds"] for x in xs])


def _peak(xs: list[dict[str, Any]]) -> float:
    return max(_mb(x["peak_kb"]) for x in xs)


def _growth(xs: list[dict[str, Any]]) -> float:
    return max(_mb(x["peak_kb"] - x.get("base_kb", 0)) for x in xs)


def _stopped(xs: list[dict[str, Any]]) -> bool:
    return any(x.get("stopped") for x in xs)


def _rows(results: dict[int, dict[str, dict[str, list[dict[str, Any]]]]], sessions: dict[int, "_Session"],
          base_n: int, appends: int, cap: int, timeout: float) -> list[Row]:
    rows: list[Row] = []
    names = {"open": "open", "first request": "first request", "compaction": "compact() at half the budget",
             "appends": f"{appends:,} appends",
             "checkpoint": "periodic checkpoint", "stats": "stats()"}
    def stop_note(xs: list[dict[str, Any]]) -> str:
        why = {str(x["stopped"]) for x in xs if x.get("stopped")}
        return "; ".join(f"stopped at the {cap:,} MB cap" if w == "memory" else f"stopped after {timeout:.0f} s"
                         for w in sorted(why)) + " (time: at least the time until stopped)"
    for n, got in results.items():
        s = sessions[n]
        label = _label(n)
        prep = s.prepare
        rows.append(info(GROUP, f"{label}: first open, replaying the whole log (no checkpoint)",
                         prep["seconds"] * 1000, "ms",
                         note=stop_note([prep]) if prep.get("stopped") else
                         f"peak RSS {_mb(prep['peak_kb']):,.0f} MB; then a request view and a token count count every "
                         f"message ({prep['count_seconds']:.1f} s, once) and the close writes the checkpoint the "
                         "steps open from, with the counts and their total"))
        for step in STEPS:
            xs = got["ours"][step]
            stopped = _stopped(xs)
            extra = {"peak_mb": _peak(xs), "growth_mb": None if stopped else _growth(xs), "stopped": stopped,
                     "seconds": [x["seconds"] for x in xs], "messages": n,
                     "average_message_bytes": s.manifest["average_message_bytes"]}
            rows.append(compare(GROUP, f"{label}: peak RSS, {names[step]} (fresh interpreter)", [_peak(xs)],
                                [RSS_TARGET_MB], unit="MB", target="<= 1", ref_name="the 256 MB target",
                                note=stop_note(xs) if stopped else f"growth over the interpreter: {_growth(xs):,.0f} MB",
                                extra=extra))
            if n == base_n:
                ts = [x["seconds"] * 1000 for x in xs]
                rows.append(info(GROUP, f"{label}: {names[step]}", median(ts), "ms", samples=ts,
                                 note=stop_note(xs) if stopped else ""))
            else:
                base = results[base_n]["ours"][step]
                row = compare(GROUP, f"{label}: {names[step]}, / its {_label(base_n)} cost",
                              [_seconds(xs) * 1000], [_seconds(base) * 1000], unit="ms", target="<= 2",
                              ref_name=f"ours at {_label(base_n)} messages",
                              note=stop_note(xs) if stopped else "", extra=extra)
                if stopped:
                    row.ok = False
                rows.append(row)
        for name, xs in got["cli"].items():
            stopped = _stopped(xs)
            row = compare(GROUP, f"{label}: peak RSS, context-persistent {name}", [_peak(xs)], [RSS_TARGET_MB],
                          unit="MB", target="<= 1", ref_name="the 256 MB target",
                          note=stop_note(xs) if stopped else (
                              f"{_seconds(xs):.1f} s; growth over the interpreter: {_growth(xs):,.0f} MB"),
                          extra={"seconds": [x["seconds"] for x in xs], "stopped": stopped,
                                 "growth_mb": None if stopped else _growth(xs)})
            if stopped:
                row.ok = False
            rows.append(row)
        for kind, peer in (("reference", REFERENCE), ("sqlite", SQLITE)):
            for step in PEER_STEPS if got[kind] else ():
                mine, theirs = got["ours"][step], got[kind][step]
                halted = [w for w, x in (("ours", mine), (peer, theirs)) if _stopped(x)]
                rows.append(compare(GROUP, f"{label}: {names[step]}: {peer} / ours",
                                    [_seconds(mine) * 1000], [_seconds(theirs) * 1000], unit="ms",
                                    invert=True, ref_name=peer,
                                    note="; ".join(f"{w} stopped (time: at least)" for w in halted)))
                rows.append(Row(group=GROUP, name=f"{label}: peak RSS, {names[step]}: ours vs {peer}",
                                ours=_peak(mine), ref=_peak(theirs), unit="MB", ref_name=peer,
                                ratio=_peak(mine) / _peak(theirs),
                                note="; ".join(f"{w} stopped" for w in halted)))
    return rows
