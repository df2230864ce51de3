"""Make the screenshots of docs/viewer.md: ``make screenshots`` (or ``python docs/screenshots.py``).

Builds the example sessions (tests/viewer_sessions.py) in a temporary folder, starts ``context-persistent
serve`` on them, and photographs the main pages with Debian's chromium driven by playwright (the
``[test]`` extra; chromium from ``apt-get install chromium``, or $CONTEXT_PERSISTENT_CHROMIUM).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images"
CHROMIUM = os.environ.get("CONTEXT_PERSISTENT_CHROMIUM", "/usr/bin/chromium")
SHOTS = [  # (file, hash route, element to wait for)
    ("viewer-sessions.png", "#/", "#sessions tbody tr"),
    ("viewer-timeline.png", "#/s/agent", "#timeline .msg"),
    ("viewer-request.png", "#/s/agent?view=request&budget=1500", "#history .msg.dropped"),
    ("viewer-time-travel.png", "#/s/agent?view=full&at=12", "#messages .msg"),
]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from playwright.sync_api import sync_playwright

    from tests.viewer_sessions import build

    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp) / "store"
        asyncio.run(build(storage))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        server = subprocess.Popen([sys.executable, "-m", "context_persistent", "--storage", str(storage), "serve",
                                   "--no-browser"], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            base = url.split("?", 1)[0]
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM)
                page = browser.new_page(viewport={"width": 1280, "height": 820})
                page.goto(url)
                for name, route, ready in SHOTS:
                    page.goto(base + route)
                    page.wait_for_selector(ready)
                    page.wait_for_selector("#chart svg, #sessions", timeout=10_000)
                    page.screenshot(path=str(OUT / name))
                    print(f"wrote {OUT / name} ({(OUT / name).stat().st_size} bytes)")
                browser.close()
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
