"""New sessions: built from messages (import) or from another session's history as of a seq (fork) (I/O).

- ``session_lines`` and ``create_session`` build a NEW session from messages; ``store.importing.import_``
  uses them to create one from a snapshot, an Amplifier CLI ``transcript.jsonl`` or the reference module's
  ``context-messages.jsonl``.
- ``fork(store, new_session_id, at_seq=...)`` creates a NEW session holding the history and pins as of a seq,
  whose ``session_started`` names its parent.

A new session is built completely in a hidden temp folder beside its final place and renamed into place in
one step, so a failure at any point leaves no half-written session (see docs/snapshots.md).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles  # type: ignore[import-untyped]
import orjson

from ..model import codec
from ..model import events as ev
from . import snapshot_codec as sc
from .atomic_files import _private_opener, _stale_entries
from .time_travel import _check_at_seq, replay
from ..errors import SessionExistsError
from ..storage.paths import (DIR_MODE, LOG_NAME, NOFOLLOW, check_storage_root, fsync_dir, make_private_dirs,
                             session_dir, validate_session_id)
from ..storage.backends import open_log
from ..model.projection import make_key
from ..model.tokens import DEFAULT_ENCODING

logger = logging.getLogger("context_persistent.transfer.new_session")

if TYPE_CHECKING:
    from ..store.manager import PersistentContextManager

PROGRAM = "context-persistent"


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
