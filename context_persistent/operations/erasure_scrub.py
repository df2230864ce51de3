"""The copies of an erased message outside the log (erasure.py): the torn-tail and quarantine side files and
the compaction exports in a session folder (rewritten without it), the expired segments in the session's
trash entries (rewritten with tombstones, like the log), and the temp files a killed writer, repair or
checkpoint left behind (removed)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import orjson

from ..model import codec
from ..storage.paths import create_private_file, fsync_dir, write_all
from .tombstones import _copies, erased_data, tombstone

TMP_SUFFIX = ".erasing"
#: Replaces a removed copy in a side file or export (the digest says what was removed, never the bytes).
MARKER = b"[erased %s]"


# -- side files and exports -----------------------------------------------------------------------------
def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = create_private_file(path.parent, tmp.name)  # (never through a link planted in its place)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def escaped(needle: bytes) -> bytes:
    """``needle`` as it reads inside a JSON string (a quarantine file keeps bad pieces as JSON strings)."""
    return orjson.dumps(needle.decode())[1:-1]


def _scrub_side_file(path: Path, needle: bytes, digest: str) -> int:
    """Replace every copy of ``needle`` (as is, escaped inside a JSON string, or inside a base64 piece: a
    quarantined piece that is not UTF-8) in a side file by a marker; returns how many there were."""
    from .copies import scrub_base64

    data = path.read_bytes()
    marker = MARKER % digest.encode()
    forms = (needle, escaped(needle))
    n = 0
    for form in forms:
        k = data.count(form)
        if k:
            data = data.replace(form, marker)
            n += k
    data, k = scrub_base64(data, forms, marker)
    n += k
    if n:
        _atomic_write(path, data)
    return n


def _scrub_export(path: Path, needle: bytes, digest: str) -> int:
    """Drop the message lines holding ``needle`` from a JSONL compaction export; fix its header (message count,
    body checksum, ``erased`` count). Returns the lines dropped."""
    data = path.read_bytes()
    if data.find(needle) < 0:
        return 0
    lines = data.splitlines(keepends=True)
    try:
        header = orjson.loads(lines[0])
    except (orjson.JSONDecodeError, IndexError):
        header = None
    body = lines[1:] if isinstance(header, dict) else lines
    kept = [line for line in body if line.find(needle) < 0]
    dropped = len(body) - len(kept)
    if isinstance(header, dict):
        h = hashlib.sha256()
        for line in kept:
            h.update(line)
        header["body_sha256"] = "sha256:" + h.hexdigest()
        if isinstance(header.get("messages"), int):
            header["messages"] -= dropped
        header["erased"] = header.get("erased", 0) + dropped
        out = orjson.dumps(header) + b"\n" + b"".join(kept)
    else:
        out = b"".join(kept)
    if out.find(needle) >= 0:  # the message inside a line we could not split: replace the bytes themselves
        out = out.replace(needle, MARKER % digest.encode())
    _atomic_write(path, out)
    return dropped


def _places(directory: Path, kinds: tuple[str, ...]) -> list[Path]:
    from .copies import place_of

    out = []
    for p in directory.iterdir():
        place = place_of(p.name)
        if place is not None and place.kind in kinds and p.is_file():
            out.append(p)
    return sorted(out)


def side_paths(directory: Path) -> list[Path]:
    """The torn-tail and quarantine side files of a session folder (copies.py)."""
    return _places(directory, ("torn tail", "quarantine"))


def export_paths(directory: Path) -> list[Path]:
    """The compaction exports in a session folder (copies.py)."""
    return _places(directory, ("compaction export",))


# -- expired segments in the trash ----------------------------------------------------------------------
def trash_files(storage: Path, session_id: str) -> list[Path]:
    """The segment files of ``session_id``'s trash entries of expired segments (segment retention), oldest
    entry first."""
    from ..storage.segments import SEGMENT_PREFIX
    from .trash import entries_for, trash_dir

    out = []
    for name in entries_for(storage, session_id):
        folder = trash_dir(storage) / name
        try:
            files = sorted(folder.iterdir())
        except FileNotFoundError:  # (purged meanwhile)
            continue
        out += [p for p in files if p.name.startswith(SEGMENT_PREFIX) and p.name.endswith((".jsonl", ".jsonl.zst"))]
    return out


def _read_trash_file(path: Path) -> bytes:
    from ..storage.segments import decompress_all

    raw = path.read_bytes()
    return decompress_all(raw) if path.name.endswith(".zst") else raw


def _scan_trash_file(path: Path) -> Any:
    """``(record, start, end, raw line)`` of every record of an expired segment in the trash; LogCorruptedError
    for a line that is not a whole record (never skipped: the file may hold the erased bytes)."""
    from ..errors import LogCorruptedError

    try:
        data = _read_trash_file(path)
    except FileNotFoundError:  # (purged meanwhile: nothing left to erase there)
        return
    start = 0
    for n, line in enumerate(data.splitlines(keepends=True), 1):
        try:
            rec = codec.decode(line)
        except codec.RecordError as e:
            raise LogCorruptedError(str(path), n, start, f"{e}; an expired segment in the trash must hold whole "
                                    "records for erase to rewrite it: nothing was erased (restore the file from a "
                                    f"backup, or delete the entry with `context-persistent trash purge "
                                    f"{path.parent.name} --force`, then erase again)") from None
        yield rec, start, start + len(line), line
        start += len(line)


def _trash_changes(path: Path, needle: bytes, reason: str, when: str, key: bytes
                   ) -> list[tuple[int, int, bytes, dict[str, Any], list[int]]]:
    """``(start, end, tombstone, record, indices)`` of each record of a trashed segment holding ``needle``."""
    out = []
    for rec, start, end, _ in _scan_trash_file(path):
        hits = _copies(rec, needle)
        if hits:
            out.append((start, end, tombstone(rec, erased_data(rec, hits, reason, when, key)), rec, hits))
    return out


def _rewrite_trash_file(path: Path, changes: list[tuple[int, int, bytes, dict[str, Any], list[int]]]) -> bool:
    """Put the tombstones into a trashed segment (re-compressed if it was): a temp file, then one rename.
    False when the file is gone (its trash entry was purged meanwhile)."""
    from ..storage.segments import SEALED_MODE, compress

    try:
        data = bytearray(_read_trash_file(path))
    except FileNotFoundError:
        return False
    for start, end, line, *_ in sorted(changes, key=lambda c: c[0], reverse=True):
        data[start:end] = line
    blob = compress(bytes(data))[0] if path.name.endswith(".zst") else bytes(data)
    try:
        _atomic_write(path, blob)
    except FileNotFoundError:
        return False
    os.chmod(path, SEALED_MODE)
    fsync_dir(path.parent)
    return True


def clean_leftovers(directory: Path, trash: bool = False, session_id: str | None = None,
                    keep: frozenset[str] = frozenset()) -> list[str]:
    """Remove the leftovers that may hold copies (copies.py, the ``temp file`` and ``export temp file`` places,
    stale fork and import temp folders, half-purged trash entries of the session); ``trash``: a trash entry's
    folder (only ``*.erasing`` files). Returns the names removed."""
    from .copies import remove_leftovers

    if not trash:
        return remove_leftovers(directory, session_id or directory.name, keep)
    gone = []
    try:
        items = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for p in items:
        if p.name.endswith(TMP_SUFFIX):
            p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone
