"""Erasure: remove a message's bytes from everything the store wrote, keep a tombstone, hand out a receipt.

``redact`` hides a message (its bytes stay in the log); ``erase`` removes them (docs/operations.md,
"Erasure"). The record that held the message is replaced, at the same seq, by an ``erased`` tombstone that
keeps the record's ``prev`` and ``ts`` and is padded (``data.pad``) so that its own CRC-32 equals the CRC of
the record it replaces: the next record's ``prev`` still names it, so the chain, ``verify``, checkpoints'
anchors and every reader work unchanged (docs/format.md, "Erasure tombstones"). CRC-32 is affine over GF(2),
so 48 pad characters, each ``a`` or ``c``, give a linear system whose solution is found by elimination.

Every copy of the message's bytes in the log is erased (a ``messages_replaced`` that carried the message
forward holds a copy, and so does an ``expired`` record that carries it: segment retention); checkpoints are
deleted (a cache: the next close writes a new one); the torn-tail and quarantine side files and the compaction
exports in the session folder are rewritten without it, and the expired segments in the session's trash
entries get the same tombstones as the log. The order
makes a crash at any point safe: side copies first (a crash leaves the old log: nothing was acknowledged),
then the log in one atomic rename, the commit point.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import orjson

from ..model import codec
from ..model import events as ev
from ..storage.paths import CHECKPOINT_NAME, LOG_NAME, create_private_file, fsync_dir, write_all
from ..model.projection import make_key, split_key
from ..storage.segment_store import _step

RECEIPT_VERSION = 1
PAD_CHARS = 48
#: Side files the store writes into a session folder (repair.py names the first two).
SIDE_PREFIXES = (LOG_NAME + ".torn-", LOG_NAME + ".quarantine-")
EXPORT_PREFIX = "compaction-"
TMP_SUFFIX = ".erasing"
#: Replaces a removed copy in a side file or export (the digest says what was removed, never the bytes).
MARKER = b"[erased %s]"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- the tombstone ------------------------------------------------------------------------------------
def _forge_pad(head: bytes, tail: bytes, target: int) -> bytes:
    """A pad ``p`` of ``PAD_CHARS`` characters from {a, c} with ``crc32(head + p + tail + b"}") == target``."""

    def crc(pad: bytes) -> int:
        return zlib.crc32(b"}", zlib.crc32(tail, zlib.crc32(pad, zlib.crc32(head))))

    zero = b"a" * PAD_CHARS
    base = crc(zero)
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (delta vector, which pad positions make it)
    for i in range(PAD_CHARS):
        vec = crc(zero[:i] + b"c" + zero[i + 1:]) ^ base  # ('a' ^ 'c' flips one bit: the delta is linear)
        mask = 1 << i
        for bit in range(31, -1, -1):
            if not vec >> bit & 1:
                continue
            if bit in basis:
                vec ^= basis[bit][0]
                mask ^= basis[bit][1]
            else:
                basis[bit] = (vec, mask)
                break
    want = base ^ target
    mask = 0
    for bit in range(31, -1, -1):
        if want >> bit & 1:
            if bit not in basis:  # (never seen: 48 positions span the 32 bits)
                raise RuntimeError("cannot pad the tombstone to its CRC")
            want ^= basis[bit][0]
            mask ^= basis[bit][1]
    pad = bytes(ord("c") if mask >> i & 1 else ord("a") for i in range(PAD_CHARS))
    assert crc(pad) == target
    return pad


def tombstone(rec: dict[str, Any], data: dict[str, Any]) -> bytes:
    """The ``erased`` record (with its newline) replacing ``rec``: same seq, ts and prev, same crc."""
    if rec.get("prev") is None:  # a version 1 record (upcast on reading) has no link: nor has its tombstone
        env = b'{"v":1,"seq":%d,' % rec["seq"]
    else:
        env = b'{"v":%d,"seq":%d,"prev":"%s",' % (codec.FORMAT_VERSION, rec["seq"], rec["prev"].encode())
    env += b'"ts":%s,"type":"%s","data":' % (orjson.dumps(rec["ts"]), ev.ERASED.encode())
    body = codec.dumps({k: v for k, v in data.items() if k != "pad"})
    head = env + body[:-1] + b',"pad":"'
    tail = b'"}'
    target = int(rec["crc"], 16)
    pad = _forge_pad(head, tail, target)
    line = head + pad + tail + b',"crc":"%s"}\n' % rec["crc"].encode()
    codec.decode(line)  # (checks framing and crc)
    return line


#: Records holding a list of messages (a tombstone keeps the list, with null at the erased indices).
LIST_RECORDS = (ev.MESSAGES_REPLACED, ev.SYSTEM_PROMPT_SET)


def erased_data(rec: dict[str, Any], indices: list[int], reason: str, when: str) -> dict[str, Any]:
    """The tombstone data for erasing the messages at ``indices`` of ``rec`` (a message record or a tombstone
    of a ``messages_replaced`` record, erased again)."""
    kind, data, seq = rec["type"], rec["data"], rec["seq"]
    expired = ev.expired_of(rec)
    if expired is not None:
        return _erased_expired(rec, expired, indices, reason, when)
    if kind == ev.ERASED:
        out = {k: v for k, v in data.items() if k != "pad"}
        out["messages"] = list(out["messages"])
        out["erased"] = list(out["erased"])
        messages = out["messages"]
    else:
        messages = [data["message"]] if kind == ev.MESSAGE_ADDED else list(data["messages"])
        out = {"of": kind, "erased": [], "reason": reason, "erased_at": when}
        if kind in LIST_RECORDS:
            out["messages"] = messages
    for i in indices:
        m = messages[i]
        blob = codec.dumps(m)
        out["erased"].append({"index": i, "key": make_key(seq, i), "role": m.get("role"), "sha256": sha256(blob),
                              "bytes": len(blob)})
        if kind != ev.MESSAGE_ADDED and "messages" in out:
            out["messages"][i] = None
    if kind == ev.ERASED:
        out["reason"] = reason
        out["erased_at"] = when
    return out


def _erased_expired(rec: dict[str, Any], expired: dict[str, Any], indices: list[int], reason: str,
                    when: str) -> dict[str, Any]:
    """The tombstone data for erasing the carried copies at ``indices`` of an ``expired`` record (or of its
    tombstone, erased again): the record's data is kept under ``expired``, each erased copy replaced by
    ``{key, message: null, role}`` (the role keeps the system-prompt rule's placeholder right)."""
    if rec["type"] == ev.ERASED:
        out = {k: v for k, v in rec["data"].items() if k != "pad"}
        out["erased"] = list(out["erased"])
    else:
        out = {"of": ev.EXPIRED, "erased": []}
    out["reason"], out["erased_at"] = reason, when
    carried = [dict(c) for c in expired["carried"]]
    for i in indices:
        m = carried[i]["message"]
        blob = codec.dumps(m)
        out["erased"].append({"index": i, "key": carried[i]["key"], "role": m.get("role"), "sha256": sha256(blob),
                              "bytes": len(blob)})
        carried[i] = {"key": carried[i]["key"], "message": None, "role": m.get("role")}
    out["expired"] = {**expired, "carried": carried}
    return out


def message_slots(rec: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """``(index, message)`` of every message a record holds (erased slots left out); an ``expired`` record
    holds its carried copies."""
    kind, data = rec["type"], rec["data"]
    if kind == ev.MESSAGE_ADDED:
        return [(0, data["message"])]
    if kind in LIST_RECORDS:
        return list(enumerate(data["messages"]))
    if kind == ev.ERASED and data.get("of") in LIST_RECORDS:
        return [(i, m) for i, m in enumerate(data["messages"]) if m is not None]
    expired = ev.expired_of(rec)
    if expired is not None:
        return [(j, c["message"]) for j, c in enumerate(expired["carried"]) if c["message"] is not None]
    return []


# -- finding the copies ---------------------------------------------------------------------------------
def find_target(records: Any, seq: int, index: int) -> dict[str, Any]:
    """The message at ``(seq, index)`` among ``records``: the record ``seq`` holds it, or an ``expired``
    record carries a copy of it (its record expired); ValueError if none does."""
    key = make_key(seq, index)
    erased = False
    for rec in records:
        if rec["seq"] == seq:
            for i, m in message_slots(rec):
                if i == index:
                    return m  # type: ignore[no-any-return]
            if rec["type"] == ev.ERASED:
                raise ValueError(f"the message at seq {seq} (index {index}) is already erased")
            raise ValueError(f"seq {seq} is a {rec['type']} record, which holds no message at index {index}")
        expired = ev.expired_of(rec) if rec["seq"] > seq else None
        for c in expired["carried"] if expired is not None else ():
            if c["key"] == key:
                if c["message"] is not None:
                    return c["message"]  # type: ignore[no-any-return]
                erased = True
    if erased:
        raise ValueError(f"the message at seq {seq} (index {index}) is already erased")
    raise ValueError(f"seq {seq} is not in this session's log")


def _copies(rec: dict[str, Any], needle: bytes) -> list[int]:
    return [i for i, m in message_slots(rec) if codec.dumps(m) == needle]


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
    """Replace every copy of ``needle`` (as is, or escaped inside a JSON string) in a side file by a marker;
    returns how many there were."""
    data = path.read_bytes()
    n = 0
    for form in (needle, escaped(needle)):
        k = data.count(form)
        if k:
            data = data.replace(form, MARKER % digest.encode())
            n += k
    if n:
        _atomic_write(path, data)
    return n


def _scrub_export(path: Path, needle: bytes) -> int:
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
        out = out.replace(needle, MARKER % sha256(needle).encode())
    _atomic_write(path, out)
    return dropped


def side_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith(SIDE_PREFIXES)
                  and not p.name.endswith(TMP_SUFFIX))


def export_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith(EXPORT_PREFIX)
                  and not p.name.endswith(TMP_SUFFIX))


