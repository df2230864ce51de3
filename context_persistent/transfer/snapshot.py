"""Export, import and fork: snapshot files and new sessions built from them (I/O; formats in snapshot_codec).

- ``export(store, path, ...)`` writes one view of a session, at its head or as it was right after any
  ``at_seq`` (time travel: the log's records up to that seq are replayed through ``Projection.apply``, from
  a separate read-only handle on the log), to a file written atomically (temp file 0600, fsync, rename,
  fsync of the folder).
- ``session_lines`` and ``create_session`` build a NEW session from messages; ``transfer.import_`` uses them
  to create one from a snapshot, an Amplifier CLI ``transcript.jsonl`` or the reference module's
  ``context-messages.jsonl``.
- ``fork(store, new_session_id, at_seq=...)`` creates a NEW session holding the history and pins as of a seq,
  whose ``session_started`` names its parent.

A new session is built completely in a hidden temp folder beside its final place and renamed into place in
one step, so a failure at any point leaves no half-written session (see docs/snapshots.md).

aiofiles does the bulk file I/O here (snapshot and import files are read and written in 1 MiB chunks in a
worker thread) so that exporting a large session from inside a running agent does not stall its event loop.
It is not used per line: every aiofiles call is a thread hop (~50 µs), which would dominate small writes.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles  # type: ignore[import-untyped]
import orjson

from ..model import codec
from ..model import events as ev
from . import snapshot_codec as sc
from ..errors import InvalidRecordError, SessionExistsError
from ..storage.paths import (DIR_MODE, FILE_MODE, LOG_NAME, NOFOLLOW, check_storage_root, fsync_dir, make_private_dirs,
                    session_dir, validate_session_id)
from ..storage.backends import open_log
from ..model.projection import Projection, make_key
from ..model.tokens import DEFAULT_ENCODING
from ..model.views import REASONING_ROLES, text_only

logger = logging.getLogger("context_persistent.transfer.snapshot")

if TYPE_CHECKING:
    from ..storage.eventlog import EventLog
    from ..store.manager import PersistentContextManager

#: ``progress(done, total)`` callback (bytes or messages; ``total`` may be 0 when unknown).
Progress = Callable[[int, int], None]
CHUNK = 1 << 20
PROGRAM = "context-persistent"


# -- time travel ------------------------------------------------------------------------------------
async def replay(log: EventLog, at_seq: int | None = None, pager: Any = None) -> Projection:
    """The projection after every record with ``seq <= at_seq`` (all records when None), less every message
    redacted at any seq. With a ``pager`` (pages.MessageReader of a file log), the history keeps refs to the
    log instead of messages, as a replay at open does (docs/architecture.md, "Bounded memory").

    A redaction hides its message from every view at every seq: the past state is the fold up to ``at_seq``
    with the messages that any ``redacted`` event of the log names taken out, and with them every message
    of that state identical to a redacted one (``set_messages`` re-adds the messages it keeps under new keys,
    so the message a past state holds may be an earlier copy of the one that was redacted). ``at``,
    ``export(at_seq=)``, ``fork(at_seq=)`` and ``show --at`` therefore never reveal what was redacted later.

    When the log's oldest segments expired, the fold starts from the ``expired`` record's state, and a state
    before that record (``at_seq`` below its seq) is a RecordsExpiredError: it needs the expired records.
    """
    manifest = getattr(log, "manifest", None)
    boundary = manifest.boundary if manifest is not None else None
    if boundary is not None and at_seq is not None and at_seq < boundary.expired_seq:
        from ..errors import RecordsExpiredError

        raise RecordsExpiredError(str(getattr(log, "directory", "")), f"the state at seq {at_seq} (the earliest "
                                  f"state the log still holds is at seq {boundary.expired_seq})", boundary.last_seq,
                                  boundary.start, boundary.expired_seq)
    redacted: set[int] = set()
    if at_seq is not None:  # (at the head, the fold has applied every redaction already)
        async for batch in log.read_batches():
            redacted.update(_redacted_key(rec) for rec in batch if rec["type"] == ev.REDACTED)
    from ..storage.checkpoint.policy import seed_state

    state = seed_state(log, pager)  # (empty, or seeded from the expired record when the oldest segments expired)
    apply = state.apply
    prints: set[bytes] = set()  # fingerprints of the redacted messages
    async for batch in log.read_batches():
        spans = getattr(log, "batch_spans", None) if pager is not None else None
        if spans is None or len(spans) != len(batch):
            spans = None
        for j, rec in enumerate(batch):
            if redacted:
                _note_redacted(rec, redacted, prints)
            if at_seq is None or rec["seq"] <= at_seq:
                if spans is None:
                    apply(rec)
                else:
                    start, end = spans[j]
                    apply(rec, start, end - start)
            elif not redacted:
                return state
    if redacted:
        _hide(state, redacted, prints)
    return state


def _redacted_key(rec: dict[str, Any]) -> int:
    key = rec["data"].get("key") if isinstance(rec.get("data"), dict) else None
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidRecordError(rec.get("seq"), rec.get("type"), f"data.key is {key!r}, not a message key")
    return key


def _fingerprint(message: Any) -> bytes:
    try:
        data = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # (an integer beyond 64 bits)
        data = repr(message).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def _note_redacted(rec: dict[str, Any], redacted: set[int], prints: set[bytes]) -> None:
    """Add the fingerprints of the messages of ``rec`` whose keys are redacted (every record holding messages:
    ``message_added``, ``messages_replaced``, ``system_prompt_set`` and the erasure tombstones of them)."""
    from ..operations.erasure import message_slots

    seq = rec["seq"]
    for i, m in message_slots(rec):
        if make_key(seq, i) in redacted:
            prints.add(_fingerprint(m))


def _hide(state: Projection, keys: set[int], prints: set[bytes]) -> None:
    """Take the messages with these keys, or identical to a redacted one, out of ``state``."""
    gone = [i for i, (k, m) in enumerate(zip(state.keys, state.messages)) if k in keys or _fingerprint(m) in prints]
    for i in reversed(gone):
        state.pinned.discard(state.keys[i])
        del state.messages[i], state.keys[i], state.tokens[i]
    state.pinned -= keys
    if gone:
        state.version += 1


def _check_at_seq(at_seq: Any, head: int) -> int:
    if isinstance(at_seq, bool) or not isinstance(at_seq, int) or at_seq < 1:
        raise ValueError(f"at_seq must be an integer >= 1, got {at_seq!r}")
    if at_seq > head:
        raise ValueError(f"at_seq {at_seq} is beyond the last event of the session (seq {head})")
    return at_seq


async def open_at(store: PersistentContextManager, at_seq: int) -> PersistentContextManager:
    """A read-only store showing the session as it was right after event ``at_seq``. Close it after use.

    It replays the log from a second, read-only handle (no lock; the writer is not disturbed) and offers
    every read method of the store (views, request view, token counts, stats) on that past state.
    """
    _check_at_seq(at_seq, store.head_seq)
    log = await open_log(store.storage_path, store.session_id, store.config, readonly=True)
    past = None
    try:
        past = type(store)(storage_path=store.storage_path, session_id=store.session_id, log=log,
                           config=store.config)
        past._state = await replay(log, at_seq, past._s.pager)  # (read through the past store's own pager)
        past._loaded_from_file = past._state.has_history
    except BaseException:
        if past is not None and past._s.pager is not None:
            past._s.pager.close()
        await log.close()
        raise
    return past


_AUDIT_EXPORT_RE = re.compile(r"compaction-([0-9]{10})\.jsonl")


async def rewrite_audit_exports(store: PersistentContextManager, since_seq: int) -> list[Path]:
    """Rewrite the store's own audit snapshots (``<session>/compaction-<seq>.jsonl``, written by
    ``export_on_compact``) made at ``since_seq`` or later, as of their seq: after a redaction, so that no
    export the store wrote keeps the redacted message. Returns the files rewritten; a failure is logged."""
    folder = store._log_dir()
    done: list[Path] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return done
    for name in names:
        m = _AUDIT_EXPORT_RE.fullmatch(name)
        if m is None or not since_seq <= int(m[1]) <= store.head_seq:
            continue
        path = folder / name
        try:
            await export(store, path, format="jsonl", view="reasoning", at_seq=int(m[1]))
            done.append(path)
        except Exception as e:  # (the redaction is durable; this is a copy)
            logger.warning("session %s: could not rewrite %s after a redaction (%s); it may still hold the "
                           "redacted message: delete it", store.session_id, path, e)
    return done


async def view_messages(store: PersistentContextManager, view: str, token_budget: int | None = None
                        ) -> list[dict[str, Any]]:
    """The messages of ``view`` (``full``, ``conversation``, ``reasoning`` or ``request``), as a copy."""
    sc.check_choice("view", view, sc.VIEWS)
    if view == "request":
        return await store.get_messages_for_request(token_budget=token_budget)
    if token_budget is not None:
        raise ValueError("token_budget applies only to view='request'")
    if view == "conversation":
        return await store.get_conversation_view()
    if view == "reasoning":
        return await store.get_reasoning_view()
    return await store.get_messages()


# -- export -----------------------------------------------------------------------------------------
async def export(store: PersistentContextManager, path: str | os.PathLike[str], *, format: str | None = None,
                 view: str = "full", at_seq: int | None = None, token_budget: int | None = None,
                 progress: Progress | None = None) -> dict[str, Any]:
    """Write a snapshot of ``view`` at the head (or right after ``at_seq``) to ``path``; returns its header.

    ``format`` None takes it from the file name (``.md``/``.markdown`` markdown, ``.json`` json, else jsonl).
    The file is replaced atomically: readers see the old file or the complete new one, never a part.
    """
    if format is None:
        format = sc.format_for_path(path)
    sc.check_choice("format", format, sc.FORMATS)
    sc.check_choice("view", view, sc.VIEWS)
    store._check_open()
    if at_seq is not None:
        past = await open_at(store, at_seq)
        try:
            return await export(past, path, format=format, view=view, token_budget=token_budget,
                                progress=progress)
        finally:
            await past.close()
    state = store._full() if view != "request" else store._state  # (the request view reads only what it holds)
    source: Any
    if view != "request":  # a view of the whole history, streamed: never held in memory twice
        if token_budget is not None:
            raise ValueError("token_budget applies only to view='request'")
        count = len(state.messages) if view == "full" else 0  # (the first pass counts)
        source = functools.partial(view_stream, store, view)
    else:
        listed = await view_messages(store, view, token_budget)
        count = len(listed)
        source = functools.partial(_listed, listed)
    pinned = ([i for i, k in enumerate(state.keys) if k in state.pinned] if view == "full" else [])
    header: dict[str, Any] = {
        sc.MARKER: sc.SNAPSHOT_VERSION,
        "format": format,
        "view": view,
        "session_id": store.session_id,
        "seq_range": [1 if state.head_seq else 0, state.head_seq],
        "created_at": codec.now_iso(),
        "messages": count,
        "pinned": pinned,
        "tokenizer": state.session.get("tokenizer") or store.config.get("tokenizer"),
        "program": PROGRAM,
    }
    if "parent" in state.session:
        header["parent"] = state.session["parent"]
    if token_budget is not None:
        header["token_budget"] = token_budget
    if view == "request":  # the notes put in place of left-out messages: not messages of the session
        sources = await request_sources(store, listed)
        header["notes"] = [i for i in sc.note_indices(listed) if sources[i] is None]
    try:
        if format == "markdown":  # (for people: rendered whole)
            messages = [m async for m in source()]
            await write_atomic(Path(path), list(sc.encode_snapshot(header, messages, format)), progress)
        else:
            await _write_streamed(Path(path), header, format, source, progress)
    except orjson.JSONEncodeError as e:  # (only a message stored before the depth limit existed gets here)
        raise ValueError(f"cannot export session {store.session_id!r} as {format}: {e}: a message is nested "
                         f"deeper than the store accepts today ({codec.MAX_DEPTH} levels, docs/format.md); "
                         "format 'jsonl' writes each message on its own and can carry it") from None
    return header


async def history_messages(store: PersistentContextManager) -> AsyncIterator[dict[str, Any]]:
    """The full history, a message at a time, oldest first: ``iter_messages()`` where the store has it, else
    the messages it holds (for reading only: they are not copies)."""
    iterate = getattr(store, "iter_messages", None)
    if iterate is not None:
        async for m in iterate():
            yield m
        return
    for i, m in enumerate(list(store._full().messages)):
        if i and i % 1024 == 0:
            await asyncio.sleep(0)
        yield m


async def request_sources(store: PersistentContextManager, messages: list[dict[str, Any]]) -> list[int | None]:
    """The history index of each message of ``messages``, the store's request view just made, that is one of
    the history's unchanged (in order; None for a note, a masked or truncated message).

    Only the history messages the view can hold are read: after a windowed rebuild (compaction/window.py) the
    window's (the kept older ones and every one from its start), else the whole history a message at a time.
    Each view message is matched with the first equal one after the previous match."""
    state = store._state
    window = store._views.window
    candidates: AsyncIterator[tuple[int, dict[str, Any]]]
    if window is not None:
        indices = [i for i in window.indices if i < window.start] + list(range(window.start, len(state.messages)))
        candidates = _listed([(i, state.messages[i]) for i in indices])
    else:
        candidates = _numbered(history_messages(store))
    wanted = {_fingerprint(m) for m in messages}
    where: dict[bytes, list[int]] = {}
    async for i, m in candidates:
        fp = _fingerprint(m)
        if fp in wanted:
            where.setdefault(fp, []).append(i)
    out: list[int | None] = []
    last = -1
    for m in messages:
        found = next((i for i in where.get(_fingerprint(m), ()) if i > last), None)
        if found is not None:
            last = found
        out.append(found)
    return out


async def _numbered(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


async def view_stream(store: PersistentContextManager, view: str) -> AsyncIterator[dict[str, Any]]:
    """The messages of ``view`` (``full``, ``conversation`` or ``reasoning``; views.py) one at a time, from
    :func:`history_messages`: the same messages as the store's ``get_*`` methods return, never held together."""
    sc.check_choice("view", view, ("full", "conversation", "reasoning"))
    async for m in history_messages(store):
        if view == "full":
            yield m
        elif view == "reasoning":
            if m.get("role") in REASONING_ROLES:
                yield m
        elif m.get("role") in ("user", "assistant"):
            kept = text_only(m)
            if kept is not None:
                yield kept


