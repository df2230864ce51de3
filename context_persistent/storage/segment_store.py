"""Writer-side steps on a segmented log: seal (roll), compress, replace a sealed segment, and recovery.

Every step that changes more than one file commits by writing the manifest (manifest.py) with the new
segment list and a ``pending`` list of the renames and removals still to do, then does them, then writes
the manifest again without them. A writer killed at any point leaves either the old manifest (and at most a
temp file nobody refers to, which :func:`recover` removes) or the new one with its pending steps, which
:func:`recover` carries out before the log is opened. Every step is named (``STEPS``) so that crash tests can
stop a writer exactly there (``CONTEXT_PERSISTENT_CRASH_AT``).

The caller holds the writer lock for all of this.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
from collections.abc import Iterator
from ..model.values import replace
from typing import NamedTuple
from pathlib import Path

from ..model import codec
from ..errors import LogCorruptedError, SessionNotFoundError
from .paths import LOCK_NAME, LOG_NAME, create_private_file, fsync_dir, write_all
from .lockfile import FileLock
from .records import data_end, scan
from .manifest import (check_segment_bytes, MANIFEST_NAME, SEALED_MODE, SEGMENT_PREFIX, ZST, Compressed, Manifest, ManifestError, Segment,
                       load_manifest, segment_name, sha256_hex, write_manifest)
from .segment_file import compress, decompress_all

logger = logging.getLogger("context_persistent")

#: Temp files of a compression or rewrite of a sealed segment end with this.
TMP = ".tmp"
#: Names of the points where a crash test may stop the writer (``CONTEXT_PERSISTENT_CRASH_AT=<name>``).
STEPS = ("roll-manifest", "roll-renamed", "roll-created", "compress-written", "compress-manifest",
         "compress-renamed", "replace-written", "replace-manifest", "replace-renamed", "migrate-written",
         "migrate-manifest", "expire-file-moved", "erase-copies-written", "repair-quarantine-written",
         "repair-log-written", "checkpoint-written")
CRASH_ENV = "CONTEXT_PERSISTENT_CRASH_AT"
#: The new active segment an erase writes (erasure.py) before its commit.
ACTIVE_ERASING = LOG_NAME + ".erasing"


def _step(name: str) -> None:
    """Crash-test hook: SIGKILL this process at step ``name`` if the environment asks for it."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _exists(directory: Path, name: str) -> bool:
    return os.path.lexists(directory / name)