# -- the file log ---------------------------------------------------------------------------------------
def _scan_file(path: Path, size: int) -> Any:
    """``(record, start, end, raw line)`` of every record of the log up to ``size``."""
    from ..storage.log import scan

    with open(path, "rb") as f:
        start = 0
        for rec, end in scan(path, 0, 1, size):
            f.seek(start)
            yield rec, start, end, f.read(end - start)
            start = end


def _scan_segmented(directory: Path, session_id: str, end: int) -> Any:
    """As :func:`_scan_file` across a segmented log, with global positions (segments.py)."""
    from ..storage.segments import LogReader

    with LogReader(directory, session_id) as reader:
        for start, line in reader.lines(0, end):
            yield codec.decode(line), start, start + len(line), line


def erase_file(store: Any, seq: int, index: int, reason: str) -> dict[str, Any]:
    """Erase the message at ``(seq, index)`` from a file session held by ``store`` (its writer). Returns the
    receipt. The caller rebuilds the store's state afterwards."""
    log = store._log
    path: Path = log.path
    directory: Path = log.directory
    size = log.size
    segmented = log.manifest is not None and (bool(log.manifest.segments) or log.manifest.boundary is not None)
    if segmented:
        end = log.position

        def records() -> Any:
            return _scan_segmented(directory, log.session_id, end)
    else:
        def records() -> Any:
            return _scan_file(path, size)
    boundary = log.manifest.boundary if log.manifest is not None else None
    trashed = trash_files(directory.parent, log.session_id)
    try:
        message = find_target((r for r, *_ in records()), seq, index)
    except ValueError:
        if boundary is None or seq > boundary.last_seq:
            raise
        try:  # expired and not carried: only its trash entry may hold it
            message = find_target((r for p in trashed for r, *_ in _scan_trash_file(p)), seq, index)
        except ValueError as e:
            if "already erased" in str(e):
                raise
            raise ValueError(f"seq {seq} expired with the oldest log segments (seqs 1..{boundary.last_seq}) and no "
                             "expired record carries it nor any trash entry holds it (purged): nothing stored holds "
                             "its bytes") from None
    needle = codec.dumps(message)
    digest = sha256(needle)
    when = codec.now_iso()
    trash_changes = [(p, c) for p in trashed if (c := _trash_changes(p, needle, reason, when))]
    # 1. every record holding a copy, and its tombstone
    changes: list[tuple[int, int, bytes, dict[str, Any], list[int], str]] = []
    for rec, start, end, raw in records():
        hits = _copies(rec, needle)
        if hits:
            line = tombstone(rec, erased_data(rec, hits, reason, when))
            changes.append((start, end, line, rec, hits, sha256(raw.rstrip(b"\n"))))
    receipt = _receipt(store, message, needle, seq, index, reason, when)
    receipt["removed_temp_files"] = clean_leftovers(directory) + [
        f"{folder.name}/{name}" for folder in sorted({p.parent for p in trashed})
        for name in clean_leftovers(folder, trash=True)]
    receipt["records"] = [{"seq": rec["seq"], "type": rec["type"], "indices": hits, "offset": start,
                           "bytes": end - start, "record_sha256": raw_digest}
                          for start, end, _, rec, hits, raw_digest in changes]
    if segmented:  # which file held each record (offsets are global positions: docs/format.md, "Segments")
        for item in receipt["records"]:
            i = log.manifest.index_at(item["offset"])
            item["segment"] = log.manifest.segments[i].file if i >= 0 else LOG_NAME
    # 2. the checkpoint (a cache holding the history): deleted before the log changes, so that a crash never
    #    leaves a checkpoint that a later open would trust and that still shows the message
    cp = directory / CHECKPOINT_NAME
    had_cp = cp.exists()
    checkpoint_seq = store._checkpoints.seq if had_cp else None
    store._checkpoints.store.discard_sync()
    receipt["checkpoints"] = ([{"where": str(cp), "seq": checkpoint_seq, "action": "deleted"}] if had_cp else [])
    # 3. side files and the compaction exports this store wrote
    receipt["side_files"] = []
    for p in side_paths(directory):
        n = _scrub_side_file(p, needle, digest)
        if n:
            receipt["side_files"].append({"where": str(p), "copies": n, "action": "rewritten"})
    receipt["exports"] = []
    for p in export_paths(directory):
        n = _scrub_export(p, needle)
        if n:
            receipt["exports"].append({"where": str(p), "lines": n, "action": "rewritten"})
    # 4. expired segments in the trash (segment retention): rewritten with the tombstones, like the log
    receipt["trash"] = []
    for p, trash_edits in trash_changes:
        if _rewrite_trash_file(p, trash_edits):
            receipt["trash"].append({"where": str(p), "entry": p.parent.name, "action": "rewritten",
                                     "records": [{"seq": rec["seq"], "type": rec["type"], "indices": hits}
                                                 for _, _, _, rec, hits in trash_edits]})
    fsync_dir(directory)  # the rewritten copies are durable before the log, the commit point, changes
    _step("erase-copies-written")
    if segmented:
        receipt["log"] = (_erase_in_segments(log, changes) if changes else  # (only the trash held a copy)
                          {"where": str(directory), "rewritten": [], "bytes_before": log.position,
                           "bytes_after": log.position})
        return receipt
    # 5. the log: a new file with the tombstones in place, then one atomic rename (the commit point)
    tmp = directory / (LOG_NAME + TMP_SUFFIX)
    fd = create_private_file(directory, tmp.name)
    try:
        with open(path, "rb") as src:
            pos = 0
            for start, end, line, *_ in changes:
                _copy_range(src, fd, pos, start)
                write_all(fd, line)
                pos = end
            _copy_range(src, fd, pos, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    new_size = os.stat(tmp).st_size
    log.swap_in(tmp, new_size)
    receipt["log"] = {"where": str(path), "bytes_before": size, "bytes_after": new_size}
    return receipt


def _erase_in_segments(log: Any, changes: list[tuple[int, int, bytes, dict[str, Any], list[int], str]]
                       ) -> dict[str, Any]:
    """Put the tombstones of ``changes`` (global positions) into a segmented log: each sealed segment that
    holds one is rewritten (re-compressed if it was compressed) and the active segment copied, all as temp
    files, then committed together by one manifest write (segment_store.replace_segments). A tombstone's
    length may differ from its record's: the positions after it move, as in a single-file log."""
    from ..storage.segment_store import read_segment

    manifest = log.manifest
    directory: Path = log.directory
    base = manifest.base
    sealed: dict[int, bytearray] = {}
    edits: dict[int, list[tuple[int, int, bytes]]] = {}
    active = [c for c in changes if c[0] >= base]
    for start, end, line, *_ in changes:
        if start >= base:
            continue
        i = manifest.index_at(start)
        seg = manifest.segments[i]
        if i not in sealed:
            sealed[i] = bytearray(read_segment(directory, seg))  # (checked against its SHA-256)
        sealed.setdefault(-1 - i, bytearray())  # (marks the order of edits: applied from the end, below)
        edits.setdefault(i, []).append((start - seg.start, end - seg.start, line))
    for i, items in edits.items():  # a tombstone may be longer or shorter than its record: from the end
        for a, b, line in sorted(items, reverse=True):
            sealed[i][a:b] = line
    sealed = {i: d for i, d in sealed.items() if i >= 0}
    before = log.position
    tmp_name = None
    if active:
        tmp_name = LOG_NAME + TMP_SUFFIX
        fd = create_private_file(directory, tmp_name)
        try:
            with open(log.path, "rb") as src:
                pos = 0
                for start, end, line, *_ in active:
                    _copy_range(src, fd, pos, start - base)
                    write_all(fd, line)
                    pos = end - base
                _copy_range(src, fd, pos, log.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    names = [manifest.segments[i].file for i in sorted(sealed)] + ([LOG_NAME] if active else [])
    log.replace_segments({i: bytes(d) for i, d in sealed.items()}, tmp_name)
    return {"where": str(directory), "rewritten": names, "bytes_before": before, "bytes_after": log.position}


def _copy_range(src: Any, fd: int, start: int, end: int) -> None:
    src.seek(start)
    left = end - start
    while left > 0:
        chunk = src.read(min(left, 1 << 20))
        if not chunk:
            raise OSError(f"the log ended {left} bytes early while erasing")
        write_all(fd, chunk)
        left -= len(chunk)


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


def _trash_changes(path: Path, needle: bytes, reason: str, when: str
                   ) -> list[tuple[int, int, bytes, dict[str, Any], list[int]]]:
    """``(start, end, tombstone, record, indices)`` of each record of a trashed segment holding ``needle``."""
    out = []
    for rec, start, end, _ in _scan_trash_file(path):
        hits = _copies(rec, needle)
        if hits:
            out.append((start, end, tombstone(rec, erased_data(rec, hits, reason, when)), rec, hits))
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


#: Temp files a killed writer, repair or checkpoint leaves behind: copies of the log or of the history, removed
#: before an erase (the caller holds the writer lock, so none of those is running).
STALE_TEMPS = (LOG_NAME + ".repair-tmp", CHECKPOINT_NAME + ".tmp")


def clean_leftovers(directory: Path, trash: bool = False) -> list[str]:
    """Remove temp files left behind by a killed erase (``*.erasing``: they never hold the erased message), a
    killed repair or checkpoint write (they may hold a copy of it). Returns the names removed. ``trash``: a
    trash entry's folder (only ``*.erasing`` files)."""
    gone = []
    try:
        items = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for p in items:
        if p.name.endswith(TMP_SUFFIX) or (p.name in STALE_TEMPS and not trash):
            p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def _receipt(store: Any, message: dict[str, Any], needle: bytes, seq: int, index: int, reason: str,
             when: str) -> dict[str, Any]:
    return {
        "receipt": RECEIPT_VERSION,
        "session_id": store.session_id,
        "backend": store.config.get("backend", "file"),
        "erased_at": when,
        "reason": reason,
        "message": {"seq": seq, "index": index, "key": make_key(seq, index), "role": message.get("role"),
                    "sha256": sha256(needle), "bytes": len(needle),
                    "escaped": {"sha256": sha256(escaped(needle)), "bytes": len(escaped(needle))}},
        "snapshots": ("not chased: the store keeps no list of the snapshots exported with export() or the CLI; "
                      "any made before this erasure still hold the message"),
    }


# -- PostgreSQL -----------------------------------------------------------------------------------------
async def erase_postgres(store: Any, seq: int, index: int, reason: str) -> dict[str, Any]:
    """Erase from a PostgreSQL session: every row holding a copy is updated and the checkpoint row deleted, in
    one transaction. Returns the receipt. The rows are read a batch at a time (the record at ``seq``, then one
    pass looking for copies): only the tombstones are held, never the history."""
    log = store._log
    message = None
    async for batch in log.read_batches(max(0, seq - 1)):
        message = find_target(batch, seq, index)  # (the first batch starts at seq: ValueError if it is not there)
        break
    if message is None:
        raise ValueError(f"seq {seq} is not in this session's log")
    needle = codec.dumps(message)
    when = codec.now_iso()
    updates: dict[int, bytes] = {}
    listed = []
    async for batch in log.read_batches(0):
        for rec in batch:
            hits = _copies(rec, needle)
            if hits:
                updates[rec["seq"]] = tombstone(rec, erased_data(rec, hits, reason, when))
                listed.append({"seq": rec["seq"], "type": rec["type"], "indices": hits, "row": rec["seq"]})
    had_cp = await log.replace_records(updates)
    receipt = _receipt(store, message, needle, seq, index, reason, when)
    receipt["records"] = listed
    receipt["checkpoints"] = ([{"where": f"{log.schema}.checkpoints", "action": "deleted"}] if had_cp else [])
    receipt["side_files"] = []
    receipt["exports"] = []
    receipt["trash"] = []  # (segment expiry is a file-backend feature: nothing of a session is trashed in part)
    receipt["log"] = {"where": str(log.path)}
    return receipt


# -- checking a receipt ---------------------------------------------------------------------------------
def _find_in(data: Any, digest: str, length: int) -> list[int]:
    """Offsets where ``length`` bytes hashing to ``digest`` start (candidates: every ``{``)."""
    want = digest.split(":", 1)[1]
    found = []
    pos = data.find(b"{")
    n = len(data)
    while 0 <= pos <= n - length:
        if data[pos + length - 1:pos + length] == b"}" and hashlib.sha256(data[pos:pos + length]).hexdigest() == want:
            found.append(pos)
        pos = data.find(b"{", pos + 1)
    return found


def check_receipt_records(records: list[dict[str, Any]], receipt: dict[str, Any]) -> list[str]:
    """Problems with the tombstones a receipt lists (each listed seq must be an ``erased`` record naming the
    message's digest)."""
    problems = []
    by_seq = {r["seq"]: r for r in records}
    digest = receipt["message"]["sha256"]
    for item in receipt.get("records", []):
        rec = by_seq.get(item["seq"])
        if rec is None:
            problems.append(f"seq {item['seq']} is not in the log")
        elif rec["type"] != ev.ERASED or not any(e.get("sha256") == digest for e in rec["data"].get("erased", [])):
            problems.append(f"seq {item['seq']} is a {rec['type']} record, not the tombstone of the erased message")
    return problems


def _forms(receipt: dict[str, Any]) -> list[tuple[str, int, str]]:
    """``(sha256, length, how)`` of each form of the erased bytes a receipt names."""
    msg = receipt["message"]
    out = [(msg["sha256"], msg["bytes"], "the erased bytes")]
    esc = msg.get("escaped")
    if isinstance(esc, dict) and isinstance(esc.get("sha256"), str) and isinstance(esc.get("bytes"), int):
        if esc["bytes"] != msg["bytes"]:  # (else the same bytes)
            out.append((esc["sha256"], esc["bytes"], "the erased bytes (escaped in a JSON string)"))
    return out


def check_receipt(directory: Path, receipt: dict[str, Any]) -> list[str]:
    """Problems found checking an erasure receipt against a file session folder: every file in it is searched
    for the erased bytes (by their SHA-256 and length, as is and escaped in a JSON string), and the log must
    hold the listed tombstones."""
    check_receipt_shape(receipt)
    problems = []
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.stat().st_size == 0:
            continue
        with open(p, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for digest, length, how in _forms(receipt):
                    for at in _find_in(data, digest, length):
                        problems.append(f"{p.name} holds {how} at offset {at}")
    for p in sorted(directory.iterdir()):  # compressed sealed segments: searched decompressed
        if p.is_file() and p.name.endswith(".jsonl.zst"):
            from ..storage.segments import decompress_all

            plain = decompress_all(p.read_bytes())
            for digest, length, how in _forms(receipt):
                for at in _find_in(plain, digest, length):
                    problems.append(f"{p.name} holds {how} at offset {at} of its decompressed contents")
    for p in trash_files(directory.parent, receipt.get("session_id") or directory.name):
        plain = _read_trash_file(p)
        for digest, length, how in _forms(receipt):
            for at in _find_in(plain, digest, length):
                problems.append(f"trash entry {p.parent.name}: {p.name} holds {how} at offset {at}"
                                + (" of its decompressed contents" if p.name.endswith(".zst") else ""))
        listed = {r["seq"] for t in receipt.get("trash", []) if t.get("where") == str(p) for r in t["records"]}
        if listed:
            from ..errors import LogCorruptedError

            try:
                recs = [r for r, *_ in _scan_trash_file(p) if r["seq"] in listed]
            except LogCorruptedError as e:
                problems.append(f"trash entry {p.parent.name}: {p.name} does not read as records ({e.reason})")
                continue
            problems.extend(f"trash entry {p.parent.name}: {x}" for x in check_receipt_records(
                recs, {"message": receipt["message"], "records": [{"seq": q} for q in sorted(listed)]}))
    log = directory / LOG_NAME
    from ..storage.segments import MANIFEST_NAME

    if (directory / MANIFEST_NAME).exists():
        from ..storage.segments import LogReader

        with LogReader(directory, receipt.get("session_id") or directory.name) as reader:
            records = [codec.decode(line) for _, line in reader.lines(0)]
        problems.extend(check_receipt_records(records, receipt))
    elif log.exists():
        records = [r for r, *_ in _scan_file(log, os.stat(log).st_size)]
        problems.extend(check_receipt_records(records, receipt))
    return problems


async def check_receipt_postgres(log: Any, receipt: dict[str, Any]) -> list[str]:
    """As :func:`check_receipt` for a PostgreSQL session: every row of its events and checkpoint."""
    check_receipt_shape(receipt)
    problems = []
    records = []
    async for batch in log.read_batches(0):
        records.extend(batch)
    for seq, raw in await log.raw_rows():
        for digest, length, how in _forms(receipt):
            for at in _find_in(raw, digest, length):
                where = "the checkpoint row" if seq == 0 else f"row seq {seq}"
                problems.append(f"{where} holds {how} at offset {at}")
    problems.extend(check_receipt_records(records, receipt))
    return problems


def check_receipt_shape(receipt: Any) -> None:
    """ValueError unless ``receipt`` looks like a receipt written by ``erase``."""
    msg = receipt.get("message") if isinstance(receipt, dict) else None
    if (not isinstance(receipt, dict) or receipt.get("receipt") != RECEIPT_VERSION or not isinstance(msg, dict)
            or not isinstance(msg.get("sha256"), str) or not msg["sha256"].startswith("sha256:")
            or not isinstance(msg.get("bytes"), int) or msg["bytes"] < 2):
        raise ValueError("not an erasure receipt (a JSON object with \"receipt\": 1 and \"message\": {\"sha256\", "
                         "\"bytes\"}, as erase writes)")


__all__ = ["check_receipt", "check_receipt_postgres", "erase_file", "erase_postgres", "split_key", "tombstone"]
