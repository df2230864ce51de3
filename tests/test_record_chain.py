"""Every record names its predecessor (``prev``), the first one its session's root (codec.Links): splices,
reorders, deletions and records from another session are detected by open and by verify, whatever and wherever
they are; logs written before the chain (format 1) keep opening; repair removes a foreign record; PostgreSQL
rows are checked the same way."""

from __future__ import annotations

import asyncio
import tempfile
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pgfixtures import execute, pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import LogCorruptedError, PersistentContextManager, import_

from context_persistent.model import codec
from context_persistent.errors import RecordCorruptedError
from context_persistent.storage.log import scan
from context_persistent.storage.paths import LOG_NAME
from context_persistent.operations.repair import repair, verify

N = 8  # messages of session "a"; "b" has one more, so it holds a record with every seq of "a" and the next


async def _write(storage: Path, session_id: str, n: int, fsync: str = "always") -> list[bytes]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=session_id, fsync=fsync) as s:
        for i in range(n):
            await s.add_message({"role": "user" if i % 2 == 0 else "assistant", "content": f"{session_id} {i}"})
    return (storage / session_id / LOG_NAME).read_bytes().splitlines(keepends=True)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], list[bytes], Path]:
    root = tmp_path_factory.mktemp("chain")
    a = asyncio.run(_write(root / "base", "a", N))
    b = asyncio.run(_write(root / "base", "b", N + 1, fsync="batch"))
    return a, b, root


def _mutate(a: list[bytes], b: list[bytes], kind: str, i: int, j: int) -> list[bytes]:
    n = len(a)
    if kind == "foreign_append":  # another session's record with the next seq and a valid checksum
        return a + [b[n]]
    if kind == "foreign_replace":  # our record k replaced by theirs with the same seq
        return a[:i] + [b[i]] + a[i + 1:]
    if kind == "splice":  # our log up to k, then theirs from k on (seqs continue seamlessly)
        return a[:i] + b[i:j + 1]
    if kind == "delete":  # one record removed (not the last: a log that ends earlier is just shorter)
        return a[:i] + a[i + 1:]
    if kind == "delete_run":
        return a[:i] + a[j:]
    if kind == "swap":
        out = list(a)
        out[i], out[j] = out[j], out[i]
        return out
    if kind == "move":  # one record moved elsewhere
        out = list(a)
        out.insert(j, out.pop(i))
        return out
    raise AssertionError(kind)


@st.composite
def mutations(draw: Any) -> tuple[str, int, int]:
    n = N + 1  # records in "a": session_started + N messages
    kind = draw(st.sampled_from(["foreign_append", "foreign_replace", "splice", "delete", "delete_run", "swap",
                                 "move"]))
    if kind in ("foreign_replace", "splice"):
        i = draw(st.integers(0, n - 1))
        return kind, i, draw(st.integers(i, n))
    if kind == "delete":
        return kind, draw(st.integers(0, n - 2)), 0
    if kind == "delete_run":
        i = draw(st.integers(0, n - 2))
        return kind, i, draw(st.integers(i + 1, n - 1))
    if kind in ("swap", "move"):
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(0, n - 1).filter(lambda x: x != i))
        return kind, min(i, j) if kind == "swap" else i, max(i, j) if kind == "swap" else j
    return kind, 0, 0


async def _opens(storage: Path, session_id: str = "a") -> list[dict[str, Any]]:
    async with await PersistentContextManager.open(storage_path=storage, session_id=session_id,
                                                   readonly=True) as s:
        return await s.get_messages()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_splices_reorders_deletions_and_foreign_records_are_always_detected(
        logs: tuple[list[bytes], list[bytes], Path], mutation: tuple[str, int, int]) -> None:
    a, b, root = logs
    kind, i, j = mutation
    damaged = _mutate(a, b, kind, i, j)
    if damaged == a:
        return  # (a no-op mutation)
    storage = Path(tempfile.mkdtemp(dir=root))
    (storage / "a").mkdir(mode=0o700)
    log = storage / "a" / LOG_NAME
    log.write_bytes(b"".join(damaged))
    with pytest.raises(LogCorruptedError):
        asyncio.run(_opens(storage))
    report = verify(storage / "a", "a")
    assert not report.ok, (kind, i, j)
    assert log.read_bytes() == b"".join(damaged)  # nothing was changed by looking
    # repair keeps what is ours, quarantines the rest and records the gaps: the log then opens and verifies
    result = repair(storage / "a", "a")
    if result.unfixable:  # only when the first record is another session's: then nothing is changed
        assert [p.kind for p in result.unfixable] == ["session"] and damaged[0] == b[0] and not result.changed
        assert log.read_bytes() == b"".join(damaged)
        return
    messages = asyncio.run(_opens(storage))
    assert all(m["content"].startswith("a ") for m in messages)  # nothing of session "b" is loaded
    assert verify(storage / "a", "a").ok