async def _listed(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class _Changed(Exception):
    """The history changed between the two passes of a streamed export (a writer replaced it)."""


async def _write_streamed(path: Path, header: dict[str, Any], fmt: str,
                          source: Callable[[], AsyncIterator[dict[str, Any]]], progress: Progress | None) -> None:
    """A JSONL or JSON snapshot written as it goes, in two passes over ``source``: the first computes the body's
    checksum and message count (the header, which comes first, holds them), the second writes the file and
    checks it wrote the same body (else, the history changed meanwhile: it starts again, at most 3 times).
    Memory holds a message and a 1 MiB buffer, whatever the view's length."""
    for _attempt in range(3):
        h = hashlib.sha256()
        body = count = 0
        async for m in source():
            line = orjson.dumps(m) + b"\n"
            h.update(line)
            body += len(line)
            count += 1
        digest = "sha256:" + h.hexdigest()
        header.update(messages=count, body_sha256=digest)

        async def chunks() -> AsyncIterator[bytes]:
            again = hashlib.sha256()
            writer = sc.JsonWriter({"header": header}, "messages") if fmt == "json" else None
            if writer is None:
                yield orjson.dumps(header) + b"\n"
            async for m in source():
                line = orjson.dumps(m) + b"\n"
                again.update(line)
                yield line if writer is None else writer.item(m)
            if "sha256:" + again.hexdigest() != digest:
                raise _Changed
            if writer is not None:
                yield writer.end()

        try:
            await write_atomic(path, chunks(), progress, total=len(orjson.dumps(header)) + 1 + body)
            return
        except _Changed:
            continue
    raise RuntimeError(f"the history changed during each of 3 attempts to export it to {path}; export again")


async def write_atomic(path: Path, chunks: Iterable[bytes] | AsyncIterator[bytes], progress: Progress | None = None,
                       total: int | None = None) -> int:
    """Write ``chunks`` to ``path`` via a 0600 temp file beside it: write, fsync, rename, fsync the folder.

    ``chunks`` is a list, or an async iterator written as it yields (then ``total``, the expected size, is what
    ``progress`` is told until the end). Returns the bytes written."""
    if not isinstance(chunks, AsyncIterator):
        parts = list(chunks)
        total = sum(len(c) for c in parts)
        chunks = _listed(parts)
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"folder {parent} does not exist (create it first)", str(parent))
    if os.path.lexists(parent / LOG_NAME):  # a session folder (export_on_compact): no leftovers pile up there
        clean_stale_temp_files(parent)
    tmp = parent / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    done = 0
    try:
        async with aiofiles.open(tmp, "xb", opener=_private_opener) as f:
            buf: list[bytes] = []
            held = 0
            async for chunk in chunks:
                buf.append(chunk)
                held += len(chunk)
                if held < CHUNK:
                    continue
                data = b"".join(buf)
                buf, held = [], 0
                for i in range(0, len(data), CHUNK):
                    piece = data[i:i + CHUNK]
                    await f.write(piece)
                    done += len(piece)
                    if progress:
                        progress(done, max(done, total or 0))
            if buf:
                data = b"".join(buf)
                await f.write(data)
                done += len(data)
                if progress:
                    progress(done, done)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(parent)
    return done


