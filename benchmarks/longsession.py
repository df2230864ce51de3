"""Long sessions: build a session of N messages of a realistic agent mix quickly, and measure what a store costs
on it, step by step (time and peak RSS, each measurement in a fresh child process).

Building writes the log in one pass (chained records, the codec's encoding, no fsync per record), then opens the
session once with the store to write its checkpoint, with every message's token count filled in: a long-running
agent's request views count each message as it arrives, so its checkpoints hold them all.

    python -m benchmarks.longsession build DIR --messages 100000 [--mean-bytes 4096]
    python -m benchmarks.longsession measure DIR [--appends 1000] [--json]

``measure`` runs, in a new process: open, the first request view, ``appends`` appends, a checkpoint and
``stats()``, and prints each step's wall time and the process's peak RSS after it. ``steps()`` returns the same
as a dict for other benchmarks (benchmarks/ plug-ins).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from context_persistent.model import codec
from context_persistent.model import events as ev
from context_persistent.storage.paths import FILE_MODE, LOG_NAME, make_private_dirs

from .workloads import agent_mix

SESSION_ID = "long"
#: Distinct message bodies the session is made of (each message gets its own ``metadata.n``, which no token
#: counter reads, so a body's count is computed once).
POOL = 4096


def _pool(mean_bytes: int, seed: int) -> list[dict[str, Any]]:
    """Messages of the agent mix (workloads.agent_mix), their text scaled so the mean JSON size is ``mean_bytes``."""
    base = agent_mix(POOL, seed)
    mean = sum(len(orjson.dumps(m)) for m in base) / len(base)
    factor = mean_bytes / mean
    out = []
    for m in base:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, str) and content:
            whole, part = divmod(factor, 1)
            m["content"] = content * int(whole) + content[: int(len(content) * part)]
        out.append(m)
    return out


def build(directory: str | os.PathLike[str], messages: int, *, mean_bytes: int = 4096, seed: int = 1,
          session_id: str = SESSION_ID, checkpoint: bool = True) -> dict[str, Any]:
    """Write ``<directory>/<session_id>/events.jsonl`` holding ``session_started`` and ``messages`` messages of
    the agent mix (about ``mean_bytes`` of JSON each), then (``checkpoint``) open it with the store once and
    close it, with every token count filled in, so the session has a current checkpoint. Returns facts."""
    from context_persistent.model.tokens import TokenCounter

    root = Path(directory)
    folder = root / session_id
    make_private_dirs(folder)
    pool = _pool(mean_bytes, seed)
    counter = TokenCounter()
    pool_tokens = [counter.count_message(m) for m in pool]
    rng = random.Random(seed)
    counts = array.array("q")
    started = time.perf_counter()
    fd = os.open(folder / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    ts = codec.now_iso()
    with os.fdopen(fd, "wb", buffering=1 << 22) as f:
        first = codec.encode_event(1, ev.SESSION_STARTED, {
            "format": codec.FORMAT_VERSION, "tokenizer": counter.requested, "program": "benchmarks",
            "session_id": session_id}, ts, codec.root_crc(session_id))
        f.write(first)
        prev = codec.crc_of(first)
        # The system prompt first, then runs of the pool's whole turns (each from a user message to the next:
        # every tool result follows its call), picked at random.
        turns = [i for i, m in enumerate(pool) if m["role"] == "user"]
        order = [0]
        while len(order) < messages:
            t = rng.randrange(0, len(turns) - 9)
            order.extend(range(turns[t], turns[t + rng.randint(1, 8)]))
        for seq, k in enumerate(order[:messages], 2):
            m = pool[k]
            body = orjson.dumps({**m, "metadata": {"n": seq}})
            line = codec.encode(seq, ev.MESSAGE_ADDED, b'{"message":%s}' % body, ts, prev)
            prev = line[-11:-3]
            f.write(line)
            counts.append(pool_tokens[k])
        f.flush()
        os.fsync(f.fileno())
    size = (folder / LOG_NAME).stat().st_size
    facts: dict[str, Any] = {"messages": messages, "bytes": size, "write_s": time.perf_counter() - started}
    try:  # a log that grew under a store rolls into sealed segments as it goes: cut this one the same way
        from context_persistent.storage.log import SEGMENT_BYTES
        from context_persistent.storage.segment_store import migrate
    except ImportError:  # (a version without segments: one file)
        pass
    else:
        started = time.perf_counter()
        migrate(folder, session_id, SEGMENT_BYTES)
        facts["segments_s"] = time.perf_counter() - started
    if checkpoint:
        started = time.perf_counter()
        asyncio.run(_checkpoint(root, session_id, counts))
        facts["checkpoint_s"] = time.perf_counter() - started
    return facts


async def _checkpoint(root: Path, session_id: str, counts: array.array) -> None:  # type: ignore[type-arg]
    from context_persistent import PersistentContextManager
    store = await PersistentContextManager.open(storage_path=root, session_id=session_id, fsync="never",
                                                checkpoint_every=1 << 40)
    try:
        tokens = store._state.materialise().tokens
        if len(tokens) != len(counts):
            raise RuntimeError(f"the store holds {len(tokens)} messages, {len(counts)} were written")
        for i, t in enumerate(counts):  # (what request views would have counted, one message at a time)
            tokens[i] = t
        await _force_checkpoint(store)
    finally:
        await store.close()


async def _force_checkpoint(store: Any) -> None:
    """Write a checkpoint now, as the periodic one would (the Checkpointer's own steps)."""
    cp = store._checkpoints
    if cp._task is not None:
        await cp._task
    session = getattr(store, "_s", store)  # (the store's shared session part, where there is one)
    name = getattr(session, "tokenizer_name", None) or store._tokenizer_name
    prep = cp._prepare(store._state, store._log, name)
    await cp._write(prep, store._log)
    if cp.error is not None:
        raise RuntimeError(f"checkpoint failed: {cp.error}")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


async def _steps(root: Path, session_id: str, appends: int) -> dict[str, Any]:
    from context_persistent import PersistentContextManager
    out: dict[str, Any] = {"rss_start_mb": _rss_mb()}

    def step(name: str, started: float) -> None:
        out[name] = {"s": time.perf_counter() - started, "peak_rss_mb": round(_rss_mb(), 1)}

    t = time.perf_counter()
    store = await PersistentContextManager.open(storage_path=root, session_id=session_id)
    step("open", t)
    try:
        t = time.perf_counter()
        view = await store.get_messages_for_request()
        step("first_request", t)
        out["first_request"]["view_messages"] = len(view)
        pool = _pool(4096, 7)[1:]
        t = time.perf_counter()
        for i in range(appends):
            await store.add_message({**pool[i % len(pool)], "metadata": {"appended": i}})
        step("appends", t)
        t = time.perf_counter()
        await _force_checkpoint(store)
        step("checkpoint", t)
        t = time.perf_counter()
        stats = store.stats()
        step("stats", t)
        out["messages"], out["tokens"] = stats["messages"], stats["tokens"]
        out["loaded_checkpoint_seq"] = stats["checkpoint"]["loaded_seq"]
    finally:
        t = time.perf_counter()
        await store.close()
        step("close", t)
    return out


def steps(directory: str | os.PathLike[str], *, appends: int = 1000, session_id: str = SESSION_ID,
          copy: bool = True) -> dict[str, Any]:
    """Measure the steps on the session in ``directory`` in a fresh child process (peak RSS is per process).

    ``copy``: work on a copy of the session folder (the appends and the checkpoint change it), removed after."""
    import shutil
    import tempfile

    src = Path(directory)
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        root = Path(tmp) if copy else src
        if copy:
            shutil.copytree(src / session_id, root / session_id)
            os.sync()  # (else the first durable append flushes the whole copy: gigabytes at 1M messages)
        cmd = [sys.executable, "-m", "benchmarks.longsession", "_child", str(root), session_id, str(appends)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"measuring failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.longsession")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a long session")
    b.add_argument("directory")
    b.add_argument("--messages", type=int, required=True)
    b.add_argument("--mean-bytes", type=int, default=4096)
    b.add_argument("--no-checkpoint", action="store_true")
    m = sub.add_parser("measure", help="open / first request / appends / checkpoint / stats in a fresh process")
    m.add_argument("directory")
    m.add_argument("--appends", type=int, default=1000)
    m.add_argument("--in-place", action="store_true", help="do not copy the session first")
    c = sub.add_parser("_child")
    c.add_argument("root")
    c.add_argument("session_id")
    c.add_argument("appends", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        facts = build(args.directory, args.messages, mean_bytes=args.mean_bytes, checkpoint=not args.no_checkpoint)
        print(json.dumps(facts))
    elif args.cmd == "measure":
        print(json.dumps(steps(args.directory, appends=args.appends, copy=not args.in_place), indent=1))
    else:
        print(json.dumps(asyncio.run(_steps(Path(args.root), args.session_id, args.appends))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
