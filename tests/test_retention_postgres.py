"""Retention on PostgreSQL: the same policies and ledger as files, over the schema's sessions (each test in a
schema of its own: a policy applies to every session of a schema); SIGKILL of a process applying it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgfixtures import execute, pg_dsn, run_sql  # noqa: F401

from conftest import PYTHON
from context_persistent import PersistentContextManager, SessionTrashedError
from context_persistent.cli import main
from context_persistent.model.codec import Links, decode
from context_persistent.storage.pg.retention import apply_pg, list_trash_pg, plan_pg, purge_pg, restore_pg
from context_persistent.model.retention import RetentionPolicy

CHILD = Path(__file__).with_name("retention_child.py")


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:  # noqa: F811
    name = f"cp_ret_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield name
    run_sql(pg_dsn, f"DROP SCHEMA IF EXISTS {name} CASCADE")


async def _make(dsn: str, schema: str, sid: str, n: int = 3) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path="unused", session_id=sid, backend="postgres", dsn=dsn,
                                                pg_schema=schema, checkpoint_every=2)
    msgs = [{"role": "user", "content": f"{sid} {i}"} for i in range(n)]
    for m in msgs:
        await store.add_message(m)
    await store.close()
    return msgs


async def _rows(dsn: str, sql: str, *args: Any) -> list[Any]:
    return list(await execute(dsn, sql, *args))


async def _digest(dsn: str, schema: str, sid: str) -> str:
    rows = await _rows(dsn, f"SELECT record FROM {schema}.events WHERE session_id = $1 ORDER BY seq", sid)
    return "sha256:" + hashlib.sha256(b"".join(bytes(r["record"]) + b"\n" for r in rows)).hexdigest()


async def _ledger(dsn: str, schema: str) -> list[dict[str, Any]]:
    rows = await _rows(dsn, f"SELECT seq, record FROM {schema}.retention_ledger ORDER BY seq")
    recs = [decode(bytes(r["record"])) for r in rows]
    links = Links(".retention")
    for rec in recs:
        assert links.check(rec) is None
    return recs


async def test_apply_restore_purge(pg_dsn: str, schema: str) -> None:  # noqa: F811
    kept = {sid: await _make(pg_dsn, schema, sid) for sid in ("a", "b", "c")}
    digest = await _digest(pg_dsn, schema, "a")
    assert (await _rows(pg_dsn, f"SELECT count(*) AS n FROM {schema}.checkpoints WHERE session_id = 'a'"))[0]["n"] == 1
    p = await plan_pg(pg_dsn, schema, RetentionPolicy(max_sessions=1))
    assert [e.session_id for e in p.expire] == ["a", "b"]
    report = await apply_pg(pg_dsn, schema, RetentionPolicy(max_sessions=1, grace_days=1))
    assert [t["entry"] for t in report["trashed"]] == ["a~1", "b~2"]
    for table in ("sessions", "events", "checkpoints"):
        left = await _rows(pg_dsn, f"SELECT DISTINCT session_id FROM {schema}.{table}")
        assert {r["session_id"] for r in left} == {"c"}, table
    recs = await _ledger(pg_dsn, schema)
    assert [(r["type"], r["data"]["entry"]) for r in recs] == [("trashed", "a~1"), ("trashed", "b~2")]
    assert recs[0]["data"]["log"]["sha256"] == digest and recs[0]["data"]["rule"] == "max_sessions"
    with pytest.raises(SessionTrashedError, match="trash restore a~1"):
        await PersistentContextManager.open(storage_path="unused", session_id="a", dsn=pg_dsn, pg_schema=schema)
    with pytest.raises(SessionTrashedError):
        await PersistentContextManager.open(storage_path="unused", session_id="a", dsn=pg_dsn, pg_schema=schema,
                                            readonly=True)
    assert [r["entry"] for r in await list_trash_pg(pg_dsn, schema)] == ["a~1", "b~2"]
    await restore_pg(pg_dsn, schema, "a")
    store = await PersistentContextManager.open(storage_path="unused", session_id="a", dsn=pg_dsn, pg_schema=schema)
    assert await store.get_messages() == kept["a"]
    await store.add_message({"role": "user", "content": "after restore"})
    await store.close()
    out = await purge_pg(pg_dsn, schema, ["b~2"])
    assert out["purged"] == [] and out["refused"][0]["entry"] == "b~2"
    out = await purge_pg(pg_dsn, schema, ["b~2"], force=True, reason="gdpr")
    assert [p["entry"] for p in out["purged"]] == ["b~2"]
    assert await _rows(pg_dsn, f"SELECT * FROM {schema}.trash_events") == []
    assert [r["type"] for r in await _ledger(pg_dsn, schema)] == ["trashed", "trashed", "restored", "purged"]
    assert [r["state"] for r in await list_trash_pg(pg_dsn, schema, all_entries=True)] == ["restored", "purged"]


async def test_live_session_is_never_trashed_and_apply_on_open(pg_dsn: str, schema: str) -> None:  # noqa: F811
    for sid in ("old", "mid", "new"):
        await _make(pg_dsn, schema, sid)
    holder = await PersistentContextManager.open(storage_path="unused", session_id="old", dsn=pg_dsn,
                                                 pg_schema=schema)
    try:
        report = await apply_pg(pg_dsn, schema, RetentionPolicy(max_sessions=2))
        assert report["trashed"] == [] and [s["session_id"] for s in report["skipped"]] == ["old"]
        await holder.add_message({"role": "user", "content": "still here"})
    finally:
        await holder.close()
    store = await PersistentContextManager.open(storage_path="unused", session_id="old", dsn=pg_dsn, pg_schema=schema,
                                                retention={"max_sessions": 1, "apply_on_open": True})
    await store.close()
    left = await _rows(pg_dsn, f"SELECT session_id FROM {schema}.sessions ORDER BY session_id")
    assert [r["session_id"] for r in left] == ["old"]


def test_cli_against_a_dsn(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    for sid in ("x", "y"):
        asyncio.run(_make(pg_dsn, schema, sid))
    pg = ["--dsn", pg_dsn, "--pg-schema", schema]
    assert main(["retention", "apply", "--max-sessions", "1", *pg]) == 0
    assert "trashed x -> x~1" in capsys.readouterr().out
    assert main(["trash", "list", *pg]) == 0
    assert "x~1  trashed" in capsys.readouterr().out
    assert main(["trash", "restore", "x~1", *pg]) == 0
    assert main(["show", "x", *pg]) == 0
    assert "x 2" in capsys.readouterr().out


@pytest.mark.slow
async def test_kill_while_applying(pg_dsn: str, schema: str, subprocess_env: dict[str, str]) -> None:  # noqa: F811
    sids = [f"k{i}" for i in range(12)]
    for sid in sids:
        await _make(pg_dsn, schema, sid, n=40)
    digests = {sid: await _digest(pg_dsn, schema, sid) for sid in sids}
    rng = random.Random(16)
    killed = 0
    for _ in range(4):
        # killed inside the transaction of its 1st-3rd move (the ledger row written, not committed)
        proc = subprocess.Popen([PYTHON, str(CHILD), f"pg:{pg_dsn}:{schema}", "apply-pg", "in-transaction",
                                 str(rng.randint(1, 3))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=subprocess_env)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"START"
        proc.communicate(timeout=60)
        killed += proc.returncode == -signal.SIGKILL
        # every session is live (unchanged) or in the trash, recorded, with the same records; never both
        live = {r["session_id"] for r in await _rows(pg_dsn, f"SELECT session_id FROM {schema}.sessions")}
        trashed = {}
        if (await _rows(pg_dsn, "SELECT to_regclass($1) IS NOT NULL AS t", f"{schema}.trash"))[0]["t"]:
            trashed = {r["session_id"]: r["entry"] for r in await _rows(pg_dsn, f"SELECT * FROM {schema}.trash")}
        listed = {r["entry"]: r for r in await list_trash_pg(pg_dsn, schema)}
        for sid in sids:
            assert (sid in live) != (sid in trashed), sid
            if sid in live:
                assert await _digest(pg_dsn, schema, sid) == digests[sid]
            else:
                assert listed[trashed[sid]]["log"]["sha256"] == digests[sid]
                assert listed[trashed[sid]]["present"]
    assert killed == 4  # every round was killed inside a move
    report = await apply_pg(pg_dsn, schema, RetentionPolicy(max_sessions=1))
    assert len(await _rows(pg_dsn, f"SELECT session_id FROM {schema}.sessions")) == 1
    assert len(await list_trash_pg(pg_dsn, schema)) == 11 and report["skipped"] == []