# -- recovery ------------------------------------------------------------------------------------------
def recover(directory: Path, session_id: str, quiet: bool = False) -> tuple[Manifest | None, list[str]]:
    """Finish the pending steps a killed writer committed, remove temp files it never committed; return the
    manifest (None for a single-file log) and what was done (sentences, logged as warnings unless ``quiet``)."""
    actions: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / (MANIFEST_NAME + ".tmp"))
        actions.append(f"removed {MANIFEST_NAME}.tmp (a manifest update that never took effect)")
    manifest = load_manifest(directory, session_id)
    if manifest is None:  # a single-file log; a migration killed before its commit leaves temp files
        for entry in os.listdir(directory):
            if entry.startswith(SEGMENT_PREFIX) and entry.endswith(TMP):
                os.unlink(directory / entry)
                actions.append(f"removed {entry} (a migration that never took effect)")
        for a in actions:
            logger.log(logging.DEBUG if quiet else logging.WARNING, "%s: %s", directory, a)
        return None, actions
    by_name = {s.name: s for s in manifest.segments}
    keep: set[str] = set()
    for p in manifest.pending:
        op = p["op"]
        if op == "seal":
            name = p["name"]
            seg = by_name.get(name)
            if seg is None:
                raise ManifestError(directory / MANIFEST_NAME, f"a pending seal names {name}, which it does not list")
            if not _exists(directory, name) and not _exists(directory, name + ZST):
                active = directory / LOG_NAME
                size = os.stat(active).st_size if active.exists() else -1
                if size != seg.size:
                    raise ManifestError(directory / MANIFEST_NAME,
                                        f"sealing {name} ({seg.size} bytes) was begun but neither it nor a "
                                        f"{LOG_NAME} of that size is there ({LOG_NAME}: {size} bytes)")
                os.rename(active, directory / name)
                actions.append(f"finished sealing {name}: renamed {LOG_NAME} to it")
            with contextlib.suppress(FileNotFoundError):
                os.chmod(directory / name, SEALED_MODE)
        elif op == "replace":
            tmp, name = p["tmp"], p["name"]
            keep.add(tmp)
            if _exists(directory, tmp):
                if name != LOG_NAME:
                    os.chmod(directory / tmp, SEALED_MODE)
                os.replace(directory / tmp, directory / name)
                actions.append(f"finished replacing {name} by its new version")
        elif op == "expire":  # segment retention: move an expired file into its trash entry
            name, entry = p["name"], p["entry"]
            if _exists(directory, name):
                dest = directory.parent / ".retention" / "trash" / entry
                if not dest.exists():
                    os.makedirs(dest, 0o700, exist_ok=True)
                    fsync_dir(dest.parent)
                os.rename(directory / name, dest / name)
                fsync_dir(dest)
                fsync_dir(directory)
                actions.append(f"moved {name} into the trash entry {entry} (expired by retention)")
                _step("expire-file-moved")
        elif op == "remove":
            name = p["name"]
            if _exists(directory, name):
                os.unlink(directory / name)
                actions.append(f"removed {name} (replaced by its compressed or rewritten version)")
    for entry in os.listdir(directory):
        if (entry.startswith(SEGMENT_PREFIX) and entry.endswith(TMP) or entry == ACTIVE_ERASING) and entry not in keep:
            os.unlink(directory / entry)
            actions.append(f"removed {entry} (a compression or rewrite that never took effect)")
    if not _exists(directory, LOG_NAME):
        fd = create_private_file(directory, LOG_NAME)
        os.fsync(fd)
        os.close(fd)
        actions.append(f"created an empty {LOG_NAME} (a roll stopped before it)")
    if actions:
        fsync_dir(directory)
    if manifest.pending:
        actions.append(f"rewrote {MANIFEST_NAME} without its {len(manifest.pending)} pending step(s), all done now")
        manifest = manifest.with_segments(manifest.segments)
        write_manifest(directory, manifest)
    for a in actions:
        logger.log(logging.DEBUG if quiet else logging.WARNING, "%s: %s", directory, a)
    return manifest, actions


# -- sealing -------------------------------------------------------------------------------------------
def check_records(lines: Iterator[bytes], where: Path, after_seq: int) -> tuple[int, str, int, str, str]:
    """Verify the records of one segment before it is sealed: every line is a whole record whose checksum
    holds, and seqs increase (the chain is checked on every replay and by ``verify``). Returns
    ``(first_seq, first_crc, last_seq, last_crc, sha256)``; LogCorruptedError names the bad line."""
    h = hashlib.sha256()
    first_seq = 0
    first_crc = crc = b""
    offset = 0
    lineno = 0
    last = after_seq
    checked = codec.checked_seq
    for line in lines:
        lineno += 1
        h.update(line)
        try:
            if not line.endswith(b"\n"):
                raise codec.RecordError("the line has no newline (a record cut short)")
            seq, crc = checked(line)
        except codec.RecordError as e:
            raise LogCorruptedError(str(where), lineno, offset, f"{e}; the segment was not sealed") from None
        if seq <= last:
            raise LogCorruptedError(str(where), lineno, offset, f"seq {seq} does not follow seq {last}")
        if not first_seq:
            first_seq, first_crc = seq, crc
        last = seq
        offset += len(line)
    last_seq = last if first_seq else 0
    return first_seq, first_crc.decode(), last_seq, crc.decode(), "sha256:" + h.hexdigest()


