"""The usage command and the stats lines about where numbers come from, run as a user runs them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from tests.pgfixtures import pg_config, pg_dsn, pg_schema  # noqa: F401


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "context_persistent", *args], capture_output=True, text=True)


async def _sessions(storage: Path, prefix: str = "", **config: Any) -> None:
    for sid, model, cost in (("alpha", "claude-x", 0.25), ("beta", "gpt-4o", None)):
        store = await PersistentContextManager.open(storage_path=storage, session_id=prefix + sid, **config)
        await store.add_message({"role": "user", "content": "q"})
        await store.get_messages_for_request(token_budget=10_000)
        await store.record_usage({"input_tokens": 1_000_000, "output_tokens": 500_000, "cost_usd": cost},
                                 provider="anthropic" if cost else "openai", model=model)
        await store.add_message({"role": "assistant", "content": "a"})
        await store.close()


def test_usage_by_session_model_and_prices(tmp_path: Path) -> None:
    """Rows per session and per model with a total; a price table prices the report without a cost; --json;
    a bad --by or --since is a usage error."""
    asyncio.run(_sessions(tmp_path))
    out = _cli("--storage", str(tmp_path), "usage")
    assert out.returncode == 0, out.stderr
    assert "alpha" in out.stdout and "beta" in out.stdout and "$0.2500 (+1 unpriced)" in out.stdout
    prices = tmp_path.parent / "prices.json"
    prices.write_text(json.dumps({"models": {"gpt-4o*": {"input": 2.5, "output": 10.0}}}))
    doc = json.loads(_cli("--storage", str(tmp_path), "usage", "--by", "model", "--prices", str(prices),
                          "--json").stdout)
    assert {r["model"]: r["cost_usd"] for r in doc["rows"]} == {"claude-x": 0.25, "gpt-4o": 7.5}
    assert doc["total"]["cost_usd"] == 7.75 and doc["total"]["reports"] == 2
    one = json.loads(_cli("--storage", str(tmp_path), "usage", "alpha", "--json").stdout)
    assert [r["session"] for r in one["rows"]] == ["alpha"]
    later = json.loads(_cli("--storage", str(tmp_path), "usage", "--since", "2999-01-01", "--json").stdout)
    assert later["rows"] == [] and later["total"]["reports"] == 0
    assert _cli("--storage", str(tmp_path), "usage", "--since", "yesterday").returncode == 2
    assert _cli("--storage", str(tmp_path), "usage", "--by", "week").returncode == 2
    prices.write_text(json.dumps({"gpt-4o": 1}))
    bad = _cli("--storage", str(tmp_path), "usage", "--prices", str(prices))
    assert bad.returncode == 2 and "USD per million tokens" in bad.stderr


def test_stats_say_where_numbers_come_from(tmp_path: Path) -> None:
    """stats names the tokenizer's count, the calibration of the budget and the last reported usage."""
    asyncio.run(_sessions(tmp_path))
    out = _cli("--storage", str(tmp_path), "stats", "alpha")
    assert out.returncode == 0, out.stderr
    assert "counts exact (cl100k_base" in out.stdout or "counts estimated" in out.stdout
    assert "budget calibrated x" in out.stdout and "reported by the provider" in out.stdout
    doc = json.loads(_cli("--storage", str(tmp_path), "stats", "alpha", "--json").stdout)
    assert doc["sources"]["last_usage"] == "reported by the provider" and doc["calibration"]["reports"] == 1


def test_usage_on_postgres(tmp_path: Path, pg_config: dict[str, Any]) -> None:
    """The same ledger from the PostgreSQL backend (--dsn, --pg-schema)."""
    asyncio.run(_sessions(tmp_path, "usage-cli-", **pg_config))
    pg = ("--dsn", pg_config["dsn"], "--pg-schema", pg_config["pg_schema"], "--json")
    doc = json.loads(_cli("usage", *pg, "--by", "model").stdout)
    assert {r["model"] for r in doc["rows"]} >= {"claude-x", "gpt-4o"}
    one = json.loads(_cli("usage", "usage-cli-alpha", *pg).stdout)
    assert one["total"]["cost_usd"] == 0.25 and one["total"]["input_tokens"] == 1_000_000
