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


def spy_backward_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions each backward read of ``newest`` stops at, appended as the reads are made."""
    stops: list[int] = []
    real = newest._backwards

    def spy(log: Any, kind: str, limit: int, stop: int = 0, where: Any = None) -> Any:
        stops.append(stop)
        return real(log, kind, limit, stop, where)
    monkeypatch.setattr(newest, "_backwards", spy)
    return stops


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


@pytest.mark.parametrize("config", [{}, {"segment_bytes": 4096}, {"segment_bytes": 4096, "compress_sealed": True}])
async def test_known_positions_give_what_the_backward_read_gives_and_a_wrong_one_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> None:
    """With the positions of the reports before a position (a checkpoint's ``usage_at``), the log is read back
    to that position only and the older reports where the positions say: the same records as the whole
    backward read. A position that holds no such record, one record too few or out of order are not used: the
    log is read back as without them, with the same result."""
    store = await _session(tmp_path, **config)
    await store.close()
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", **config)
    try:
        log = store._log
        where: list[int] = []
        whole = await newest.newest_records(log, "usage_reported", 12, None, where)
        assert [r["data"]["id"] for r in whole] == [f"r{t}" for t in range(12)] and where == sorted(where)
        cut = where[8]  # (the reports r0-r7 are before it: read where the positions say)
        stops = spy_backward_reads(monkeypatch)
        for limit in (12, 6, 3):
            got: list[int] = []
            assert await newest.newest_records(log, "usage_reported", limit, (cut, where[:8]), got) == whole[-limit:]
            assert got == where[-limit:] and stops == [cut]
            stops.clear()
        bad = {"not a report": where[:7] + [where[7] + 1], "too few": where[1:8], "a message": where[:7] + [cut - 200],
               "out of order": where[:6] + where[7:8] + where[6:7]}
        for name, positions in bad.items():
            got = []
            assert await newest.newest_records(log, "usage_reported", 12, (cut, positions), got) == whole, name
            assert got == where and stops[-1] == 0, name  # (read back as without them)
    finally:
        await store.close()