class SealSummary(NamedTuple):
    """What the manifest records of a segment being sealed, as the writer tracked it while writing it."""

    first_seq: int
    first_crc: str
    last_seq: int
    last_crc: str
    sha256: str


def seal_active(directory: Path, manifest: Manifest, size: int,
                summary: SealSummary | None = None) -> tuple[Manifest, Segment, int]:
    """Seal the first ``size`` bytes (the whole data, already fsynced) of ``events.jsonl`` as the next sealed
    segment and start an empty active segment. Returns the new manifest, the segment and the new active file's
    descriptor (opened read-write).

    With ``summary`` (the writer's running hash and the first and last records it wrote or replayed), the file
    is not read at all; without it, every record is read back and checked (:func:`check_records`)."""
    active = directory / LOG_NAME
    prev = manifest.segments[-1] if manifest.segments else None
    if summary is not None:
        first_seq, first_crc, last_seq, last_crc, digest = summary
        if prev is not None and first_seq <= prev.last_seq:
            raise ValueError(f"{active} starts at seq {first_seq}, which does not follow seq {prev.last_seq}")
    else:
        with open(active, "rb") as f:
            def lines() -> Iterator[bytes]:
                left = size
                for line in f:
                    if left <= 0:
                        break
                    yield line[:left]
                    left -= len(line)
            first_seq, first_crc, last_seq, last_crc, digest = check_records(
                lines(), active, prev.last_seq if prev else 0)
    if not first_seq:
        raise ValueError(f"{active} holds no record: nothing to seal")
    name = manifest.next_name()
    seg = Segment(name, first_seq, last_seq, first_crc, last_crc, manifest.base, manifest.base + size, digest)
    sealing = manifest.with_segments(manifest.segments + (seg,), ({"op": "seal", "name": name},))
    write_manifest(directory, sealing)  # the commit point: from here on, the next open finishes the roll
    _step("roll-manifest")
    os.rename(active, directory / name)
    os.chmod(directory / name, SEALED_MODE)
    _step("roll-renamed")
    fd = create_private_file(directory, LOG_NAME, os.O_RDWR)
    try:
        os.fsync(fd)
        fsync_dir(directory)
        _step("roll-created")
        done = sealing.with_segments(sealing.segments)
        write_manifest(directory, done)
    except BaseException:
        os.close(fd)
        raise
    return done, seg, fd


# -- compressing and replacing sealed segments ---------------------------------------------------------
def read_segment(directory: Path, seg: Segment) -> bytes:
    """The uncompressed bytes of a sealed segment, checked against its SHA-256 (LogCorruptedError if not)."""
    with open(directory / seg.file, "rb") as f:
        raw = f.read()
    data = decompress_all(raw) if seg.compressed is not None else raw
    if len(data) != seg.size or sha256_hex(data) != seg.sha256:
        raise LogCorruptedError(str(directory / seg.file), 0, 0,
                                f"its contents ({len(data)} bytes, {sha256_hex(data)}) are not what the manifest "
                                f"recorded when it was sealed ({seg.size} bytes, {seg.sha256})")
    return data


def _write_tmp(directory: Path, name: str, data: bytes) -> None:
    fd = create_private_file(directory, name)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def compressed_form(data: bytes, seg: Segment) -> tuple[bytes, Segment]:
    """``data`` (the segment's bytes) as zstd frames, checked by decompressing, and the segment's new entry."""
    blob, frames = compress(data)
    if decompress_all(blob) != data:
        raise OSError(f"compressing {seg.name} did not give back the same bytes; it was left uncompressed")
    return blob, replace(seg, compressed=Compressed(len(blob), sha256_hex(blob), frames))


