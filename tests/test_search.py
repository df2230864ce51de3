"""The search projection (docs/search.md): the index equals a rebuild from the logs after any sequence of
operations, never shows (nor keeps in its files) what the log no longer shows, and the query language."""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

from context_persistent import PersistentContextManager, QueryError, SessionTrashedError, list_sessions, search
from context_persistent.operations import trash
from context_persistent.model.retention import RetentionPolicy
from context_persistent.operations.search.indexer import catch_up_storage, rebuild
from context_persistent.operations.search.sqlite_index import SqliteIndex, index_path
from pgfixtures import pg_dsn, run_sql  # noqa: F401
from search_backends import FileBackend, PgBackend, fresh_schema


def _contents(storage: Path, path: Path | None = None) -> dict[str, Any]:
    index = SqliteIndex(storage, path)
    try:
        return index.contents()
    finally:
        index.close()


async def _caught_up(storage: Path) -> dict[str, Any]:
    index = SqliteIndex(storage)
    try:
        await catch_up_storage(index, storage)
        return index.contents()
    finally:
        index.close()


def _index_bytes(storage: Path) -> bytes:
    folder = index_path(storage).parent
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


async def _rebuilt(storage: Path) -> dict[str, Any]:
    await rebuild(storage)
    return _contents(storage)


