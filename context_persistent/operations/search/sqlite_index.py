"""The embedded search index: SQLite FTS5 (stdlib ``sqlite3``) in ``<storage>/.search/index.sqlite3``.

Tables (layout ``LAYOUT``): ``meta`` (layout, tokenizer, last purge), ``sessions`` (one row per indexed session:
its anchor, the last indexed record's seq, crc and position, the ``ls`` facts), ``docs`` (one row per message:
key, role, time, whether the views show it, its fingerprint and where the log holds it; ``id`` follows the
message's time: ``time_id``), ``fts`` (the FTS5 table, ``rowid`` = ``docs.id``, columns ``body`` and
``tools``), ``redacted`` (keys ``redacted`` events named, with the fingerprint of the message) and ``erasing`` (erasures in progress: docs/search.md, "Erasure").

Removing text (a redaction, an erasure, an expiry, a trashed session) deletes its rows and then *purges*: FTS5
``optimize`` merges the index into one segment without the deleted entries, ``secure_delete`` zeroes every
freed page, and a ``TRUNCATE`` checkpoint empties the write-ahead log, so the text is in no page of the files.
The index is a cache of the logs: a file that is not a database, has another layout or tokenizer, or fails
a read is moved out of the way and built again from the logs, never trusted.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ...storage.paths import DIR_MODE, FILE_MODE, make_private_dirs
from .file_listing import file_sessions, signature
from .fold import Doc
from .text import MARK_CLOSE, MARK_OPEN, SEP

logger = logging.getLogger("context_persistent")

INDEX_DIR = ".search"
INDEX_NAME = "index.sqlite3"
LAYOUT = "2"  # 2: document ids follow time (time_id)
TOKENIZE = f"unicode61 remove_diacritics 2 separators '{SEP}'"
#: How long a statement waits for another process's write transaction (the writers of other sessions).
BUSY_TIMEOUT = 60.0

_DDL = f"""
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, last_crc TEXT, position INTEGER,
    signature TEXT, state TEXT NOT NULL, messages INTEGER NOT NULL, bytes INTEGER NOT NULL,
    first_ts TEXT, last_ts TEXT, title TEXT);
CREATE TABLE IF NOT EXISTS docs (
    id INTEGER PRIMARY KEY, session_id TEXT NOT NULL, key INTEGER NOT NULL, rec_seq INTEGER NOT NULL,
    slot INTEGER NOT NULL, pos INTEGER, role TEXT NOT NULL, ts TEXT NOT NULL, in_view INTEGER NOT NULL,
    fp BLOB NOT NULL, UNIQUE (session_id, key));
CREATE TABLE IF NOT EXISTS redacted (session_id TEXT NOT NULL, key INTEGER NOT NULL, fp BLOB,
    PRIMARY KEY (session_id, key));
CREATE TABLE IF NOT EXISTS erasing (session_id TEXT NOT NULL, key INTEGER NOT NULL, pid INTEGER NOT NULL,
    host TEXT NOT NULL, since REAL NOT NULL, PRIMARY KEY (session_id, key));