async def test_a_foreign_record_appended_is_refused_and_repair_quarantines_it(
        logs: tuple[list[bytes], list[bytes], Path], tmp_path: Path) -> None:
    """The reported case: the other session's next-seq record (valid CRC) appended to ours."""
    a, b, _ = logs
    (tmp_path / "a").mkdir(mode=0o700)
    log = tmp_path / "a" / LOG_NAME
    log.write_bytes(b"".join(a) + b[len(a)])
    with pytest.raises(LogCorruptedError, match=rf"line {len(a) + 1} .*record seq {len(a) + 1} names crc"):
        await _opens(tmp_path)
    report = verify(tmp_path / "a", "a")
    assert [(p.kind, p.seq) for p in report.problems] == [("link", len(a) + 1)]
    result = repair(tmp_path / "a", "a")
    assert result.changed and [p.kind for p in result.quarantined] == ["link"]
    assert [m["content"] for m in await _opens(tmp_path)] == [f"a {i}" for i in range(N)]
    assert verify(tmp_path / "a", "a").ok
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="a") as s:
        await s.add_message({"role": "user", "content": "after the repair"})
    assert verify(tmp_path / "a", "a").ok


async def test_a_deleted_record_is_refused_and_repair_records_the_gap_it_leaves(
        logs: tuple[list[bytes], list[bytes], Path], tmp_path: Path) -> None:
    a, _, _ = logs
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "a" / LOG_NAME).write_bytes(b"".join(a[:3] + a[4:]))
    with pytest.raises(LogCorruptedError, match="record seq 5 names crc"):
        await _opens(tmp_path)
    assert not verify(tmp_path / "a", "a").ok
    result = repair(tmp_path / "a", "a")
    assert result.changed and [(g.after_seq, g.next_seq) for g in result.gaps] == [(3, 5)] and not result.quarantined
    assert len(await _opens(tmp_path)) == N - 1
    assert verify(tmp_path / "a", "a").ok


async def test_a_log_copied_into_another_session_folder_is_refused_and_never_repaired(
        logs: tuple[list[bytes], list[bytes], Path], tmp_path: Path) -> None:
    a, _, _ = logs
    (tmp_path / "c").mkdir(mode=0o700)
    (tmp_path / "c" / LOG_NAME).write_bytes(b"".join(a))
    with pytest.raises(LogCorruptedError, match="belongs to a log of another session id"):
        await _opens(tmp_path, "c")
    report = verify(tmp_path / "c", "c")
    assert [p.kind for p in report.problems] == ["session"] and "another session id" in report.problems[0].reason
    result = repair(tmp_path / "c", "c")
    assert not result.changed and [p.kind for p in result.unfixable] == ["session"]
    assert (tmp_path / "c" / LOG_NAME).read_bytes() == b"".join(a)


def _v1(seq: int, type_: str, data: dict[str, Any]) -> bytes:
    """A record as format 1 wrote it: no ``prev``."""
    body = b'{"v":1,"seq":%d,"ts":"2026-01-01T00:00:00.000000+00:00","type":"%s","data":%s' % (
        seq, type_.encode(), orjson.dumps(data))
    return b'%s,"crc":"%08x"}\n' % (body, zlib.crc32(b"}", zlib.crc32(body)))


def _v1_log(session_id: str, n: int) -> bytes:
    lines = [_v1(1, "session_started", {"format": 1, "tokenizer": "chars/4", "program": "context-persistent",
                                        "session_id": session_id})]
    lines += [_v1(i + 2, "message_added", {"message": {"role": "user", "content": f"old {i}"}}) for i in range(n)]
    return b"".join(lines)


