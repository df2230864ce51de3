"""The garbage collector paused while a history is copied (model/events.py ``gc_paused``, docs/performance.md #23):
the copy is the same, and the collector's state is what it was before, whatever happened inside."""

from __future__ import annotations

import asyncio
import gc

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model import events as ev


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


def _seen_by_copy(monkeypatch, value):
    """copy_json(value) and whether the collector was enabled when its non-list item was converted."""
    seen = []
    dumps = ev.json_lossless.dumps

    def spy(v, *a, **k):
        seen.append(gc.isenabled())
        return dumps(v, *a, **k)

    monkeypatch.setattr(ev.json_lossless, "dumps", spy)
    return ev.copy_json(value), seen


@pytest.mark.parametrize("n, paused", [(ev.GC_PAUSE_ITEMS - 1, False), (ev.GC_PAUSE_ITEMS, True)])
def test_a_long_list_is_copied_with_the_collector_paused(monkeypatch, collector, n, paused):
    gc.enable()
    history = [{"role": "user", "content": [{"type": "text", "text": f"m{i}"}]} for i in range(n - 1)]
    history.append(("a", "tuple"))  # (converted as JSON does: the copy calls json_lossless.dumps for it)
    out, seen = _seen_by_copy(monkeypatch, history)
    assert seen == [not paused]
    assert gc.isenabled()
    assert out[:-1] == history[:-1] and out[-1] == ["a", "tuple"]
    assert all(a is not b and a["content"] is not b["content"] for a, b in zip(out[:-1], history[:-1]))


def test_the_pause_leaves_the_collector_as_it_was(collector):
    gc.disable()
    with ev.gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # (disabled by the caller: not turned on)
    gc.enable()
    with pytest.raises(RuntimeError):
        with ev.gc_paused():
            with ev.gc_paused():  # (re-entrant: the inner one changes nothing)
                assert not gc.isenabled()
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()


def test_get_messages_restores_the_collector(tmp_path, collector):
    async def run():
        store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", fsync="never")
        try:
            await store.add_messages([{"role": "user", "content": f"m{i}"} for i in range(2000)])
            gc.enable()
            first = await store.get_messages()
            assert gc.isenabled()
            gc.disable()
            again = await store.get_messages()
            assert not gc.isenabled()
            assert first == again and len(first) == 2000 and first is not again
        finally:
            await store.close()

    asyncio.run(run())
