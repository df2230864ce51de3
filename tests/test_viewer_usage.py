"""Provider-reported usage on the viewer's token chart: the session's own ``usage_reported`` records (the usage
ledger) beside the store's estimate, placed at the request's seq, as of any seq, deduplicated, bounded on a
session with many reports, and replaceable by another usage provider."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from context_persistent import PersistentContextManager, read_usage  # noqa: E402
from context_persistent.model.projection import make_key  # noqa: E402
from context_persistent.viewer import Extensions  # noqa: E402
from context_persistent.viewer.app import create_app  # noqa: E402
from context_persistent.viewer.source import Source  # noqa: E402
from context_persistent.viewer.usage import USAGE_POINTS, UsageSeries, thin  # noqa: E402
from tests.viewer_sessions import build  # noqa: E402

TOKEN = "u" * 12 + "-usage-test-token-0123456789"


async def _reports(storage: Path, sid: str) -> list[dict[str, Any]]:
    """The session's usage_reported records, read straight from its log."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid, readonly=True) as store:
        out = []
        async for batch in store._log.read_batches():
            out += [r for r in batch if r["type"] == "usage_reported"]
        keys = list(store._state.keys)
    for r in out:
        r["at"] = sum(1 for k in keys if k < make_key(r["data"]["request_seq"] + 1))
    return out


async def _many(storage: Path, n: int) -> None:
    """A session of ``n`` requests, each answered by a report (written without fsync: it is only read here)."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="long", fsync="never") as store:
        for i in range(n):
            await store.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"})
            await store.get_messages_for_request()
            await store.record_usage({"input_tokens": 100 + (i % 7) * 10 + i, "output_tokens": 5},
                                     provider="openai", model="gpt-4o", id=f"resp_{i}")


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("viewer-usage") / "store"
    asyncio.run(build(root))
    asyncio.run(_many(root, USAGE_POINTS + 150))
    return root


@pytest.fixture(scope="module")
def client(storage: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Source(storage), TOKEN, port=8998), headers={"authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def _tokens(client: TestClient, sid: str, **params: Any) -> dict[str, Any]:
    r = client.get(f"/api/sessions/{sid}/tokens", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_chart_draws_each_reported_request_beside_the_estimate(client: TestClient, storage: Path) -> None:
    """Each report is on the chart with the provider's input tokens and the store's estimate as recorded, at the
    history position of the request's seq; the sum matches the usage ledger's."""
    reports = asyncio.run(_reports(storage, "agent"))
    assert len(reports) == 3
    usage = _tokens(client, "agent")["usage"]
    assert [(u["seq"], u["request_seq"], u["input_tokens"], u["estimated_tokens"], u["output_tokens"], u["at"],
             u["reports"]) for u in usage] == [
        (r["seq"], r["data"]["request_seq"], r["data"]["input_tokens"], r["data"]["estimated_tokens"],
         r["data"]["output_tokens"], r["at"], 1) for r in reports]
    assert all(u["input_tokens"] > u["estimated_tokens"] > 0 for u in usage)
    ledger = asyncio.run(read_usage(storage, "agent"))
    assert sum(u["input_tokens"] for u in usage) == ledger["total"]["input_tokens"]


def test_time_travel_shows_only_the_reports_made_by_then(client: TestClient, storage: Path) -> None:
    """As of a seq between two reports the chart has the earlier ones only; before the first, none."""
    seqs = [r["seq"] for r in asyncio.run(_reports(storage, "agent"))]
    assert [u["seq"] for u in _tokens(client, "agent", at=seqs[1])["usage"]] == seqs[:2]
    assert [u["seq"] for u in _tokens(client, "agent", at=seqs[1] - 1)["usage"]] == seqs[:1]
    assert _tokens(client, "agent", at=seqs[0] - 1)["usage"] == []


def test_a_session_with_more_reports_than_the_chart_has_points_is_thinned(client: TestClient) -> None:
    """A long session answers at most USAGE_POINTS entries, each the largest request of its run, standing for
    every report (their counts add up to all of them)."""
    usage = _tokens(client, "long")["usage"]
    assert len(usage) == USAGE_POINTS
    assert sum(u["reports"] for u in usage) == USAGE_POINTS + 150
    assert [u["seq"] for u in usage] == sorted(u["seq"] for u in usage)
    assert usage[-1]["input_tokens"] == max(u["input_tokens"] for u in usage)
    fewer = _tokens(client, "long", at=usage[99]["seq"])["usage"]
    assert len(fewer) < USAGE_POINTS and all(u["reports"] == 1 for u in fewer)


def test_a_report_id_seen_twice_is_drawn_once() -> None:
    """The series skips a report whose provider and id it has seen, as the ledger counts it once."""
    series = UsageSeries()
    rec = {"seq": 5, "type": "usage_reported", "data": {"provider": "p", "id": "r1", "input_tokens": 10,
                                                        "output_tokens": 1, "request_seq": 4}}
    assert series.note(rec) and not series.note({**rec, "seq": 9})
    assert series.note({**rec, "seq": 9, "data": {**rec["data"], "provider": "q"}})
    assert series.note({"seq": 11, "type": "usage_reported", "data": {"input_tokens": None, "output_tokens": 3}})
    assert [e["seq"] for e in series.select(None, 10)] == [5, 9, 11] and series.duplicates == 1
    assert series.select(10, 10)[-1] == {"seq": 9, "request_seq": 4, "input_tokens": 10, "estimated_tokens": None,
                                        "output_tokens": 1, "reports": 1}
    assert series.select(None, 10)[-1]["input_tokens"] is None and series.select(4, 10) == []


def test_the_anthropic_convention_counts_the_cached_part_of_the_request(tmp_path: Path) -> None:
    """The provider's count of a request adds the cache reads and writes to an Anthropic report's input (the
    ledger's rule), so it is comparable with the store's estimate of the whole request."""
    series = UsageSeries()
    series.note({"seq": 3, "type": "usage_reported", "data": {"provider": "anthropic", "input_tokens": 10,
                                                              "cache_read_tokens": 900, "cache_write_tokens": 50}})
    assert series.select(None, 5)[0]["input_tokens"] == 960


def test_another_usage_provider_replaces_the_log_and_is_held_to_the_bound(storage: Path) -> None:
    """A provider given in Extensions is asked instead, with the limit; more entries than that are thinned."""

    class Provider:
        async def usage(self, session_id: str, *, at_seq: int | None, limit: int) -> list[dict[str, Any]]:
            return [{"seq": 5, "request_seq": 4, "input_tokens": i, "estimated_tokens": None, "output_tokens": 1}
                    for i in range(2 * limit + 1)]

    app = create_app(Source(storage), TOKEN, port=8997, extensions=Extensions(usage=Provider()))
    with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        usage = _tokens(c, "agent")["usage"]
    assert len(usage) == USAGE_POINTS and sum(u["reports"] for u in usage) == 2 * USAGE_POINTS + 1
    assert usage[0]["at"] == 3 and usage[-1]["input_tokens"] == 2 * USAGE_POINTS
    assert thin([{"input_tokens": 1}], 5) == [{"input_tokens": 1}]