_TMP_FILE_RE = re.compile(r"\..+\.tmp-([0-9]+)-[0-9a-f]{8}")


def _stale_entries(folder: Path, pattern: re.Pattern[str], pid_group: int, *, directory: bool
                   ) -> Iterator[tuple[os.DirEntry[str], re.Match[str]]]:
    """Entries of ``folder`` named by ``pattern`` that are real files (or folders, not links) owned by this
    user and whose process (the pid in ``pid_group``) is gone, with their match."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            kind_ok = entry.is_dir(follow_symlinks=False) if directory else entry.is_file(follow_symlinks=False)
            if kind_ok and entry.stat(follow_symlinks=False).st_uid == os.geteuid() and not _alive(int(m[pid_group])):
                yield entry, m
        except OSError:
            continue


def clean_stale_temp_files(folder: Path) -> list[Path]:
    """Remove the temp files of exports killed midway in ``folder`` (``.<name>.tmp-<pid>-<8 hex>``): regular
    files of ours whose process is gone. Returns what was removed."""
    removed: list[Path] = []
    for entry, m in _stale_entries(folder, _TMP_FILE_RE, 1, directory=False):
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
            logger.info("removed %s, left by an export that did not finish (pid %s)", entry.path, m[1])
        except OSError as e:
            logger.info("could not remove the leftover temp file %s: %s", entry.path, e)
    return removed


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


async def read_file(path: Path, progress: Progress | None = None) -> bytes:
    """The whole file, read in chunks off the event loop."""
    total = os.stat(path).st_size
    parts = []
    done = 0
    async with aiofiles.open(path, "rb") as f:
        while chunk := await f.read(CHUNK):
            parts.append(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return b"".join(parts)


# -- building new sessions --------------------------------------------------------------------------
def session_lines(session_id: str, started: dict[str, Any], messages: list[dict[str, Any]],
                  pins: Iterable[int] = (), stamps: list[str | None] | None = None) -> list[bytes]:
    """The records of a new session: ``session_started``, one ``message_added`` per message, then pins."""
    ts = codec.now_iso()
    data = {"format": codec.FORMAT_VERSION, "tokenizer": DEFAULT_ENCODING, "program": PROGRAM,
            "session_id": session_id, **started}
    lines = [codec.encode_event(1, ev.SESSION_STARTED, data, ts, codec.root_crc(session_id))]
    for i, m in enumerate(messages):
        body = b'{"message":%s' % ev.validate_message(m, f"message {i + 1}")
        if stamps and stamps[i] is not None:
            body += b',"source_timestamp":%s' % orjson.dumps(stamps[i])
        lines.append(codec.encode(i + 2, ev.MESSAGE_ADDED, body + b"}", ts, codec.crc_of(lines[-1])))
    for seq, i in enumerate(sorted(set(pins)), len(lines) + 1):
        msg_seq = i + 2
        lines.append(codec.encode_event(seq, ev.PINNED, {"key": make_key(msg_seq), "seq": msg_seq, "index": 0},
                                        ts, codec.crc_of(lines[-1])))
    return lines


def _target(storage_path: str | os.PathLike[str], session_id: str) -> Path:
    target = session_dir(storage_path, session_id)
    if (target / LOG_NAME).exists():
        raise SessionExistsError(f"session {session_id!r} already exists ({target / LOG_NAME}); "
                                 "choose another session id (nothing is ever overwritten)")
    if not target.exists():  # an id a retention policy moved to the trash is not free (SessionTrashedError)
        from ..operations.trash import check_not_trashed

        check_not_trashed(Path(storage_path), session_id)
    return target


async def create_session(storage_path: str | os.PathLike[str], session_id: str, lines: list[bytes],
                         config: dict[str, Any] | None = None) -> Path | str:
    """Create a session holding exactly ``lines``, all or nothing; SessionExistsError if it exists.

    Returns where the log lives: its path for files, a description for other backends."""
    if config and config.get("backend", "file") != "file":
        return await _create_in_backend(storage_path, session_id, lines, config)
    target = _target(storage_path, session_id)
    storage = Path(storage_path)
    make_private_dirs(storage)
    check_storage_root(storage)  # (the temp folder and the session folder are made here)
    clean_stale_temp_folders(storage)
    tmp = storage / f"{TMP_PREFIX}{session_id}-{os.getpid()}-{os.urandom(4).hex()}"
    os.mkdir(tmp, DIR_MODE)
    # Held until the folder is renamed or removed: a cleaner never removes a temp folder a live process uses.
    busy = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
    try:
        fcntl.flock(busy, fcntl.LOCK_EX)
    except BaseException:
        os.close(busy)
        os.rmdir(tmp)
        raise
    try:
        os.chmod(tmp, DIR_MODE)
        async with aiofiles.open(tmp / LOG_NAME, "xb", opener=_private_opener) as f:
            for chunk in sc._chunks(lines):
                await f.write(chunk)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        fsync_dir(tmp)
        try:
            os.rename(tmp, target)  # replaces only an empty folder; a non-empty one raises
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise SessionExistsError(f"session {session_id!r} already exists ({target} is in use); "
                                         "choose another session id (nothing is ever overwritten)") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(busy)
    fsync_dir(storage)
    return target / LOG_NAME


TMP_PREFIX = ".tmp-"
_TMP_RE = re.compile(r"\.tmp-(.+)-([0-9]+)-[0-9a-f]{8}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (someone else's process)
    return True


def clean_stale_temp_folders(storage: Path) -> list[Path]:
    """Remove the temp folders an import or fork killed midway left in ``storage``; returns what was removed.

    Only folders of ours: named ``.tmp-<session>-<pid>-<8 hex>``, real folders (not links) owned by this user,
    whose process is gone (no such pid), and whose ``flock`` can be taken: the process that makes one holds
    that lock until the folder is renamed into place or removed, so a folder being written is never touched.
    """
    removed: list[Path] = []
    for entry, m in _stale_entries(storage, _TMP_RE, 2, directory=True):
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live process holds it
            shutil.rmtree(entry.path)  # (never follows a link inside it)
            removed.append(Path(entry.path))
            logger.info("removed %s, left by an import or fork that did not finish (pid %s)", entry.path, m[2])
        except OSError as e:
            logger.info("could not remove the leftover temp folder %s: %s", entry.path, e)
        finally:
            os.close(fd)
    return removed


async def _create_in_backend(storage_path: str | os.PathLike[str], session_id: str, lines: list[bytes],
                             config: dict[str, Any]) -> str:
    """Other backends: one append of every record (one transaction on PostgreSQL); returns where it lives."""
    log = await open_log(storage_path, session_id, config)
    try:
        if log.last_seq:  # a row without events is an earlier creation that failed: reuse it
            raise SessionExistsError(f"session {session_id!r} already exists; choose another session id")
        await log.append(lines, 1)
    finally:
        await log.close()
    return str(log.path)  # a description (DSN, schema, session), not a filesystem path


async def _first_checkpoint(store_class: type[PersistentContextManager], storage_path: str | os.PathLike[str],
                            session_id: str, lines: list[bytes], config: dict[str, Any]) -> None:
    """Open a newly created long session once, so that its close writes the first checkpoint: its first resume
    then reads only the checkpoint's front section (docs/operations.md, "Lazy open"). A checkpoint is a cache:
    a failure here is logged and the session stands as created. ``store_class`` opens it (this module does
    not import the manager: the manager imports it)."""
    from ..storage.checkpoint import CLOSE_MIN_BYTES

    if sum(map(len, lines)) < CLOSE_MIN_BYTES:
        return  # a short log replays quickly; the first close writes a checkpoint when it is worth it
    backend = {k: config[k] for k in ("backend", "dsn", "pg_schema") if config.get(k) is not None}
    try:
        store = await store_class.open(storage_path=storage_path, session_id=session_id, **backend)
        await store.close()
    except Exception as e:
        logger.warning("session %s: created, but its first checkpoint could not be written (%s); the first open "
                       "will replay the whole log", session_id, e)


# -- fork -------------------------------------------------------------------------------------------
async def fork(store: PersistentContextManager, new_session_id: str, *, at_seq: int | None = None
               ) -> dict[str, Any]:
    """Create ``new_session_id`` holding ``store``'s history and pins as of ``at_seq`` (default: head).

    Its ``session_started`` carries ``parent: {session_id, seq}``. The parent is only read.
    """
    validate_session_id(new_session_id)
    store._check_open()
    if at_seq is None:
        state = store._full()
    else:
        _check_at_seq(at_seq, store.head_seq)
        log = await open_log(store.storage_path, store.session_id, store.config, readonly=True)
        try:
            state = await replay(log, at_seq)
        finally:
            await log.close()
    seq = state.head_seq
    pins = [i for i, k in enumerate(state.keys) if k in state.pinned]
    started = {"parent": {"session_id": store.session_id, "seq": seq},
               "tokenizer": state.session.get("tokenizer") or store.config.get("tokenizer") or DEFAULT_ENCODING}
    lines = session_lines(new_session_id, started, list(state.messages), pins)
    backend = store.config if store.config.get("backend", "file") != "file" else None
    log_path = await create_session(store.storage_path, new_session_id, lines, backend)
    await _first_checkpoint(type(store), store.storage_path, new_session_id, lines, backend or {})
    return {"session_id": new_session_id, "parent": store.session_id, "seq": seq,
            "messages": len(state.messages), "pinned": len(pins), "head_seq": len(lines), "path": str(log_path)}


__all__ = ["create_session", "export", "fork", "open_at", "replay", "view_messages", "write_atomic"]
