"""LangGraph's published checkpointer conformance suite (``langgraph-checkpoint-conformance``, the version the
test extra pins) run against ``PersistentCheckpointSaver``, as its README says to run it, nothing deselected.

It runs twice: once on the saver's async methods (what the suite calls), and once through a wrapper whose
async methods call the saver's *sync* methods on a worker thread, so the same published tests check the sync
interface ``graph.invoke`` uses.

The suite detects the optional capabilities by the methods a saver overrides. The saver implements every
base capability and ``copy_thread``; it does not implement ``delete_for_runs`` and ``prune`` (they delete
some checkpoints of a live thread, which an append-only log can only do by rewriting it; see
docs/integrations.md), so the suite reports them "not implemented": they are not deselected tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph.checkpoint.conformance")

from langgraph.checkpoint.base import BaseCheckpointSaver  # noqa: E402
from langgraph.checkpoint.conformance import checkpointer_test, validate  # noqa: E402
from langgraph.checkpoint.conformance.report import ProgressCallbacks  # noqa: E402

from context_persistent.integrations.langgraph import PersistentCheckpointSaver  # noqa: E402

SUITE_VERSION = "0.0.2"
BASE = {"put", "put_writes", "get_tuple", "list", "delete_thread"}
#: Optional capabilities the saver implements (the suite runs their tests).
EXTENDED = {"copy_thread"}
#: Optional capabilities it does not implement, and why.
NOT_IMPLEMENTED = {
    "delete_for_runs": "deletes the checkpoints of some runs from a live thread: an append-only log would "
                       "have to be rewritten",
    "prune": "keeps only the latest checkpoints of a live thread: the same rewrite",
}


class SyncThroughThread(BaseCheckpointSaver[int]):
    """The suite's async calls, answered by the saver's sync methods on a worker thread."""

    def __init__(self, inner: PersistentCheckpointSaver) -> None:
        super().__init__(serde=inner.serde)
        self.inner = inner

    async def aget_tuple(self, config: Any) -> Any:
        return await asyncio.to_thread(self.inner.get_tuple, config)

    async def alist(self, config: Any, *, filter: Any = None, before: Any = None,
                    limit: Any = None) -> AsyncIterator[Any]:
        items = await asyncio.to_thread(lambda: list(self.inner.list(config, filter=filter, before=before,
                                                                     limit=limit)))
        for item in items:
            yield item

    async def aput(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        return await asyncio.to_thread(self.inner.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: Any, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await asyncio.to_thread(self.inner.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.inner.delete_thread, thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.inner.copy_thread, source_thread_id, target_thread_id)


def test_the_pinned_suite_is_installed() -> None:
    """The suite's version is the one the test extra pins (a newer one may test more: pin it deliberately)."""
    assert metadata.version("langgraph-checkpoint-conformance") == SUITE_VERSION


@pytest.mark.parametrize("interface", ["async", "sync"])
async def test_conformance_suite_passes(interface: str, tmp_path: Path) -> None:
    """Every test of every base capability and of copy_thread passes; only the two unimplemented ones skip."""
    made: list[Path] = []

    async def factory() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        folder = tmp_path / f"run-{len(made)}"
        made.append(folder)
        saver = PersistentCheckpointSaver(folder)
        try:
            yield saver if interface == "async" else SyncThroughThread(saver)
        finally:
            await saver.aclose()

    registered = checkpointer_test(name=f"PersistentCheckpointSaver-{interface}")(factory)
    lines: list[str] = []
    progress = ProgressCallbacks.verbose()
    report = await validate(registered, progress=progress)
    for name, result in sorted(report.results.items()):
        lines.append(f"{name}: passed={result.passed} failed={result.tests_failed} {result.failures}")
    summary = "\n".join(lines)
    assert report.passed_all_base(), summary
    for name in BASE | EXTENDED:
        result = report.results[name]
        assert result.detected and result.passed and result.tests_failed == 0, summary
        assert result.tests_passed >= 5, summary  # (the suite ran its tests, not a stand-in)
    for name in NOT_IMPLEMENTED:
        assert not report.results[name].detected, summary
    assert set(report.results) == BASE | EXTENDED | set(NOT_IMPLEMENTED)
    assert sum(p.is_dir() for p in made) >= len(BASE)  # (the savers wrote to disk)
