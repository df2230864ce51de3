"""The PostgreSQL search index with real processes (the file backend's: test_search_processes.py): writer
processes append, replace, redact and erase while a searcher process searches (on both backends); a writer
killed with SIGKILL mid-stream. Afterwards the index equals a rebuild from the rows, every acknowledged word is
found, and no search that began after a redaction or an erasure was acknowledged returned that message."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pgfixtures import pg_dsn, run_sql  # noqa: F401
from search_backends import FileBackend, PgBackend, fresh_schema

CHILD = str(Path(__file__).parent / "search_redact_child.py")


@pytest.fixture
def pgb(pg_dsn: str, tmp_path: Path) -> Iterator[PgBackend]:  # noqa: F811
    schema = fresh_schema()
    yield PgBackend(pg_dsn, schema, tmp_path)
    run_sql(pg_dsn, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _where(b: Any) -> list[str]:
    """The child's DSN, SCHEMA and TMP arguments for a backend (search_backends)."""
    return [b.dsn, b.schema, str(b.tmp)] if isinstance(b, PgBackend) else ["-", "-", str(b.storage)]


def _writer(b: Any, sid: str, n: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, CHILD, "write", *_where(b), sid, str(n)], stdout=subprocess.PIPE,
                            env=env, text=True)


def _removed(lines: list[str]) -> dict[str, float]:
    """The secrets a writer acknowledged removing, with the time it did."""
    return {p[1]: float(p[2]) for p in (line.split() for line in lines) if p and p[0] in ("R", "E")}


def _no_search_saw_a_removed_message(searches: list[str], removed: dict[str, float]) -> int:
    """Check every search the searcher printed; how many secrets were found before their removal (so the
    searches did overlap the secrets' lives)."""
    seen = set()
    for line in searches:
        parts = line.split()
        if not parts or parts[0] != "S":
            continue
        began, found = float(parts[1]), parts[2:]
        late = [w for w in found if w in removed and removed[w] < began]
        assert not late, f"a search that began at {began} found {late}, removed before it"
        seen.update(found)
    return len(seen)


async def _equals_rebuild(b: Any) -> None:
    caught = await b.caught_up()
    assert await b.rebuilt() == caught


@pytest.fixture(params=["postgres", "file"])
def either(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return request.getfixturevalue("pgb") if request.param == "postgres" else FileBackend(tmp_path / "store")


@pytest.mark.slow
async def test_a_searcher_process_while_writer_processes_append_redact_and_erase(
        either: Any, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Two writers (append, replace, redact, erase) and a searcher, all processes: the searcher never returns
    a message after its redaction or erasure was acknowledged; at the end every acknowledged word is found,
    no removed one is, and the index equals a rebuild."""
    pgb = either
    stop = tmp_path / "stop"
    async with await pgb.open("pa"):  # (the schema made before three processes race to make it)
        pass
    writers = [_writer(pgb, sid, 30, subprocess_env) for sid in ("pa", "pb")]
    searcher = subprocess.Popen([sys.executable, CHILD, "search", *_where(pgb), str(stop)],
                                stdout=subprocess.PIPE, env=subprocess_env, text=True)
    outs = [w.communicate(timeout=240)[0].splitlines() for w in writers]
    stop.touch()
    searches = searcher.communicate(timeout=60)[0].splitlines()
    assert [w.returncode for w in writers] == [0, 0] and searcher.returncode == 0
    removed = {k: v for out in outs for k, v in _removed(out).items()}
    assert len(removed) == 2 * (6 + 3)  # (every fifth and every ninth of 30)
    assert _no_search_saw_a_removed_message(searches, removed) >= 3  # (of 18 secrets, each there 0.1 s)
    for out in outs:
        acked = [line.split()[1] for line in out if line.startswith("A ")]
        assert len(acked) == 30
        for word in (acked[0], acked[-1]):
            assert [h.session_id for h in await pgb.search(word, all_messages=True)] == [word[:2]]
    assert await pgb.search("secret", all_messages=True) == []
    await _equals_rebuild(pgb)


@pytest.mark.slow
async def test_a_writer_killed_mid_stream_leaves_an_index_equal_to_a_rebuild(
        pgb: PgBackend, subprocess_env: dict[str, str]) -> None:
    """A writer SIGKILLed after a few acknowledged appends, three times: each time catching up gives what a
    rebuild from the rows gives, the last acknowledged words are found and no acknowledged removal is."""
    for round_ in range(3):
        sid = f"k{round_ % 2}"  # (the third round reopens the session the first one's kill left)
        p = _writer(pgb, sid, 400, subprocess_env)
        assert p.stdout is not None
        lines = [p.stdout.readline().strip() for _ in range(8 + 11 * round_)]
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        await _equals_rebuild(pgb)
        for word in [line.split()[1] for line in lines if line.startswith("A ")][-2:]:
            assert {h.session_id for h in await pgb.search(word, all_messages=True)} == {sid}
        for word in _removed(lines):
            assert await pgb.search(word, all_messages=True) == []
