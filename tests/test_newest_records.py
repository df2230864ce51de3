"""``newest_records`` reads a file log backwards in windows, finding the records of a type by a byte search:
the same records as a forward read, across sealed (and compressed) segments, with lines longer than a
window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.storage import newest


async def _session(storage: Path, **config: Any) -> PersistentContextManager:
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", **config)
    for turn in range(12):
        size = 9000 if turn == 5 else 200  # (one line longer than the small windows below)
        await store.add_messages([{"role": "user", "content": f"turn {turn} " + "x" * size},
                                  {"role": "assistant", "content": f"answer {turn}"}])
        await store.record_usage({"input_tokens": 100 + turn, "output_tokens": 5}, provider="p", model="m",
                           id=f"r{turn}")
    return store


async def _forward(log: Any, kind: str, limit: int) -> list[dict[str, Any]]:
    kept: list[dict[str, Any]] = []
    async for batch in log.read_batches():
        kept.extend(r for r in batch if r.get("type") == kind)
    return kept[-limit:]


@pytest.mark.parametrize("config", [{}, {"segment_bytes": 4096}, {"segment_bytes": 4096, "compress_sealed": True}])
@pytest.mark.parametrize("window", [512, 4096, 1 << 20])
async def test_backwards_finds_what_a_forward_read_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         config: dict[str, Any], window: int) -> None:
    monkeypatch.setattr(newest, "WINDOW", window)
    store = await _session(tmp_path, **config)
    await store.close()
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", **config)
    try:
        log = store._log
        for kind, limit in (("usage_reported", 100), ("usage_reported", 3), ("message_added", 7),
                            ("session_started", 5)):
            found = newest._backwards(log, kind, limit)
            assert found is not None
            assert found[::-1] == await _forward(log, kind, limit), (kind, limit)
        assert [r["data"]["id"] for r in await newest.newest_records(log, "usage_reported", 2)] == ["r10", "r11"]
        assert store.stats()["last_usage"]["id"] == "r11"  # (the meter rebuilt at open from the same read)
    finally:
        await store.close()