CREATE INDEX IF NOT EXISTS docs_hidden ON docs (id) WHERE in_view = 0;
CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(body, tools, tokenize="{TOKENIZE}");
"""

_DOC_COLUMNS = "d.id, d.session_id, d.key, d.rec_seq, d.slot, d.pos, d.role, d.ts, d.in_view, d.fp"
_NAMES = ("id", "session_id", "key", "rec_seq", "slot", "pos", "role", "ts", "in_view", "fp", "score")
#: Candidates ranked per hit wanted before the documents are read (docs the views no longer show are dropped).
_CANDIDATES = 4
#: Document ids a microsecond (docs.id = the message's time in µs x _PER_US, then the next free id; up to the
#: year 3000 in 63 bits).
_PER_US = 1 << 8
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)
#: How a search ranked: ``window`` (None: every match), ``ranked`` (matches ranked; None: all, not counted),
#: ``all_ranked`` (no match was left unranked).
Ranking = dict[str, Any]

SESSION_FIELDS = ("session_id", "last_seq", "last_crc", "position", "signature", "state", "messages", "bytes",
                  "first_ts", "last_ts", "title")


class IndexDamaged(Exception):
    """The index file cannot be used (not a database, another layout, a failed read): it is built again."""


def index_path(storage: str | os.PathLike[str]) -> Path:
    return Path(storage) / INDEX_DIR / INDEX_NAME


def _private_open(path: Path) -> None:
    """Create the file 0600 before SQLite does (SQLite gives its -wal and -shm files the database's mode)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.close(fd)


class SqliteIndex:
    """One connection to a storage's index. Not thread-safe: one owner (a thread) per instance."""

    backend = "file"

    def __init__(self, storage: str | os.PathLike[str], path: Path | None = None) -> None:
        self.storage = Path(storage)
        self.path = path if path is not None else index_path(storage)
        self._db: sqlite3.Connection | None = None
        self._ino: int | None = None
        #: The time and id of the last document inserted (insert_docs: a list record's messages in a row).
        self._last_doc: tuple[str | None, int] = (None, -1)

    # -- opening --------------------------------------------------------------------------------------
    @property
    def db(self) -> sqlite3.Connection:
        """The connection; reopened when the file was replaced (a rebuild renames a new index over it)."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None
        if self._db is None or ino != self._ino:
            self.close()
            self._db = self._connect()
            self._ino = os.stat(self.path).st_ino
        return self._db

    def _connect(self) -> sqlite3.Connection:
        make_private_dirs(self.path.parent)
        os.chmod(self.path.parent, DIR_MODE)
        for attempt in range(2):
            _private_open(self.path)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            try:
                _prepare(db)
                return db
            except (IndexDamaged, sqlite3.DatabaseError) as e:
                db.close()
                if isinstance(e, sqlite3.OperationalError) and re.search("locked|readonly|unable to open", str(e)):
                    raise  # (busy, or not ours to write: opening.py; not a damaged file)
                if attempt:
                    raise
                logger.warning("search index %s cannot be used (%s): building it again from the logs", self.path, e)
                discard(self.path)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def aclose(self) -> None:
        self.close()

    @contextlib.asynccontextmanager
    async def writing(self, sid: str | None = None) -> AsyncIterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: other writers wait, readers go on)."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- the logs it projects --------------------------------------------------------------------------
    async def listing(self) -> dict[str, str | None]:
        """Every session of the storage with its log's signature (file_listing.py)."""
        return file_sessions(self.storage)

    @contextlib.asynccontextmanager
    async def open_log(self, sid: str) -> AsyncIterator[tuple[Any, str | None] | None]:
        """The session's log, open read-only, with its signature; None when the session is gone."""
        from ...errors import SessionNotFoundError
        from ...storage.log import FileEventLog

        folder = self.storage / sid
        sig = signature(folder)
        try:
            log = FileEventLog(folder, sid, readonly=True)
        except SessionNotFoundError:
            yield None
            return
        try:
            yield log, sig
        finally:
            await log.close()

    @contextlib.asynccontextmanager
    async def rebuild_lock(self, exclusive: bool) -> AsyncIterator[None]:
        """A rebuild holds it exclusively, an erasure shared (indexer.storage_lock)."""
        with storage_lock(self.storage, exclusive):
            yield

    # -- sessions -------------------------------------------------------------------------------------
    async def session(self, sid: str) -> dict[str, Any] | None:
        row = self.db.execute(f"SELECT {', '.join(SESSION_FIELDS)} FROM sessions WHERE session_id = ?",
                              (sid,)).fetchone()
        return None if row is None else dict(zip(SESSION_FIELDS, row))

    def sessions(self) -> list[dict[str, Any]]:
        rows = self.db.execute(f"SELECT {', '.join(SESSION_FIELDS)} FROM sessions ORDER BY session_id").fetchall()
        return [dict(zip(SESSION_FIELDS, r)) for r in rows]

    async def signatures(self) -> dict[str, tuple[str | None, str]]:
        return {sid: (sig, state) for sid, sig, state in
                self.db.execute("SELECT session_id, signature, state FROM sessions")}

    async def save_session(self, row: dict[str, Any]) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO sessions ({', '.join(SESSION_FIELDS)}) VALUES "
                        f"({', '.join('?' * len(SESSION_FIELDS))})", [row.get(f) for f in SESSION_FIELDS])

    async def mark_dirty(self, sid: str) -> None:
        self.db.execute("UPDATE sessions SET state = 'dirty', title = NULL WHERE session_id = ?", (sid,))

    async def delete_session(self, sid: str, keep_row: bool = False) -> int:
        """Remove a session's documents (and its row unless ``keep_row``); the number of documents removed."""
        db = self.db
        n = self._delete_docs("session_id = ?", (sid,))
        db.execute("DELETE FROM redacted WHERE session_id = ?", (sid,))
        if not keep_row:
            db.execute("DELETE FROM sessions WHERE session_id = ?", (sid,))
        return n

    def _delete_docs(self, where: str, params: tuple[Any, ...]) -> int:
        db = self.db
        db.execute(f"DELETE FROM fts WHERE rowid IN (SELECT id FROM docs WHERE {where})", params)
        return db.execute(f"DELETE FROM docs WHERE {where}", params).rowcount

    # -- erasures in progress -------------------------------------------------------------------------
    async def holds(self, sid: str, key: int) -> bool:
        return self.db.execute("SELECT 1 FROM docs WHERE session_id = ? AND key = ?", (sid, key)).fetchone() is not None

    async def purged_at(self) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE name = 'purged_at'").fetchone()
        return None if row is None else row[0]

    async def erasing(self, sid: str) -> list[tuple[int, int, str, float]]:
        return self.db.execute("SELECT key, pid, host, since FROM erasing WHERE session_id = ?", (sid,)).fetchall()

    async def add_erasing(self, sid: str, key: int, pid: int, host: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO erasing VALUES (?, ?, ?, ?, ?)", (sid, key, pid, host, time.time()))

    async def clear_erasing(self, sid: str) -> None:
        self.db.execute("DELETE FROM erasing WHERE session_id = ?", (sid,))

    async def delete_copies(self, sid: str, key: int) -> list[tuple[int, int, int, bool]] | None:
        """Remove the document of ``key`` and every document with its fingerprint (the document's, else the one
        the ``redacted`` table keeps for the key); ``(rec_seq, slot, key, in_view)`` of each, or None (nothing
        removed) when neither knows the fingerprint."""
        db = self.db
        row = (db.execute("SELECT fp FROM docs WHERE session_id = ? AND key = ?", (sid, key)).fetchone() or
               db.execute("SELECT fp FROM redacted WHERE session_id = ? AND key = ?", (sid, key)).fetchone())
        if row is None or row[0] is None:
            return None
        where, params = "session_id = ? AND (key = ? OR fp = ?)", (sid, key, row[0])
        gone = [(s, slot, k, bool(v)) for s, slot, k, v in
                db.execute(f"SELECT rec_seq, slot, key, in_view FROM docs WHERE {where}", params)]
        self._delete_docs(where, params)
        return gone

    async def held_slots(self, sid: str, slots: list[tuple[int, int]]) -> int:
        """How many of the ``(rec_seq, slot)`` have a document."""
        n = 0
        for at in range(0, len(slots), 400):  # (a pass over the session's documents per 400)
            chunk = slots[at:at + 400]
            n += self.db.execute(f"SELECT count(*) FROM docs WHERE session_id = ? AND (rec_seq, slot) IN (VALUES "
                                 f"{', '.join('(?, ?)' for _ in chunk)})",
                                 (sid, *(v for pair in chunk for v in pair))).fetchone()[0]
        return n

    async def redacted_rows(self, sid: str) -> list[tuple[int, bytes | None]]:
        return self.db.execute("SELECT key, fp FROM redacted WHERE session_id = ?", (sid,)).fetchall()

    async def shift_positions(self, sid: str, after: int, delta: int) -> None:
        """Move the positions of the session's documents after byte ``after`` by ``delta`` (an erasure's
        tombstone of another length than its record)."""
        self.db.execute("UPDATE docs SET pos = pos + ? WHERE session_id = ? AND pos > ?", (delta, sid, after))

    # -- documents ------------------------------------------------------------------------------------
    async def insert_docs(self, sid: str, docs: Iterable[tuple[Doc, bool]]) -> int:
        db = self.db
        n = 0
        last_ts, last = self._last_doc  # (the previous document's time and id, across calls)
        for doc, in_view in docs:
            row = (sid, doc.key, doc.rec_seq, doc.slot, doc.pos, doc.role, doc.ts, int(in_view), doc.fp)
            doc_id = time_id(doc.ts)
            if doc.ts == last_ts and doc_id <= last:
                # (the messages of one list record share its time: each after the previous one, not found by
                # searching the taken ids again for every message, which grew with the square of the list)
                doc_id = last + 1
            while True:
                try:
                    db.execute("INSERT INTO docs (id, session_id, key, rec_seq, slot, pos, role, ts, in_view, fp) "
                               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (doc_id, *row))
                    break
                except sqlite3.IntegrityError as e:
                    if "docs.id" not in str(e):
                        raise
                    # (taken: another message of that microsecond) the next id after those taken from here
                    doc_id = db.execute("SELECT max(id) FROM docs WHERE id >= ? AND id < ?",
                                        (doc_id, doc_id + _PER_US)).fetchone()[0] + 1
            db.execute("INSERT INTO fts (rowid, body, tools) VALUES (?, ?, ?)", (doc_id, doc.body, doc.tools))
            last_ts, last = doc.ts, doc_id
            n += 1
        self._last_doc = (last_ts, last)
        return n

    async def set_view(self, sid: str, keys: set[int]) -> None:
        """``in_view`` of each document of the session: whether its key is in ``keys`` (the history's)."""
        db = self.db
        change = [(int(k in keys), i) for i, k, v in
                  db.execute("SELECT id, key, in_view FROM docs WHERE session_id = ?", (sid,)) if (k in keys) != v]
        db.executemany("UPDATE docs SET in_view = ? WHERE id = ?", change)

    async def add_redacted(self, sid: str, keys: Iterable[int], prints: dict[int, bytes] | None = None) -> None:
        """Record redacted keys with their messages' fingerprints (from ``prints``, else the documents)."""
        db = self.db
        for key in keys:
            if prints is not None:
                fp = prints.get(key)
            else:
                row = db.execute("SELECT fp FROM docs WHERE session_id = ? AND key = ?", (sid, key)).fetchone()
                fp = None if row is None else row[0]
            db.execute("INSERT OR REPLACE INTO redacted VALUES (?, ?, ?)", (sid, key, fp))

    async def delete_hidden(self, sid: str) -> int:
        """Apply the redaction rule (fold.hidden) to the session's documents; how many were removed."""
        return self._delete_docs(
            "session_id = ? AND in_view = 0 AND (key IN (SELECT key FROM redacted WHERE session_id = ?) OR "
            "fp IN (SELECT fp FROM redacted WHERE session_id = ? AND fp IS NOT NULL))", (sid, sid, sid))

    async def view_facts(self, sid: str) -> tuple[int, str | None]:
        """The number of messages in the views and the title (the first user message's text)."""
        db = self.db
        n = db.execute("SELECT count(*) FROM docs WHERE session_id = ? AND in_view = 1", (sid,)).fetchone()[0]
        return n, await self.title(sid)

    async def title(self, sid: str) -> str | None:
        """The first user message's text in the views, shortened (``ls``)."""
        row = self.db.execute("SELECT f.body FROM docs d JOIN fts f ON f.rowid = d.id WHERE d.session_id = ? AND "
                              "d.in_view = 1 AND d.role = 'user' ORDER BY d.key LIMIT 1", (sid,)).fetchone()
        return None if row is None else title_of(row[0])

    # -- removing text for good -----------------------------------------------------------------------
    async def purge(self) -> None:
        """Rewrite the FTS index without deleted entries and empty the write-ahead log (module docstring)."""
        db = self.db
        db.execute("INSERT INTO fts (fts) VALUES ('optimize')")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('purged_at', ?)", (repr(time.time()),))
        for _ in range(600):  # a reader's snapshot keeps old frames in use: wait for it to end
            busy, _log, _done = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy and os.path.getsize(str(self.path) + "-wal") == 0:
                return
            time.sleep(0.05)
        raise sqlite3.OperationalError(f"{self.path}: could not empty the write-ahead log (a reader kept it busy "
                                       "for 30 s)")

    # -- reading --------------------------------------------------------------------------------------
    def unusable(self, e: BaseException) -> bool:
        """Whether ``e`` is the index failing (not a session's log): a catch-up of the storage stops there."""
        return isinstance(e, sqlite3.Error)

    async def session_rows(self) -> list[tuple[Any, ...]]:
        """What ``ls`` lists, in session order (the signature and state last): one query, sorted here (cheaper
        than the primary key's order at 10,000 sessions)."""
        rows = self.db.execute("SELECT session_id, messages, last_seq, bytes, first_ts, last_ts, title, signature, "
                               "state FROM sessions").fetchall()
        rows.sort()
        return rows

    async def search(self, fts_query: str, *, session_id: str | None, role: str | None, since: str | None,
                     all_messages: bool, limit: int, window: int | None = None) -> tuple[list[dict[str, Any]], Ranking]:
        """The best ``limit`` matches and how many were ranked: with ``window``, the newest ``window`` matches
        (by the documents' ids: their time) are ranked; without, every match (docs/search.md, "Ranking")."""
        ranking: Ranking = {"window": window, "ranked": None, "all_ranked": True}
        rows = None
        if window is not None:
            rows = self._windowed(fts_query, session_id, role, since, all_messages, limit, window, ranking)
        elif session_id is None and role is None and since is None:
            rows = self._ranked_first(fts_query, all_messages, limit)
        if rows is None:
            rows = self._joined(fts_query, *_filters(session_id, role, since, all_messages), limit)
        if rows:
            ids = [r["id"] for r in rows]
            # A lookup per id sets the query up once per id, which for a prefix (``pool*``: every word starting
            # so, their lists merged) costs as much as the search: a prefix query is set up once, walking the
            # hits' range of ids instead.
            cond = (f"rowid IN ({', '.join('?' * len(ids))})" if "*" not in fts_query else
                    f"rowid BETWEEN {min(ids)} AND {max(ids)} AND +rowid IN ({', '.join('?' * len(ids))})")
            snippets = dict(self.db.execute(
                f"SELECT rowid, snippet(fts, -1, '{MARK_OPEN}', '{MARK_CLOSE}', '…', 16) FROM fts WHERE fts MATCH ? "
                f"AND {cond}", [fts_query, *ids]))
            for r in rows:
                r["snippet"] = snippets.get(r["id"], "")
        return rows, ranking

    def _windowed(self, fts_query: str, session_id: str | None, role: str | None, since: str | None,
                  all_messages: bool, limit: int, window: int, ranking: Ranking) -> list[dict[str, Any]]:
        """The newest ``window`` matches (FTS5 walks a phrase's documents by rowid, newest first, and stops
        there), each scored by bm25, the best ``limit`` of them returned (ties: the newer first). ``ranking``
        says how many were ranked and whether older matches were left unranked (one more lookup past the
        window's oldest)."""
        if session_id is None and role is None and since is None:
            scored = self._window_alone(fts_query, all_messages, window)
            if scored is not None:
                shown = "" if all_messages else " AND rowid NOT IN (SELECT id FROM docs WHERE in_view = 0)"
                return self._best(scored, window, limit, ranking, lambda oldest: self.db.execute(
                    f"SELECT 1 FROM fts WHERE fts MATCH ? AND rowid < ?{shown} ORDER BY rowid DESC LIMIT 1",
                    (fts_query, oldest)).fetchone() is None)
        where, params = _filters(session_id, role, since, all_messages)
        where, params = ["fts MATCH ?", *where], [fts_query, *params]
        if since is not None:
            where.append("fts.rowid >= ?")  # (ids follow time: FTS5 starts at the first of that microsecond)
            params.append(time_id(since))
        cond = " AND ".join(where)
        scored = self.db.execute(f"SELECT fts.rowid, bm25(fts) FROM fts JOIN docs d ON d.id = fts.rowid WHERE {cond} "
                                 f"ORDER BY fts.rowid DESC LIMIT ?", [*params, window]).fetchall()
        return self._best(scored, window, limit, ranking, lambda oldest: self.db.execute(
            f"SELECT 1 FROM fts JOIN docs d ON d.id = fts.rowid WHERE {cond} AND fts.rowid < ? "
            f"ORDER BY fts.rowid DESC LIMIT 1", [*params, oldest]).fetchone() is None)

    def _window_alone(self, fts_query: str, all_messages: bool, window: int) -> list[tuple[int, float]] | None:
        """The newest ``window`` matches of the views in the FTS table alone (no lookup of each match's
        document: a third of the cost), when that is exact: when none of the newest ``window`` matches of the
        whole index is a document the views no longer show (``docs_hidden``: their ids), or fewer match
        (then those are dropped). None when the documents must be read (the window reaches further back)."""
        scored = self.db.execute("SELECT rowid, bm25(fts) FROM fts WHERE fts MATCH ? ORDER BY rowid DESC LIMIT ?",
                                 (fts_query, window)).fetchall()
        if all_messages or not scored:
            return scored
        hidden = self.db.execute("SELECT id FROM docs WHERE in_view = 0 AND id >= ? LIMIT 100001",
                                 (scored[-1][0],)).fetchall()
        if not hidden:
            return scored
        if len(hidden) > 100_000:
            return None
        gone = {h[0] for h in hidden}
        kept = [r for r in scored if r[0] not in gone]
        return kept if len(scored) < window or len(kept) == len(scored) else None

    def _best(self, scored: list[tuple[int, float]], window: int, limit: int, ranking: Ranking,
              none_older: Callable[[int], bool]) -> list[dict[str, Any]]:
        """The best ``limit`` of the window's scored matches with their documents, and ``ranking`` (for a full
        window, ``none_older(oldest id)`` says whether every match was ranked)."""
        ranking["ranked"] = len(scored)
        if len(scored) == window:
            ranking["all_ranked"] = none_older(scored[-1][0])
        best = heapq.nsmallest(limit, scored, key=lambda r: (r[1], -r[0]))  # (a sort in SQL costs more)
        docs = {r[0]: r for r in self.db.execute(
            f"SELECT {_DOC_COLUMNS} FROM docs d WHERE d.id IN ({', '.join('?' * len(best))})", [r[0] for r in best])}
        # (an fts row without its document cannot be returned: the joined query skips it too)
        return [dict(zip(_NAMES, (*docs[rowid], score))) for rowid, score in best if rowid in docs]

    def _ranked_first(self, fts_query: str, all_messages: bool, limit: int) -> list[dict[str, Any]] | None:
        """The best ``limit`` matches without a filter on the session, role or time: ranked in the FTS table
        alone, then their documents read. Joining ``docs`` to every match before the sort costs a lookup per
        match (about 40% of a query matching half of 1 GB of logs); here only the candidates are looked up. A
        candidate the views no longer show is dropped, so ``_CANDIDATES`` x ``limit`` are ranked; None (run
        the joined query) when too few of them were kept though more matches exist: the result is exactly the
        joined query's."""
        want = max(limit * _CANDIDATES, 100)
        ranked = self.db.execute("SELECT rowid, bm25(fts) FROM fts WHERE fts MATCH ? ORDER BY bm25(fts) LIMIT ?",
                                 (fts_query, want)).fetchall()
        if not ranked:
            return []
        docs: dict[int, tuple[Any, ...]] = {}
        ids = [r[0] for r in ranked]
        for start in range(0, len(ids), 500):  # (SQLite's limit on parameters is 999 in old builds)
            chunk = ids[start:start + 500]
            docs.update((r[0], r) for r in self.db.execute(
                f"SELECT {_DOC_COLUMNS} FROM docs d WHERE d.id IN ({', '.join('?' * len(chunk))})", chunk))
        rows = []
        for rowid, score in ranked:
            d = docs.get(rowid)
            if d is None or not (all_messages or d[8]):
                continue  # (an fts row without its document cannot be returned: the joined query skips it too)
            rows.append(dict(zip(_NAMES, (*d, score))))
            if len(rows) == limit:
                return rows
        return rows if len(ranked) < want else None

    def _joined(self, fts_query: str, where: list[str], params: list[Any], limit: int) -> list[dict[str, Any]]:
        # Ranked first, snippets after: a snippet tokenises its document again, so only the hits returned get one.
        sql = (f"SELECT {_DOC_COLUMNS}, bm25(fts) FROM fts JOIN docs d ON d.id = fts.rowid "
               f"WHERE {' AND '.join(['fts MATCH ?', *where])} ORDER BY bm25(fts) LIMIT ?")
        return [dict(zip(_NAMES, r)) for r in self.db.execute(sql, [fts_query, *params, limit])]

    def contents(self) -> dict[str, Any]:
        """Everything the index says (sessions without their signature, documents with their texts): what a
        test compares with a rebuild."""
        db = self.db
        sessions = {r["session_id"]: {k: v for k, v in r.items() if k != "signature"} for r in self.sessions()}
        docs = sorted(db.execute("SELECT d.session_id, d.key, d.rec_seq, d.slot, d.pos, d.role, d.ts, d.in_view, "
                                 "d.fp, f.body, f.tools FROM docs d JOIN fts f ON f.rowid = d.id"))
        return {"sessions": sessions, "docs": docs}


def _filters(session_id: str | None, role: str | None, since: str | None,
             all_messages: bool) -> tuple[list[str], list[Any]]:
    """The conditions on ``docs d`` of a search's filters, and their parameters."""
    where: list[str] = [] if all_messages else ["d.in_view = 1"]
    params: list[Any] = []
    for cond, value in (("d.session_id = ?", session_id), ("d.role = ?", role), ("d.ts >= ?", since)):
        if value is not None:
            where.append(cond)
            params.append(value)
    return where, params


def time_id(ts: str) -> int:
    """The first document id of ``ts``'s microsecond: ids follow the messages' time (``_PER_US`` ids a
    microsecond, then the next free one: the messages of a list record, which share their record's time, keep
    their order), so "newest first" is FTS5's own descending rowid order. A time that is not ISO 8601 (no log
    writes one) counts as the epoch."""
    try:
        dt = datetime.fromisoformat(ts)
    except (TypeError, ValueError):
        return 0
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return ((dt - _EPOCH) // _US) * _PER_US


def title_of(body: str) -> str:
    text = " ".join(body.replace(SEP, "").split())
    return text if len(text) <= 100 else text[:99] + "…"


@contextlib.contextmanager
def storage_lock(storage: Path, exclusive: bool) -> Iterator[None]:
    """The index's rebuild lock: a rebuild holds it exclusively, an erasure shared (so that a rebuild never
    reads a log an erasure is about to change and an erasure never marks an index about to be replaced)."""
    import fcntl

    from ...storage.paths import make_private_dirs

    folder = index_path(storage).parent
    make_private_dirs(folder)
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _prepare(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA secure_delete = ON")
    mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode != "wal":
        raise IndexDamaged(f"journal mode {mode}")
    db.execute("PRAGMA synchronous = NORMAL")
    have = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in have:
        if have:
            raise IndexDamaged("tables of another program")
        db.execute("BEGIN IMMEDIATE")
        try:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
                for statement in _DDL.split(";\n"):
                    if statement.strip():
                        db.execute(statement)
                db.executemany("INSERT INTO meta VALUES (?, ?)", [("layout", LAYOUT), ("tokenize", TOKENIZE)])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    meta = dict(db.execute("SELECT name, value FROM meta"))
    if meta.get("layout") != LAYOUT or meta.get("tokenize") != TOKENIZE:
        raise IndexDamaged(f"layout {meta.get('layout')!r} / tokenizer {meta.get('tokenize')!r}, this program "
                           f"writes {LAYOUT!r} / {TOKENIZE!r}")


def discard(path: Path) -> None:
    """Remove an index file and its write-ahead log and shared-memory files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(path) + suffix)