def compress_segment(directory: Path, manifest: Manifest, index: int) -> Manifest:
    """Store sealed segment ``index`` as zstd frames (``<name>.zst``) and remove the plain file."""
    seg = manifest.segments[index]
    if seg.compressed is not None:
        return manifest
    data = read_segment(directory, seg)
    blob, new = compressed_form(data, seg)
    tmp = new.file + TMP
    _write_tmp(directory, tmp, blob)
    _step("compress-written")
    segments = manifest.segments[:index] + (new,) + manifest.segments[index + 1:]
    pending = ({"op": "replace", "tmp": tmp, "name": new.file}, {"op": "remove", "name": seg.name})
    write_manifest(directory, manifest.with_segments(segments, pending))  # the commit point
    _step("compress-manifest")
    os.chmod(directory / tmp, SEALED_MODE)
    os.replace(directory / tmp, directory / new.file)
    fsync_dir(directory)
    _step("compress-renamed")
    os.unlink(directory / seg.name)
    fsync_dir(directory)
    done = manifest.with_segments(segments)
    write_manifest(directory, done)
    return done


def replace_segments(directory: Path, manifest: Manifest, new_data: dict[int, bytes],
                     active_tmp: str | None = None) -> Manifest:
    """Replace the contents of sealed segments (index -> new uncompressed bytes with the same first and last
    seq and crc: erasure tombstones; a new length moves the byte ranges after it) and, with ``active_tmp``, the active segment by that
    complete, fsynced temp file, in one commit (the manifest). Compressed segments are re-compressed."""
    segments = list(manifest.segments)
    pending: list[dict[str, str]] = []
    pos = manifest.start  # (0, or where the log begins after expired segments)
    for index, seg in enumerate(segments):  # a new size moves the byte ranges of the segments after it
        size = len(new_data[index]) if index in new_data else seg.size
        segments[index] = replace(seg, start=pos, end=pos + size)
        pos += size
    for index, data in sorted(new_data.items()):
        seg = segments[index]
        new = replace(seg, sha256=sha256_hex(data), compressed=None)
        blob = data
        if seg.compressed is not None:
            blob, new = compressed_form(data, new)
        tmp = new.file + TMP
        _write_tmp(directory, tmp, blob)
        segments[index] = new
        pending.append({"op": "replace", "tmp": tmp, "name": new.file})
    if active_tmp is not None:
        pending.append({"op": "replace", "tmp": active_tmp, "name": LOG_NAME})
    fsync_dir(directory)
    _step("replace-written")
    write_manifest(directory, manifest.with_segments(tuple(segments), tuple(pending)))  # the commit point
    _step("replace-manifest")
    for p in pending:
        if p["name"] != LOG_NAME:
            os.chmod(directory / p["tmp"], SEALED_MODE)
        os.replace(directory / p["tmp"], directory / p["name"])
    fsync_dir(directory)
    _step("replace-renamed")
    done = manifest.with_segments(tuple(segments))
    write_manifest(directory, done)
    return done


# -- migrating a single-file log -------------------------------------------------------------------------
#: The temp name of the new, empty active segment a migration writes before its commit.
_ACTIVE_TMP = SEGMENT_PREFIX + "active.jsonl" + TMP


def split_points(data: bytes, segment_bytes: int) -> list[int]:
    """Where to cut ``data`` (whole records) into segments: each ends at the first record end at or after
    ``segment_bytes`` from its start (as rolling would have cut it); the last holds what is left."""
    cuts = []
    start = 0
    while start < len(data):
        if segment_bytes <= 0 or start + segment_bytes >= len(data):
            cuts.append(len(data))
            break
        nl = data.find(b"\n", start + segment_bytes - 1)
        end = len(data) if nl < 0 else nl + 1
        cuts.append(end)
        start = end
    return cuts


