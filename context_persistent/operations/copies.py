"""Every kind of file or row a message's bytes can reach, in one list: ``PLACES``.

Erasure (erasure.py), ``verify --receipt`` (erasure_receipt.py), the removal of leftovers a killed process
left (``leftovers``) and the trash's purge all take their list of places from here, so a new kind of file the
store writes is one entry here, and a test (tests/test_copies.py) fails until it is. Each place says in which
encodings it holds the bytes (raw, escaped inside a JSON string, base64, zstd) and what erase does with it;
places erase cannot reach are listed too (``covered=False``) and the receipt names them (``not_covered``).

The temp-file names of exports, forks and imports are written by transfer/atomic_files.py and
transfer/new_session.py; the patterns here match them (a test checks that they are the same).
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..storage.lockfile import pid_alive
from ..storage.manifest import MANIFEST_NAME
from ..storage.paths import CHECKPOINT_BASE_NAME, CHECKPOINT_NAME, LOCK_NAME, LOG_NAME, NOFOLLOW, fsync_dir
from ..storage.trash_folder import PURGING, trash_dir

RAW, ESCAPED, BASE64, ZSTD = "raw", "json-escaped", "base64", "zstd"


@dataclass(frozen=True, slots=True)
class Place:
    """One kind of place a message's bytes can reach.

    ``scope``: ``session`` (a file in the session folder), ``storage`` (in the storage root), ``trash`` (in the
    session's trash entries), ``postgres`` (rows or server files). ``pattern``: the file or folder name
    (a full match), None for rows. ``erase``: what erase does with it. ``covered``: False where erase cannot
    remove the bytes (the receipt lists it under ``not_covered`` with ``note``)."""

    kind: str
    scope: str
    pattern: re.Pattern[str] | None
    encodings: tuple[str, ...]
    erase: str
    note: str = ""
    covered: bool = True

    def matches(self, name: str) -> bool:
        return self.pattern is not None and self.pattern.fullmatch(name) is not None


def _p(regex: str) -> re.Pattern[str]:
    return re.compile(regex)


_LOG = re.escape(LOG_NAME)
_CP = re.escape(CHECKPOINT_NAME)
_BASE = re.escape(CHECKPOINT_BASE_NAME)
_MANIFEST = re.escape(MANIFEST_NAME)
#: A temp file of an export written beside its target (transfer/atomic_files.py ``write_atomic``).
EXPORT_TMP = _p(r"\..+\.tmp-([0-9]+)-[0-9a-f]{8}")
#: The temp folder of a fork or an import, in the storage root (transfer/new_session.py ``create_session``).
SESSION_TMP = _p(r"\.tmp-(.+)-([0-9]+)-[0-9a-f]{8}")

PLACES: tuple[Place, ...] = (
    # the session folder
    Place("log", "session", _p(_LOG), (RAW,), "tombstones"),
    Place("sealed segment", "session", _p(r"segment-[0-9]{6,}\.jsonl"), (RAW,), "tombstones"),
    Place("compressed segment", "session", _p(r"segment-[0-9]{6,}\.jsonl\.zst"), (ZSTD,), "tombstones"),
    Place("manifest", "session", _p(_MANIFEST), (), "holds no message",
          "segment names, positions and checksums only"),
    Place("lock", "session", _p(re.escape(LOCK_NAME)), (), "holds no message", "the writer's pid and host"),
    Place("checkpoint", "session", _p(_CP + "|" + _BASE), (RAW,), "deleted",
          "a cache: the next close writes a new one"),
    Place("torn tail", "session", _p(_LOG + r"\.torn-.+"), (RAW,), "scrubbed", "copies replaced by a marker"),
    Place("quarantine", "session", _p(_LOG + r"\.quarantine-.+"), (RAW, ESCAPED, BASE64), "scrubbed",
          "a piece kept as text (escaped) or, if not UTF-8, as base64 (raw_b64): copies replaced by a marker"),
    Place("compaction export", "session", _p(r"compaction-.+\.jsonl"), (RAW,), "lines dropped",
          "header counts and checksum fixed: the file still imports"),
    Place("temp file", "session", _p(r"(" + _LOG + r"\.(erasing|repair-tmp|repair-quarantine\.tmp)|"
                                         + _CP + r"\.tmp|" + _BASE + r"\.tmp|" + _MANIFEST + r"\.tmp|"
                                         r"segment-.+\.tmp)"), (RAW, ZSTD), "deleted",
          "left by a killed erase, repair, checkpoint, roll or compression (the writer holds the lock: none of "
          "them is running)"),
    Place("export temp file", "session", EXPORT_TMP, (RAW,), "deleted",
          "left by a killed export_on_compact (its process is gone)"),
    # the storage root
    Place("fork or import temp folder", "storage", SESSION_TMP, (RAW,), "deleted when stale",
          "left by a killed fork or import (its process gone, its lock free); one still being written is "
          "another session's creation: erase it there once it exists"),
    Place("search index", "storage", _p(r"\.search"), (RAW,), "documents removed, index purged",
          "the message's documents (and those identical to it) are removed and the index purged before the log "
          "changes, then the rest moved in line with the new log, or the session indexed again from it "
          "(operations/search/erasing.py; docs/search.md, \"Erasure\")"),
    Place("expired segment in the trash", "trash", _p(r"segment-[0-9]{6,}\.jsonl(\.zst)?"), (RAW, ZSTD),
          "tombstones"),
    Place("trash entry being purged", "trash", _p(re.escape(PURGING) + r".+"), (RAW, ZSTD), "purge finished",
          "a purge killed after its rename: its ledger record is written, erase deletes the rest"),
    # PostgreSQL
    Place("record rows", "postgres", None, (RAW,), "tombstones"),
    Place("checkpoint row", "postgres", None, (RAW,), "deleted"),
    Place("dead row versions", "postgres", None, (RAW,), "vacuum=True",
          "the rows' old versions stay in the table's pages until VACUUM; plain VACUUM frees them but the bytes "
          "may remain in free page space until overwritten; VACUUM FULL (vacuum=\"full\") rewrites the tables",
          covered=False),
    Place("write-ahead log", "postgres", None, (RAW,), "not reachable",
          "the WAL, archived WAL, replicas and backups keep the original inserts for their own retention",
          covered=False),
    # elsewhere
    Place("snapshots", "elsewhere", None, (RAW,), "not chased",
          "exports made with export() or the CLI, forks and imports (other sessions: erase there), backups",
          covered=False),
)


def place_of(name: str, scope: str = "session") -> Place | None:
    """The place a file named ``name`` in ``scope`` is, or None if the store never writes such a file."""
    for p in PLACES:
        if p.scope == scope and p.matches(name):
            return p
    return None


def not_covered(backend: str) -> list[dict[str, str]]:
    """What a receipt says erase did not reach, for ``backend`` (``file`` or ``postgres``)."""
    scopes = {"elsewhere", "postgres"} if backend == "postgres" else {"elsewhere"}
    return [{"what": p.kind, "why": p.note} for p in PLACES if not p.covered and p.scope in scopes]


# -- encodings ----------------------------------------------------------------------------------------
_B64_RUN = re.compile(rb"[A-Za-z0-9+/]{16,}={0,2}")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def base64_runs(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """``(start, end, decoded)`` of every run of base64 text in ``data`` that decodes."""
    for m in _B64_RUN.finditer(data):
        run = m.group()
        if len(run) % 4:
            continue
        try:
            yield m.start(), m.end(), base64.b64decode(run, validate=True)
        except (binascii.Error, ValueError):
            continue


def views(data: bytes, zstd: bool = False) -> Iterator[tuple[str, bytes]]:
    """``(encoding, bytes)``: ``data`` as it is, decompressed (``zstd``: a compressed segment), and each
    base64 run decoded; the caller searches each for the raw and the JSON-escaped forms."""
    if zstd:
        from ..storage.segments import decompress_all

        data = decompress_all(data)
    yield (ZSTD if zstd else RAW), data
    for start, _, decoded in base64_runs(data):
        if b"{" in decoded:
            yield f"{BASE64} at offset {start}", decoded


def scrub_base64(data: bytes, forms: tuple[bytes, ...], marker: bytes) -> tuple[bytes, int]:
    """``data`` with each base64 run whose decoding holds one of ``forms`` re-encoded with ``marker`` in its
    place; and how many copies there were."""
    out = []
    pos = n = 0
    for start, end, decoded in base64_runs(data):
        k = 0
        for form in forms:
            k += decoded.count(form)
            decoded = decoded.replace(form, marker)
        if k:
            out += [data[pos:start], base64.b64encode(decoded)]
            pos = end
            n += k
    out.append(data[pos:])
    return b"".join(out), n


# -- leftovers ------------------------------------------------------------------------------------------

def session_leftovers(directory: Path, keep: frozenset[str] = frozenset()) -> list[Path]:
    """The temp files in a session folder that hold copies and belong to no running step: everything of the
    ``temp file`` place but ``keep`` (names a committed manifest still lists as pending), and export temp files
    whose process is gone (or is this one: the caller holds the session's rewrite lock, so no export of this
    process is in flight)."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    temp = next(p for p in PLACES if p.kind == "temp file")
    for e in entries:
        if e.name in keep or not e.is_file(follow_symlinks=False):
            continue
        if temp.matches(e.name):
            out.append(Path(e.path))
        elif (m := EXPORT_TMP.fullmatch(e.name)) is not None:
            pid = int(m[1])
            if pid == os.getpid() or not pid_alive(pid):
                out.append(Path(e.path))
    return sorted(out)


def stale_session_temps(storage: Path) -> list[Path]:
    """Temp folders of forks and imports in ``storage`` whose process is gone and whose lock is free (one
    being written is held by its process: never touched)."""
    out = []
    try:
        entries = list(os.scandir(storage))
    except FileNotFoundError:
        return []
    for e in entries:
        m = SESSION_TMP.fullmatch(e.name)
        if m is None or not e.is_dir(follow_symlinks=False) or pid_alive(int(m[2])):
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        finally:
            os.close(fd)
        out.append(Path(e.path))
    return sorted(out)


def purging_entries(storage: Path, session_id: str) -> list[Path]:
    """The session's trash entries a killed purge left renamed to ``.purging-<entry>`` (recorded as purged)."""
    from ..model.retention import ENTRY_SEP

    trash = trash_dir(storage)
    prefix = PURGING + session_id + ENTRY_SEP
    try:
        names = os.listdir(trash)
    except FileNotFoundError:
        return []
    return sorted(trash / n for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())


def remove_leftovers(directory: Path, session_id: str, keep: frozenset[str] = frozenset()) -> list[str]:
    """Remove every leftover that may hold a copy of the session's messages: the session folder's temp files,
    the storage's stale fork and import temp folders, the session's half-purged trash entries. Returns what
    was removed (a name in the session folder, or a folder's path from the storage root ending in ``/``)."""
    storage = directory.parent
    gone = []
    for p in session_leftovers(directory, keep):
        p.unlink(missing_ok=True)
        gone.append(p.name)
    for p in stale_session_temps(storage):
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name + "/")
    purged = purging_entries(storage, session_id)
    for p in purged:
        shutil.rmtree(p, ignore_errors=True)
        gone.append(f"{p.parent.parent.name}/{p.parent.name}/{p.name}/")
    if gone:
        fsync_dir(directory)
        fsync_dir(storage)
    if purged:
        fsync_dir(purged[0].parent)
    return gone


__all__ = ["BASE64", "ESCAPED", "PLACES", "RAW", "ZSTD", "Place", "base64_runs", "not_covered", "place_of",
           "purging_entries", "remove_leftovers", "scrub_base64", "session_leftovers", "stale_session_temps",
           "views"]
