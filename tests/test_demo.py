"""The demo (`make demo`) runs end to end: kill, resume, ignored transcript, views, log location."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from context_persistent import PersistentContextManager


async def test_demo_kills_and_resumes(tmp_path: Path, subprocess_env: dict) -> None:
    """The demo's child is SIGKILLed mid-session and a second process resumes with nothing lost."""
    storage = tmp_path / "demo"
    out = subprocess.run([sys.executable, "-m", "context_persistent", "demo", "--storage", str(storage)],
                         capture_output=True, text=True, env=subprocess_env, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(exit -9)" in text
    assert "loaded_from_file=True" in text and "ignored: history still has" in text
    assert "system prompt kept: True" in text
    for title in ("conversation view", "reasoning view", "request view"):
        assert f"== {title}" in text
    assert f"the log lives at {storage}/demo-session/events.jsonl" in text
    async with await PersistentContextManager.open(storage_path=storage, session_id="demo-session",
                                                   readonly=True) as s:
        history = await s.get_messages()
    assert history[0]["role"] == "system" and len(history) == 11
