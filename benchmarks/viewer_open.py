"""How long the viewer takes to open a long session and page through it, and how much memory that costs.

``python -m benchmarks.viewer_open [--messages N] [--storage DIR]``: imports a session of N short messages
(default 1,000,000; reused when DIR already holds it), then times, through the viewer's own API in process
(Starlette's test client, no network), the first requests a browser makes when the session is opened
(its facts and the last page of the timeline), a page of the timeline and of the full view from the middle
and from the start, and the request view. Prints one line per step and the process's peak RSS
(docs/viewer.md, "Reading, memory and time").
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
from pathlib import Path

import orjson


async def _make(storage: Path, n: int) -> None:
    from context_persistent import import_

    src = storage.parent / "viewer-open-source.jsonl"
    with open(src, "wb") as f:
        f.write(orjson.dumps({"role": "system", "content": "You are a careful agent."}) + b"\n")
        for i in range(n):
            role = "user" if i % 2 == 0 else "assistant"
            f.write(orjson.dumps({"role": role, "content": f"message {i}: " + "lorem ipsum dolor sit amet " * 4})
                    + b"\n")
    await import_(str(src), session_id="big", storage_path=storage, source="reference")
    src.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--storage", type=Path, default=None, help="reuse or create the session here")
    args = parser.parse_args()
    storage = args.storage or Path(tempfile.mkdtemp(prefix="viewer-open-")) / "store"
    if not (storage / "big").is_dir():
        storage.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        asyncio.run(_make(storage, args.messages))
        print(f"made {args.messages:,} messages in {time.perf_counter() - t:.1f} s at {storage}")

    from starlette.testclient import TestClient

    from context_persistent.viewer.app import create_app
    from context_persistent.viewer.source import Source

    token = "benchmark-token-0123456789"
    steps = [
        ("open: facts + last timeline page", ["/api/sessions/big", "/api/sessions/big/timeline?limit=200"]),
        ("last page of the full view", ["/api/sessions/big/messages?limit=200"]),
        ("timeline page from the middle", [f"/api/sessions/big/timeline?after={args.messages // 2}&limit=200"]),
        ("full view page from the middle", [f"/api/sessions/big/messages?start={args.messages // 2}&limit=200"]),
        ("full view page from the start", ["/api/sessions/big/messages?start=0&limit=200"]),
        ("request view (8,000-token budget)", ["/api/sessions/big/request?budget=8000"]),
    ]
    with TestClient(create_app(Source(storage), token, port=1), headers={"authorization": f"Bearer {token}"}) as c:
        for label, paths in steps:
            t = time.perf_counter()
            for path in paths:
                r = c.get(path)
                assert r.status_code == 200, (path, r.text[:300])
            print(f"{label:<40} {1000 * (time.perf_counter() - t):8.1f} ms")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