def _msg(rng: random.Random, n: int) -> dict[str, Any]:
    words = ["alpha", "kubernetes", "ingress", "数据库连接", "שלום", "🚀 launch", "pool", "deploy"]
    kind = rng.randrange(4)
    text = f"w{n} " + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))
    if kind == 0:
        return {"role": "user", "content": text}
    if kind == 1:
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    if kind == 2:
        return {"role": "tool", "tool_call_id": f"c{n}", "name": "bash", "content": text}
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@pytest.fixture(params=["file", "postgres"])
def backend(request: pytest.FixtureRequest, storage: Path, tmp_path: Path) -> Iterator[Any]:
    """The search index on each backend (PostgreSQL in a schema of its own: retention acts on all of one)."""
    if request.param == "file":
        yield FileBackend(storage)
        return
    dsn = request.getfixturevalue("pg_dsn")
    schema = fresh_schema()
    yield PgBackend(dsn, schema, tmp_path)
    run_sql(dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.parametrize("seed", range(6))
async def test_the_index_equals_a_rebuild_after_random_operations(backend: Any, seed: int) -> None:
    """After random appends, clears, replacements, redactions, pins, system prompts, erasures and trash/restore
    over three sessions, catching up gives exactly what a rebuild from the logs gives, at every step, on the
    file backend and on PostgreSQL."""
    rng = random.Random(seed)
    n = 0
    for step in range(8):
        sid = f"s{rng.randrange(3)}"
        op = rng.choice(["append", "append", "clear", "replace", "redact", "pin", "prompt", "erase", "trash"])
        if op == "trash":
            if await backend.has(sid):
                await backend.trash(RetentionPolicy(max_sessions=2))
            if rng.random() < 0.5:
                await backend.restore_one()
        else:
            try:
                store = await backend.open(sid, search_index=rng.random() < 0.7)
            except SessionTrashedError:
                while await backend.restore_one() and not await backend.has(sid):
                    pass
                store = await backend.open(sid, search_index=rng.random() < 0.7)
            async with store:
                for _ in range(rng.randrange(1, 5)):
                    n += 1
                    await store.add_message(_msg(rng, n))
                count = len(await store.get_messages())
                if op == "clear":
                    await store.clear()
                elif op == "replace" and count:
                    kept = (await store.get_messages())[: rng.randrange(count)]
                    await store.replace_messages(kept + [_msg(rng, n + 1000)])
                elif op == "redact" and count:
                    await store.redact(rng.randrange(count))
                elif op == "pin" and count:
                    await store.pin(rng.randrange(count))
                elif op == "prompt":
                    await store.add_message({"role": "system", "content": f"prompt {n} be brief"})
                elif op == "erase" and count:
                    await store.erase(rng.randrange(count))
        if rng.random() < 0.6:
            assert await backend.caught_up() == await backend.rebuilt(), f"step {step} ({op})"
    assert await backend.caught_up() == await backend.rebuilt()


async def test_the_writer_keeps_the_index_current_off_the_request_path(storage: Path) -> None:
    """A session written and closed is in the index without any reader catching it up, clears and
    replacements included (the writer's thread, with the history's keys it hands over)."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
        await store.add_message({"role": "user", "content": "first about pelicans"})
        await store.add_message({"role": "assistant", "content": "pelicans fly"})
        await store.clear()
        await store.add_message({"role": "user", "content": "now about herons"})
    hits = await search(storage, "herons", catch_up=False)
    assert [(h.session_id, h.seq) for h in hits] == [("w", 5)]
    assert await search(storage, "pelicans", catch_up=False) == []
    assert len(await search(storage, "pelicans", catch_up=False, all_messages=True)) == 2
    assert _contents(storage) == await _rebuilt(storage)


async def test_appends_do_not_count_the_sessions_documents_again(storage: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A catch-up of appends alone carries the session's message count and title forward (every new document
    is in the views, the title is older) instead of counting every document of the session (``view_facts``,
    O(documents): 25-30 ms at 100k messages, at every close of the Amplifier CLI's turn); anything else
    counts them. Either way the index equals a rebuild."""
    calls: list[str] = []
    real = SqliteIndex.view_facts

    async def counted(self: SqliteIndex, sid: str) -> Any:
        calls.append(sid)
        return await real(self, sid)
    monkeypatch.setattr(SqliteIndex, "view_facts", counted)
    async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
        await store.add_message({"role": "system", "content": "be brief"})
        await store.add_message({"role": "user", "content": "first about pelicans"})
    assert calls == ["w"]
    async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
        await store.add_message({"role": "assistant", "content": "pelicans fly"})
        await store.add_message({"role": "user", "content": "and herons?"})
    assert calls == ["w"]
    assert _contents(storage) == await _rebuilt(storage)
    calls.clear()
    async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
        await store.set_messages([{"role": "user", "content": "only herons"}], reason="a new start")
    assert calls == ["w"]
    assert _contents(storage) == await _rebuilt(storage)


async def test_erased_redacted_and_trashed_text_leaves_the_index_files(storage: Path) -> None:
    """An erased, a redacted and a trashed message are found by no search and their words are in no byte of
    the index's files (the database, its write-ahead log, its shared memory), while other text stays."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="p") as store:
        await store.add_message({"role": "user", "content": "keep zzkeepword here"})
        await store.add_message({"role": "user", "content": "my password is qqerasedword"})
        await store.add_message({"role": "user", "content": "and vvredactedword too"})
        await store.add_message({"role": "user", "content": "again vvredactedword too"})
    async with await PersistentContextManager.open(storage_path=storage, session_id="gone") as store:
        await store.add_message({"role": "user", "content": "a session about yytrashedword"})
    for word in ("zzkeepword", "qqerasedword", "vvredactedword", "yytrashedword"):
        assert await search(storage, word, all_messages=True), word
    async with await PersistentContextManager.open(storage_path=storage, session_id="p") as store:
        await store.redact(seq=4)
        await store.redact(seq=5)
        await store.clear()  # (out of the views: still searchable with all_messages until erased)
        receipt = await store.erase(seq=3)
        assert receipt["index"]["action"] == "purged"
        assert await store.verify_erasure(receipt) == []
    await trash.apply_file(storage, RetentionPolicy(max_sessions=1))  # ("p" was active last)
    assert not (storage / "gone").exists()
    for word in ("qqerasedword", "vvredactedword", "yytrashedword"):
        assert await search(storage, word, all_messages=True) == [], word
        assert word.encode() not in _index_bytes(storage), word
    assert await search(storage, "zzkeepword", all_messages=True)
    assert b"zzkeepword" in _index_bytes(storage)


async def test_expired_segments_leave_the_index(storage: Path) -> None:
    """Messages of expired segments leave the index (and its files); the carried system prompt stays."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="seg", segment_bytes=4096) as s:
        await s.add_message({"role": "system", "content": "be brief ppromptword"})
        for i in range(60):
            await s.add_message({"role": "user", "content": f"message {i} xexp{i}word " + "s" * 300})
    assert await search(storage, "xexp0word")
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert await search(storage, "xexp0word") == [] and b"xexp0word" not in _index_bytes(storage)
    assert await search(storage, "xexp59word") and await search(storage, "ppromptword")
    assert _contents(storage) == await _rebuilt(storage)


async def test_a_damaged_or_lost_index_is_rebuilt_never_trusted(storage: Path) -> None:
    """A garbage index file, or a lost one, is built again from the logs; a document the log does not hold
    (an index changed behind the log's back) is never returned as a hit."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="d") as store:
        await store.add_message({"role": "user", "content": "about otters"})
    expected = await _rebuilt(storage)
    index_path(storage).write_bytes(b"not a database at all" * 100)
    assert [h.seq for h in await search(storage, "otters")] == [2]
    assert _contents(storage) == expected
    for p in index_path(storage).parent.iterdir():
        p.unlink()
    assert [h.seq for h in await search(storage, "otters")] == [2]
    db = sqlite3.connect(index_path(storage))
    db.execute("UPDATE docs SET fp = x'00'")  # the index no longer agrees with the log
    db.commit()
    db.close()
    assert [h.seq for h in await search(storage, "otters")] == [2]
    assert _contents(storage) == expected


async def test_unicode_huge_outputs_and_filters(storage: Path) -> None:
    """CJK words inside sentences, RTL text and text around emoji are found; a 3 MB tool output is indexed up
    to its first MiB; role, session and since filter; ls lists counts, sizes, times and the title."""
    huge = "startmarker " + "x " * 1_500_000 + " endmarker"
    async with await PersistentContextManager.open(storage_path=storage, session_id="u") as store:
        await store.add_message({"role": "user", "content": "我们讨论了数据库连接池的问题"})
        await store.add_message({"role": "assistant", "content": "שלום עולם and 🚀 rocketword"})
        await store.add_message({"role": "tool", "tool_call_id": "1", "name": "bash", "content": huge})
    assert [h.seq for h in await search(storage, "数据库")] == [2]
    assert "[数据库]" in (await search(storage, "数据库"))[0].snippet
    assert [h.seq for h in await search(storage, "עולם")] == [3]
    assert [h.seq for h in await search(storage, "rocketword")] == [3]
    assert [h.seq for h in await search(storage, "startmarker")] == [4]
    assert await search(storage, "endmarker") == []  # (beyond the first MiB of text)
    assert [h.seq for h in await search(storage, "tools:bash")] == [4]
    assert await search(storage, "rocketword", role="user") == []
    assert await search(storage, "rocketword", session_id="other") == []
    assert await search(storage, "rocketword", since="2999-01-01") == []
    assert await search(storage, "rocketword", since="1d")
    [row] = await list_sessions(storage)
    assert row["messages"] == 3 and row["events"] == 4 and row["title"] == "我们讨论了数据库连接池的问题"
    assert row["bytes"] == (storage / "u" / "events.jsonl").stat().st_size and row["first_ts"] <= row["last_ts"]
    assert os.stat(index_path(storage)).st_mode & 0o777 == 0o600
    assert os.stat(index_path(storage).parent).st_mode & 0o777 == 0o700


HOSTILE = ['"', '"""', "(", ")", "AND", "OR OR", "NOT", "a AND", "NEAR(", "NEAR(a b, -1)", "*", "**", "a**",
           "body:", "nosuch:x", "{body tools}:x", "x" * 5000, "\x00", "'; DROP TABLE docs; --", "^", "a:b:c",
           "\u2063", "(((((((((((((((a)))))))))))))))" * 20, "-", "+", "\\", "🚀", "数*", "a OR (b AND NOT c",
           "NEAR(a b, 99999999999999999999)", "\ud800", "   ", ""]


