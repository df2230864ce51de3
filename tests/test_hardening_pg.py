"""PostgreSQL connection secrets and connect failures: passwords never shown, timeouts explained."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.errors import DatabaseError
from context_persistent.storage.pg import connect, redact_dsn, resolve_dsn

from pgfixtures import pg_dsn, pg_schema, sid  # noqa: F401

SECRET = "s3cret-Pw"


@pytest.mark.parametrize("dsn, shown", [
    (f"postgresql://u@h/db?password={SECRET}", "postgresql://u@h/db?password=***"),
    (f"postgresql://u:{SECRET}@h:5433/db", "postgresql://u:***@h:5433/db"),
    (f"postgresql://u:{SECRET}@h/db?sslmode=require&password={SECRET}&sslpassword={SECRET}",
     "postgresql://u:***@h/db?sslmode=require&password=***&sslpassword=***"),
    (f"postgres:///db?host=/run/pg&PASSWORD={SECRET}", "postgres:///db?host=/run/pg&PASSWORD=***"),
    (f"postgresql://u@h:99999999/db?password={SECRET}", "postgresql://u@h:99999999/db?password=***"),
    ("postgresql://u@h/db?sslmode=require", "postgresql://u@h/db?sslmode=require"),
])
def test_redact_dsn_masks_every_password(dsn: str, shown: str) -> None:
    """Passwords in the userinfo part and in the query string are masked; everything else is kept."""
    assert redact_dsn(dsn) == shown
    assert SECRET not in redact_dsn(dsn)


def test_a_bad_dsn_error_does_not_show_its_password() -> None:
    """The error for a DSN that is not a postgresql:// URL masks its password too."""
    with pytest.raises(ValueError) as e:
        resolve_dsn(f"mysql://u:{SECRET}@h/db?password={SECRET}")
    assert SECRET not in str(e.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens on it once closed


async def test_connect_errors_do_not_show_a_query_password(storage: Any) -> None:
    """A refused connection names where it tried, without the password in the DSN's query string."""
    pytest.importorskip("asyncpg")
    dsn = f"postgresql://u@127.0.0.1:{_closed_port()}/db?password={SECRET}"
    with pytest.raises(DatabaseError) as e:
        await PersistentContextManager.open(storage_path=storage, session_id="s", dsn=dsn)
    assert SECRET not in str(e.value)
    assert e.value.__cause__ is None or SECRET not in str(e.value.__cause__)
    assert "127.0.0.1" in str(e.value)


async def test_a_connect_timeout_says_what_happened() -> None:
    """A server that accepts but never answers: the error says it timed out, where, and after how long."""
    pytest.importorskip("asyncpg")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)  # accepts the TCP handshake (the kernel does), never speaks PostgreSQL
    port = server.getsockname()[1]
    try:
        with pytest.raises(DatabaseError) as e:
            await connect(f"postgresql://u@127.0.0.1:{port}/db?password={SECRET}", timeout=0.3)
    finally:
        server.close()
    message = str(e.value)
    assert not message.rstrip().endswith(":"), message
    assert "timed out after 0.3 s" in message
    assert f"127.0.0.1:{port}" in message
    assert SECRET not in message


async def test_store_path_stats_and_logs_do_not_show_a_query_password(pg_dsn: str, pg_schema: str, sid: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """With ``?password=`` in the DSN, the store's path, stats, repr and log lines never contain it."""
    dsn = pg_dsn + ("&" if "?" in pg_dsn else "?") + f"password={SECRET}"  # (trust auth: it is not checked)
    caplog.set_level(logging.DEBUG)
    store = await PersistentContextManager.open(storage_path="unused", session_id=sid, dsn=dsn, pg_schema=pg_schema)
    try:
        await store.add_message({"role": "user", "content": "hi"})
        shown = [str(store.path), str(store.stats()), repr(store)]
    finally:
        await store.close()
    assert all(SECRET not in s for s in shown), shown
    assert "password=***" in str(store.path)
    assert SECRET not in caplog.text


def test_tail_follow_waits_for_a_database_session_that_does_not_exist_yet(pg_dsn: str, pg_schema: str, sid: str,
                                                                           subprocess_env: dict[str, str]) -> None:
    """``tail -f --dsn`` on a missing session waits (saying so), then prints its events once it is created."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "context_persistent", "tail", sid, "-f", "--dsn", pg_dsn, "--until-seq", "2",
           "--timeout", "30", "--json"]
    env = {**subprocess_env, "CONTEXT_PERSISTENT_PG_SCHEMA": pg_schema}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert f"waiting for session {sid!r}" in line, line + proc.stderr.read()

        async def write() -> None:
            async with await PersistentContextManager.open(storage_path="unused", session_id=sid, dsn=pg_dsn,
                                                           pg_schema=pg_schema) as store:
                await store.add_message({"role": "user", "content": "late"})

        asyncio.run(write())
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    seqs = [__import__("json").loads(x)["seq"] for x in out.splitlines()]
    assert seqs == [1, 2] and '"late"' in out
