"""PostgreSQL test fixtures: a reachable server (else skip, or fail in CI) and a throwaway schema.

The DSN comes from $CONTEXT_PERSISTENT_TEST_DSN (default postgresql://postgres@127.0.0.1:5432/test). With
$CONTEXT_PERSISTENT_REQUIRE_POSTGRES=1 (set by .ci/run) an unreachable server fails the tests instead of
skipping them. Every test run gets its own schema, dropped at the end; tests use unique session ids.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

DEFAULT_TEST_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def _unavailable(reason: str) -> None:
    if os.environ.get("CONTEXT_PERSISTENT_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"PostgreSQL is required (CONTEXT_PERSISTENT_REQUIRE_POSTGRES=1) but {reason}", pytrace=False)
    pytest.skip(f"no PostgreSQL: {reason}")


async def _probe(dsn: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=3)
    await conn.close()


async def execute(dsn: str, sql: str, *args: Any) -> Any:
    """Run one statement on a fresh connection (inside a test's loop)."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def run_sql(dsn: str, sql: str, *args: Any) -> Any:
    """Run one statement on a fresh connection, outside any test loop."""
    return asyncio.run(execute(dsn, sql, *args))


_checked: dict[str, str | None] = {}


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    dsn = os.environ.get("CONTEXT_PERSISTENT_TEST_DSN") or DEFAULT_TEST_DSN
    if dsn not in _checked:
        try:
            import asyncpg  # noqa: F401
        except ImportError:
            _checked[dsn] = "asyncpg is not installed (pip install asyncpg)"
        else:
            try:
                asyncio.run(_probe(dsn))
                _checked[dsn] = None
            except Exception as e:
                _checked[dsn] = f"{dsn} is not reachable ({type(e).__name__}: {e})"
    if _checked[dsn] is not None:
        _unavailable(_checked[dsn])
    return dsn


@pytest.fixture(scope="session")
def pg_schema(pg_dsn: str) -> Iterator[str]:
    name = f"cp_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield name
    run_sql(pg_dsn, f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.fixture
def pg_config(pg_dsn: str, pg_schema: str) -> dict[str, str]:
    """Manager/mount configuration selecting the postgres backend in the run's schema."""
    return {"backend": "postgres", "dsn": pg_dsn, "pg_schema": pg_schema}


@pytest.fixture
def sid() -> str:
    """A session id no other test uses."""
    return f"t-{uuid.uuid4().hex[:12]}"