@pytest.mark.parametrize("query", HOSTILE)
async def test_hostile_queries_are_an_error_or_an_answer(storage: Path, query: str) -> None:
    """Every hostile query either runs or raises QueryError with a one-line message; the index is unchanged."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="h") as store:
        await store.add_message({"role": "user", "content": "a b c plain text"})
    before = await _caught_up(storage)
    try:
        await search(storage, query)
    except QueryError as e:
        assert "\n" not in str(e) and str(e)
    assert _contents(storage) == before


def test_query_language_passes_fts5_through_and_quotes_punctuation() -> None:
    """Operators, phrases, prefixes and columns pass through; punctuation inside a word makes a phrase."""
    from context_persistent.operations.search.text import translate

    assert translate('"connection refused" AND postgres*') == '"connection refused" AND postgres*'
    assert translate("can't") == '"can t"'
    assert translate("tools:bash OR NOT x") == "tools:bash OR NOT x"
    with pytest.raises(QueryError, match="unknown column"):
        translate("{body nosuch}:x")


async def test_a_storage_whose_index_cannot_be_written_is_still_searched_and_listed(
        storage: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """When the storage's index cannot be written (the index file refuses writes), search and ls work on a
    private temporary index built from the logs, with one warning, and leave nothing behind."""
    import tempfile

    async with await PersistentContextManager.open(storage_path=storage, session_id="ro",
                                                   search_index=False) as store:
        await store.add_message({"role": "user", "content": "readonly otters"})
    real = SqliteIndex._connect

    def refuse(self: SqliteIndex) -> sqlite3.Connection:
        if self.path == index_path(storage):
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real(self)

    monkeypatch.setattr(SqliteIndex, "_connect", refuse)
    # A temporary folder of this test's own: the system's is shared with every other process (an xdist worker,
    # another run), whose files would come and go in it. The spy checks the index was made there.
    private = storage.parent / "tmp"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def spy(*args: Any, **kwargs: Any) -> str:
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    assert [h.seq for h in await search(storage, "otters")] == [2]
    [row] = await list_sessions(storage)
    assert row["title"] == "readonly otters" and row["messages"] == 1
    warned = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warned) == 2 and "temporary index" in warned[0]
    assert len(made) == 2 and all(Path(m).parent == private for m in made)
    assert list(private.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder: the permission cannot be tested")
async def test_a_read_only_storage_folder_is_searched(storage: Path) -> None:
    """A storage folder without write permission (no index yet): search and ls still work."""
    async with await PersistentContextManager.open(storage_path=storage, session_id="ro",
                                                   search_index=False) as store:
        await store.add_message({"role": "user", "content": "readonly otters"})
    os.chmod(storage, 0o500)
    try:
        assert [h.seq for h in await search(storage, "otters")] == [2]
        assert [r["session_id"] for r in await list_sessions(storage)] == ["ro"]
    finally:
        os.chmod(storage, 0o700)


async def test_a_closed_store_leaves_no_write_ahead_log_behind(storage: Path) -> None:
    """Once a store's close has waited for the writer's thread and nothing else waits, the thread's SQLite
    connection is closed: its write-ahead log is checkpointed and removed. A process that exits right after (a
    CLI turn) so leaves none for the next one to recover and append to (it grew by every turn's pages)."""
    wal = Path(f"{index_path(storage)}-wal")
    for turn in range(3):
        async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
            await store.add_message({"role": "user", "content": f"turn {turn} about herons"})
            await store.add_message({"role": "assistant", "content": "herons wade"})
        assert index_path(storage).exists() and not wal.exists(), turn
    assert len(await search(storage, "herons", catch_up=False)) == 6


class _HostCoordinator:
    session_id = "h"
    hooks = None

    async def mount(self, point: str, instance: Any) -> None:
        self.context = instance


async def test_the_amplifier_hosts_close_leaves_the_work_not_begun_to_readers(storage: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The Amplifier mount's close (a CLI turn is a process) withdraws the index's catch-up the writer's thread has
    not begun (its quiet period after the appends) instead of waiting for it: nothing is written to the index
    then, no write-ahead log is left, and a reader's catch-up finds the records (docs/search.md)."""
    from context_persistent.integrations.amplifier import mount
    from context_persistent.operations.search import background

    monkeypatch.setattr(background, "QUIET", 30.0)  # (the thread's work never begins before the close)
    monkeypatch.setattr(background, "MAX_DELAY", 60.0)
    coordinator = _HostCoordinator()
    cleanup = await mount(coordinator, {"storage_path": str(storage)})
    await coordinator.context.add_message({"role": "user", "content": "about herons"})
    await coordinator.context.add_message({"role": "assistant", "content": "herons wade"})
    await cleanup()
    assert not index_path(storage).exists()
    assert not Path(f"{index_path(storage)}-wal").exists()
    assert len(await search(storage, "herons")) == 2  # (the reader catches up)
    assert _contents(storage) == await _rebuilt(storage)


async def test_the_amplifier_hosts_close_waits_while_the_thread_holds_the_index_open(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the writer's thread has indexed something of the process (its connection to the index is open: a
    real model's reply gives it the time), the Amplifier mount's close waits for the rest as the library's does,
    so the thread closes its connection and leaves no write-ahead log for the next process."""
    from context_persistent.integrations.amplifier import mount
    from context_persistent.operations.search import background

    monkeypatch.setattr(background, "QUIET", 0.0)
    coordinator = _HostCoordinator()
    cleanup = await mount(coordinator, {"storage_path": str(storage)})
    await coordinator.context.add_message({"role": "user", "content": "about egrets"})
    for _ in range(500):  # (until the thread has indexed the prompt: at most 5 s)
        if index_path(storage).exists() and await search(storage, "egrets", catch_up=False):
            break
        await asyncio.sleep(0.01)
    assert len(await search(storage, "egrets", catch_up=False)) == 1
    monkeypatch.setattr(background, "QUIET", 30.0)  # (the answer's work would begin only after the close)
    monkeypatch.setattr(background, "MAX_DELAY", 60.0)
    await coordinator.context.add_message({"role": "assistant", "content": "egrets wade too"})
    await cleanup()
    assert len(await search(storage, "egrets", catch_up=False)) == 2
    assert not Path(f"{index_path(storage)}-wal").exists()


async def test_a_close_waits_for_the_writers_thread_on_the_event_loop(storage: Path) -> None:
    """The close waits for the session's indexing without a thread of the event loop's executor (which it would
    start, with its shutdown at the loop's end, for that one wait: in every CLI turn)."""
    loop = asyncio.get_running_loop()
    assert getattr(loop, "_default_executor", None) is None
    async with await PersistentContextManager.open(storage_path=storage, session_id="w") as store:
        await store.add_message({"role": "user", "content": "about egrets"})
    assert getattr(loop, "_default_executor", None) is None
    assert len(await search(storage, "egrets", catch_up=False)) == 1