async def test_a_format_1_log_keeps_opening_and_new_records_chain_onto_it(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir(mode=0o700)
    log = tmp_path / "old" / LOG_NAME
    old = _v1_log("old", 3)
    log.write_bytes(old)
    assert verify(tmp_path / "old", "old").ok
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="old",
                                                   checkpoint_every=1) as s:
        assert [m["content"] for m in await s.get_messages()] == ["old 0", "old 1", "old 2"]
        await s.add_message({"role": "user", "content": "new"})
    data = log.read_bytes()
    assert data.startswith(old)  # never rewritten
    new = [rec for rec, _ in scan(log)][4:]
    assert [rec["v"] for rec, _ in scan(log)] == [2, 2, 2, 2, 2]  # (format 1 records are upcast as read)
    assert new[0]["prev"] == codec.decode(old.splitlines(keepends=True)[-1])["crc"]
    assert verify(tmp_path / "old", "old").ok
    for readonly in (True, False):  # (from the checkpoint, then a full read)
        async with await PersistentContextManager.open(storage_path=tmp_path, session_id="old",
                                                       readonly=readonly) as s:
            assert [m["content"] for m in await s.get_messages()] == ["old 0", "old 1", "old 2", "new"]
        (tmp_path / "old" / "checkpoint.json").unlink(missing_ok=True)


async def test_format_1_records_spliced_after_chained_ones_are_detected(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir(mode=0o700)
    a = await _write(tmp_path, "s", 2)
    (tmp_path / "s" / LOG_NAME).write_bytes(b"".join(a) + _v1(4, "message_added",
                                                              {"message": {"role": "user", "content": "old"}}))
    with pytest.raises(LogCorruptedError, match="unchained"):
        await _opens(tmp_path, "s")
    assert [p.kind for p in verify(tmp_path / "s", "s").problems] == ["link"]


async def test_every_writer_chains_its_records(tmp_path: Path) -> None:
    """Stores (every fsync mode), forks, imports and repairs write records that verify clean."""
    for mode in ("always", "batch", "never"):
        await _write(tmp_path, f"w-{mode}", 5, fsync=mode)
        assert verify(tmp_path / f"w-{mode}", f"w-{mode}").ok
    async with await PersistentContextManager.open(storage_path=tmp_path, session_id="w-always") as s:
        s.hooks = None
        await s.pin(0)
        await s.fork("forked")
        await s.export(tmp_path / "x.jsonl")
    await import_(tmp_path / "x.jsonl", session_id="imported", storage_path=tmp_path)
    for sid_ in ("forked", "imported"):
        assert verify(tmp_path / sid_, sid_).ok
        assert [r["prev"] for r, _ in scan(tmp_path / sid_ / LOG_NAME)][0] == codec.root_crc(sid_).decode()


async def test_postgres_refuses_a_row_holding_another_sessions_record(pg_config: dict[str, Any], sid: str) -> None:
    """Rows are keyed by (session, seq), so seqs cannot be reordered or skipped; a record copied in from another
    session's log under the right key is caught by the chain."""
    other = sid + "-other"
    for s_id, n in ((sid, 3), (other, 4)):
        async with await PersistentContextManager.open(storage_path="unused", session_id=s_id, **pg_config) as s:
            for i in range(n):
                await s.add_message({"role": "user", "content": f"{s_id} {i}"})
    dsn, schema = pg_config["dsn"], pg_config["pg_schema"]
    await execute(dsn, f"INSERT INTO {schema}.events (session_id, seq, record) SELECT $1, seq, record "
                       f"FROM {schema}.events WHERE session_id = $2 AND seq = 5", sid, other)
    await execute(dsn, f"UPDATE {schema}.sessions SET last_seq = 5 WHERE session_id = $1", sid)
    with pytest.raises(RecordCorruptedError, match="record seq 5 names crc"):
        await PersistentContextManager.open(storage_path="unused", session_id=sid, readonly=True, **pg_config)
    await execute(dsn, f"DELETE FROM {schema}.checkpoints WHERE session_id = $1", sid)
    with pytest.raises(RecordCorruptedError, match="record seq 5 names crc"):
        await PersistentContextManager.open(storage_path="unused", session_id=sid, **pg_config)


async def test_missing_first_records_are_a_gap_from_zero_that_repair_records(
        logs: tuple[list[bytes], list[bytes], Path], tmp_path: Path) -> None:
    a, _, _ = logs
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "a" / LOG_NAME).write_bytes(b"".join(a[2:]))
    with pytest.raises(LogCorruptedError, match="record seq 3 is the log's first record .* records before it are missing"):
        await _opens(tmp_path)
    report = verify(tmp_path / "a", "a")
    assert [(g.after_seq, g.next_seq, g.explained) for g in report.gaps] == [(0, 3, False)] and not report.ok
    result = repair(tmp_path / "a", "a")
    assert result.changed and not result.unfixable
    assert [m["content"] for m in await _opens(tmp_path)] == [f"a {i}" for i in range(1, N)]
    assert verify(tmp_path / "a", "a").ok
