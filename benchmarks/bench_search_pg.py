"""Search on PostgreSQL (docs/search.md, "PostgreSQL"): building the search tables from the logs, search
latency with the ``tsvector`` + GIN index the backend uses, and the alternative it was chosen over, a
``pg_trgm`` GIN index on the same texts (``ILIKE '%word%'``), measured side by side on the same rows.

Data: sessions of the 4 KB agent mix written to PostgreSQL (``search_pg_mb`` MB of records: 10 with
``--quick``, 50 by default). The server is $CONTEXT_PERSISTENT_BENCH_DSN, else $CONTEXT_PERSISTENT_TEST_DSN,
else the local test server; a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

from ._harness import Ctx, Row, Skip, compare, info, percentile
from .bench_postgres import _drop, _dsn, _probe
from .bench_search import latency_rows
from .search_queries import CLASSES, legacy_queries, queries, topic_messages

GROUP = "search"
_PER_SESSION = 1000


async def _write(dsn: str, schema: str, total: int, tmp: Any) -> int:
    from context_persistent import PersistentContextManager
    from context_persistent.storage.pg import session_bytes

    written = n = 0
    while written < total:
        async with await PersistentContextManager.open(storage_path=tmp, session_id=f"s{n:04d}", backend="postgres",
                                                       dsn=dsn, pg_schema=schema, search_index=False) as store:
            for m in topic_messages(_PER_SESSION, seed=n + 1):
                await store.add_message(m)
        written += await session_bytes(dsn, schema, f"s{n:04d}")
        n += 1
    return written


async def _run(ctx: Ctx, dsn: str, schema: str) -> list[Row]:
    from context_persistent.operations.search import rebuild_index, search
    from context_persistent.operations.search.pg_index import PgIndex
    from context_persistent.storage.pg import connect

    mb_target = ctx.size("search_pg_mb")
    ctx.log(f"writing {mb_target} MB of agent-mix records to PostgreSQL")
    written = await _write(dsn, schema, mb_target << 20, ctx.tempdir("search-pg"))
    mb = written / (1 << 20)
    t = time.perf_counter()
    await rebuild_index(None, dsn=dsn, pg_schema=schema)
    build = time.perf_counter() - t
    rows: list[Row] = [info(GROUP, f"PostgreSQL: index build rate ({mb:,.0f} MB of records)", mb / build, "MB/s")]
    index = PgIndex(dsn, schema)
    size = await index.size_bytes()
    await index.aclose()
    rows.append(info(GROUP, "PostgreSQL: search tables' size against the records' size", size / written * 100, "%"))
    await search(None, "warmup", dsn=dsn, pg_schema=schema, catch_up=False)
    lat: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in CLASSES}
    for cls, q in queries(random.Random(3), ctx.size("search_queries")):
        for exhaustive in ((False, True) if len(lat[cls][0]) % 2 == 0 else (True, False)):  # (search_latencies)
            t = time.perf_counter()
            await search(None, q, dsn=dsn, pg_schema=schema, catch_up=False, exhaustive=exhaustive)
            lat[cls][exhaustive].append((time.perf_counter() - t) * 1000)
    rows += latency_rows(GROUP, f"PostgreSQL, {mb:,.0f} MB: ", lat)
    ours = [x for w, _ in lat.values() for x in w]
    legacy = legacy_queries(random.Random(3), 100)
    # the alternative: trigrams over the same texts (a word as a substring; no phrases, prefixes or ranking)
    conn = await connect(dsn)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        t = time.perf_counter()
        await conn.execute(f"CREATE INDEX search_docs_trgm ON {schema}.search_docs USING gin (body gin_trgm_ops)")
        trgm_build = time.perf_counter() - t
        trgm_size = await conn.fetchval(f"SELECT pg_relation_size('{schema}.search_docs_trgm')")
        gin_size = await conn.fetchval(f"SELECT pg_relation_size('{schema}.search_docs_tsv')")
        from context_persistent.operations.search.pg_text import compile_query

        raw = []
        for q in legacy:
            tsq = compile_query(q)[0]
            t = time.perf_counter()
            await conn.fetch(f"SELECT id, session_id, key FROM {schema}.search_docs WHERE tsv @@ $1::tsquery LIMIT 20",
                             tsq)
            raw.append((time.perf_counter() - t) * 1000)
        trgm = []
        for q in legacy:
            word = q.split()[0].strip('"*')
            t = time.perf_counter()
            await conn.fetch(f"SELECT id, session_id, key FROM {schema}.search_docs WHERE body ILIKE $1 LIMIT 20",
                             f"%{word}%")
            trgm.append((time.perf_counter() - t) * 1000)
    finally:
        await conn.close()
    rows.append(compare(GROUP, f"PostgreSQL: search p50 ({mb:,.0f} MB, every class, 20 hits, checked, snippets)",
                        [percentile(ours, 50)], [percentile(trgm, 50)], unit="ms",
                        ref_name="pg_trgm GIN, ILIKE '%first word%' (ids only)"))
    rows.append(compare(GROUP, "PostgreSQL: tsvector @@ query alone, ids only, unranked (p50)", [percentile(raw, 50)],
                        [percentile(trgm, 50)], unit="ms", ref_name="pg_trgm GIN, ILIKE '%first word%' (ids only)"))
    rows.append(compare(GROUP, "PostgreSQL: GIN index size, tsvector", [gin_size / (1 << 20)], [trgm_size / (1 << 20)],
                        unit="MB", ref_name="pg_trgm GIN on the same texts"))
    rows.append(info(GROUP, "PostgreSQL: pg_trgm GIN build (for comparison)", trgm_build, "s"))
    return rows


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"search_pg_mb": 10, "search_queries": 10}, full={"search_pg_mb": 50, "search_queries": 25})
    dsn = _dsn()
    try:
        asyncio.run(_probe(dsn))
    except Exception as e:
        raise Skip(f"no PostgreSQL at {dsn}: {e}") from None
    schema = f"cp_bench_search_{uuid.uuid4().hex[:8]}"
    try:
        return asyncio.run(_run(ctx, dsn, schema))
    finally:
        asyncio.run(_drop(dsn, schema))