def migrate_locked(directory: Path, session_id: str, segment_bytes: int, compress_segments: bool) -> dict[str, object]:
    """Convert the single-file log in ``directory`` to sealed segments (the caller holds the writer lock), or,
    for a log that has segments already, compress the sealed ones when asked. Returns what was done.

    Every record goes into a sealed segment (cut every ``segment_bytes``, 0: one segment) and the active
    segment starts empty. The old file stays the log until the new files are written, fsynced and verified and
    the manifest that lists them is written (the commit point); the next writer finishes a migration killed
    after that point and removes the temp files of one killed before it. Global positions equal the old byte
    offsets, so a checkpoint stays valid.
    """
    manifest, recovered = recover(directory, session_id)
    done: dict[str, object] = {"session": session_id, "recovered": recovered, "sealed": [], "compressed": []}
    if manifest is not None:
        if compress_segments:
            for i, seg in enumerate(manifest.segments):
                if seg.compressed is None:
                    manifest = compress_segment(directory, manifest, i)
                    done["compressed"] = [*done["compressed"], seg.name + ZST]  # type: ignore[misc]
        done["already"] = True
        return done
    active = directory / LOG_NAME
    with open(active, "rb") as f:
        size = data_end(f.fileno())
        data = f.read(size)
    end = 0
    for _, end in scan(active, 0, 1, size, strict_tail=True):
        pass
    if end != size:
        raise LogCorruptedError(str(active), 0, end, f"the {size - end} bytes after the last valid record are not "
                                "a record (a torn tail): open the session once (it cuts them to a side file) or "
                                "run `context-persistent repair`, then migrate")
    if not data:
        raise ValueError(f"{active} holds no record: nothing to migrate")
    empty = Manifest(session_id)
    segments: list[Segment] = []
    pending: list[dict[str, str]] = []
    start = 0
    prev_seq = 0
    for cut in split_points(data, segment_bytes):
        chunk = data[start:cut]
        name = segment_name(len(segments) + 1)
        first_seq, first_crc, last_seq, last_crc, digest = check_records(
            iter(chunk.splitlines(keepends=True)), active, prev_seq)
        seg = Segment(name, first_seq, last_seq, first_crc, last_crc, start, cut, digest)
        blob = chunk
        if compress_segments:
            blob, seg = compressed_form(chunk, seg)
        _write_tmp(directory, seg.file + TMP, blob)
        if read_back(directory / (seg.file + TMP), seg) != chunk:
            raise OSError(f"{seg.file + TMP} does not read back as written; nothing was changed")
        segments.append(seg)
        pending.append({"op": "replace", "tmp": seg.file + TMP, "name": seg.file})
        start, prev_seq = cut, last_seq
    _write_tmp(directory, _ACTIVE_TMP, b"")
    pending.append({"op": "replace", "tmp": _ACTIVE_TMP, "name": LOG_NAME})
    fsync_dir(directory)
    _step("migrate-written")
    write_manifest(directory, empty.with_segments(tuple(segments), tuple(pending)))  # the commit point
    _step("migrate-manifest")
    manifest, _ = recover(directory, session_id, quiet=True)  # the renames, exactly as after a crash
    done["sealed"] = [seg.file for seg in segments]
    done["bytes"] = size
    return done


def read_back(path: Path, seg: Segment) -> bytes:
    """The uncompressed bytes of a segment file just written (compressed or not)."""
    with open(path, "rb") as f:
        raw = f.read()
    return decompress_all(raw) if seg.compressed is not None else raw


def migrate(directory: Path, session_id: str, segment_bytes: int, compress_segments: bool = False) -> dict[str, object]:
    """:func:`migrate_locked` holding the session's writer lock (SessionLockedError while a store has it open)."""
    check_segment_bytes(segment_bytes)
    if not (directory / LOG_NAME).exists() and not (directory / MANIFEST_NAME).exists():
        raise SessionNotFoundError(f"session {session_id!r} not found: no {directory / LOG_NAME}")
    lock = FileLock(directory / LOCK_NAME, session_id)
    try:
        return migrate_locked(directory, session_id, segment_bytes, compress_segments)
    finally:
        lock.release()


__all__ = ["STEPS", "SealSummary", "compress_segment", "migrate", "read_segment", "recover", "replace_segments", "seal_active"]
