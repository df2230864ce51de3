"""Long sessions for the memory benchmark: a realistic agent mix averaging about 4 KB a message, generated
fast enough for a million messages, and cached on disk between runs.

The mix follows :func:`benchmarks.workloads.agent_mix` (a system prompt, then turns of a user message,
zero to three rounds of an assistant message with one or two tool calls and their results, and a final
answer; a system message every few hundred turns), with tool results twice as large so the average message
is about 4 KB of JSON. Texts are slices of a fixed pool of prose at random offsets, so every message is
distinct and the tokenizer sees words, while generating a million messages costs seconds, not minutes.

The messages are produced one at a time (never a list of the whole session): generating a 4 GB session
needs no more memory than a 64 KB message.

Cached data: ``$CP_BENCH_CACHE`` (default ``.bench-cache/`` in the repository, git-ignored) holds one folder
per (size, mix, mix version, log format version). A folder is complete once its ``manifest.json`` exists; the
manifest records every file's size and the CRC-32 of its last 64 KB, so a cache a killed run left longer than
it was (appends are measured on these files, then cut back) is cut back or, if anything else
changed, rebuilt.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from context_persistent.model import codec
from context_persistent.storage.paths import DIR_MODE, LOG_NAME

from ._harness import ROOT
from .workloads import text, write_reference, write_session

#: The mix's name and version: a new version (any change to what is generated) makes a new cache folder.
MIX = "agent4k"
MIX_VERSION = 1
SESSION_ID = "s"

#: Tool result sizes and weights: those of workloads.agent_mix, doubled (mostly small, a few up to 128 KB).
_TOOL_SIZES = ((80, 30), (600, 25), (3200, 20), (13000, 15), (42000, 7), (131072, 3))
_POOL_CHARS = 1 << 21
_TOOLS = ("read_file", "bash", "grep", "write_file")


class _Pool:
    """Prose to slice texts from (2 MB, built once per seed)."""

    def __init__(self, rng: random.Random) -> None:
        self.text = text(rng, _POOL_CHARS)
        self.rng = rng

    def take(self, chars: int) -> str:
        if chars <= 0:
            return ""
        start = self.rng.randrange(0, _POOL_CHARS - chars)
        return self.text[start:start + chars]


def messages(n: int, seed: int = 1) -> Iterator[dict[str, Any]]:
    """``n`` messages of the 4 KB agent mix, one at a time (the same ``n`` and ``seed``: the same messages)."""
    rng = random.Random(seed)
    pool = _Pool(rng)
    sizes = [s for s, w in _TOOL_SIZES for _ in range(w)]
    made = 0
    call = 0

    def emit(m: dict[str, Any]) -> Iterator[dict[str, Any]]:
        nonlocal made
        if made < n:
            made += 1
            yield m

    yield from emit({"role": "system", "content": pool.take(3000)})
    turn = 0
    while made < n:
        turn += 1
        if turn % 300 == 0:
            yield from emit({"role": "system", "content": "Reminder: " + pool.take(rng.randint(100, 400))})
        yield from emit({"role": "user", "content": pool.take(rng.randint(20, 600))})
        for _ in range(rng.randint(0, 3)):
            k = rng.randint(1, 2)
            ids = [f"call_{call + j}" for j in range(k)]
            call += k
            yield from emit({
                "role": "assistant", "content": pool.take(rng.randint(0, 200)) or None,
                "tool_calls": [{"id": i, "type": "function", "function": {
                    "name": rng.choice(_TOOLS),
                    "arguments": json.dumps({"path": pool.take(30), "limit": rng.randint(1, 500)})}} for i in ids],
            })
            for i in ids:
                yield from emit({"role": "tool", "tool_call_id": i, "content": pool.take(rng.choice(sizes))})
        yield from emit({"role": "assistant", "content": pool.take(rng.randint(50, 1500))})


def new_messages(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """``n`` messages of the same mix for the appends step (a different seed than the session's)."""
    return list(messages(n, seed))


# -- the cache ------------------------------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("CP_BENCH_CACHE") or ROOT / ".bench-cache")


def _tail_crc(path: Path, size: int) -> int:
    with open(path, "rb") as f:
        start = max(0, size - (1 << 16))
        f.seek(start)
        return zlib.crc32(f.read(size - start))


def _manifest_entry(path: Path) -> dict[str, int]:
    size = path.stat().st_size
    return {"size": size, "tail_crc": _tail_crc(path, size)}


class Dataset:
    """One cached session of ``n`` messages, in three stores: ours (``ours/s/events.jsonl``), the reference
    module's ``context-messages.jsonl`` and openai-agents ``SQLiteSession``'s database (``agents.db``)."""

    def __init__(self, n: int, root: Path | None = None) -> None:
        self.n = n
        self.folder = (root or cache_root()) / f"{n}-{MIX}-v{MIX_VERSION}-f{codec.FORMAT_VERSION}"
        self.ours = self.folder / "ours"
        self.log = self.ours / SESSION_ID / LOG_NAME
        self.reference = self.folder / "context-messages.jsonl"
        self.agents_db = self.folder / "agents.db"
        self.manifest_path = self.folder / "manifest.json"

    def files(self) -> list[Path]:
        return [self.log, self.reference, self.agents_db]

    def manifest(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.manifest_path.read_text())
        return loaded

    def ready(self) -> bool:
        """True when the cache is complete and every file is as the manifest says (a file a killed run left
        longer is cut back first; any other difference: False, and the folder is rebuilt)."""
        if not self.manifest_path.is_file():
            return False
        if not self.log.exists():  # a run killed while it had the log lent to its working folder
            for stale in sorted(self.folder.glob(f"run-*/ours/{SESSION_ID}/{self.log.name}")):
                os.rename(stale, self.log)
                break
        for leftover in self.folder.glob("run-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            want = self.manifest()["files"]
            for path in self.files():
                entry = want[path.name]
                size = path.stat().st_size
                if size > entry["size"]:
                    if _tail_crc(path, entry["size"]) != entry["tail_crc"]:
                        return False
                    os.truncate(path, entry["size"])
                elif size < entry["size"] or _tail_crc(path, size) != entry["tail_crc"]:
                    return False
        except (OSError, KeyError, ValueError):
            return False
        return True

    def build(self, log: Any = None) -> dict[str, Any]:
        """Generate the three stores (replacing a partial folder); returns the manifest."""
        from .peers import durable_sqlite_session_class

        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, mode=DIR_MODE)
        say = log or (lambda _msg: None)
        say(f"generating {self.n:,} messages of the {MIX} mix into {self.folder} (cached for later runs)")
        total = 0
        count = 0

        def counted() -> Iterator[dict[str, Any]]:
            nonlocal total, count
            for m in messages(self.n):
                total += len(codec.dumps(m))
                count += 1
                yield m

        write_session(self.ours, SESSION_ID, counted())
        write_reference(self.reference, messages(self.n))
        session = durable_sqlite_session_class()("bench", db_path=self.agents_db)
        try:
            import asyncio

            async def fill() -> None:
                batch: list[Any] = []
                for m in messages(self.n):
                    batch.append(m)
                    if len(batch) == 2000:
                        await session.add_items(batch)
                        batch = []
                if batch:
                    await session.add_items(batch)

            asyncio.run(fill())
        finally:
            session.close()
        manifest = {"n": self.n, "mix": MIX, "mix_version": MIX_VERSION, "format": codec.FORMAT_VERSION,
                    "message_bytes": total, "average_message_bytes": round(total / max(1, count)),
                    "files": {p.name: _manifest_entry(p) for p in self.files()}}
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, self.manifest_path)
        return manifest

    def ensure(self, log: Any = None) -> tuple[dict[str, Any], bool]:
        """The manifest, building the data first if the cache does not hold it; and whether it was built."""
        if self.ready():
            return self.manifest(), False
        return self.build(log), True

    def restore(self, skip: tuple[Path, ...] = ()) -> None:
        """Cut every cached file (but ``skip``) back to its manifest size, after a step appended to it."""
        want = self.manifest()["files"]
        for path in self.files():
            if path in skip:
                continue
            entry = want[path.name]
            if path.stat().st_size > entry["size"]:
                os.truncate(path, entry["size"])
            if _tail_crc(path, entry["size"]) != entry["tail_crc"]:
                raise RuntimeError(f"{path} changed inside its first {entry['size']} bytes; delete {self.folder}")

