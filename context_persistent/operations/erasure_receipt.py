"""The erasure receipt (erasure.py): what ``erase`` hands out (``_receipt``), and the checks of a receipt
against a session's files or rows: the erased bytes (recognised by their keyed digest and length, as is and
escaped in a JSON string, in every encoding the store writes: copies.py) must be nowhere, and the log must hold
the listed tombstones.

A receipt of version 2 holds the erase's HMAC key (``hmac_key``) and the keyed digests: the tombstones keep
only the keyed digest, so without the receipt nobody can test a guess of the erased bytes against them; the
receipt itself can (that is what verifying it does): keep it as you keep the data it is about. Receipts of
version 1 (an unsalted SHA-256) are still checked."""

from __future__ import annotations

import base64
import hashlib
import hmac
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..model import codec
from ..model import events as ev
from ..model.projection import make_key
from ..storage.paths import LOG_NAME
from .copies import purging_entries, stale_session_temps, views
from .erasure_scrub import _read_trash_file, _scan_trash_file, escaped, trash_files
from .tombstones import _scan_file, keyed

RECEIPT_VERSION = 2
_VERSIONS = (1, 2)


def _receipt(store: Any, message: dict[str, Any], needle: bytes, seq: int, index: int, reason: str,
             when: str, key: bytes) -> dict[str, Any]:
    esc = escaped(needle)
    return {
        "receipt": RECEIPT_VERSION,
        "session_id": store.session_id,
        "backend": store.config.get("backend", "file"),
        "erased_at": when,
        "reason": reason,
        "message": {"seq": seq, "index": index, "key": make_key(seq, index), "role": message.get("role"),
                    "hmac_key": base64.b64encode(key).decode(), "hmac": keyed(key, needle), "bytes": len(needle),
                    "escaped": {"hmac": keyed(key, esc), "bytes": len(esc)}},
        "snapshots": ("not chased: the store keeps no list of the snapshots exported with export() or the CLI; "
                      "any made before this erasure still hold the message"),
    }


# -- checking a receipt ---------------------------------------------------------------------------------
def _find_in(data: Any, digest: Callable[[bytes], bool], length: int) -> list[int]:
    """Offsets where ``length`` bytes that ``digest`` recognises start (candidates: every ``{``)."""
    found = []
    pos = data.find(b"{")
    n = len(data)
    while 0 <= pos <= n - length:
        if data[pos + length - 1:pos + length] == b"}" and digest(data[pos:pos + length]):
            found.append(pos)
        pos = data.find(b"{", pos + 1)
    return found


def _matcher(msg: dict[str, Any], form: dict[str, Any]) -> Callable[[bytes], bool]:
    """Whether bytes are the erased bytes of ``form`` (a receipt's ``message`` or its ``escaped`` part)."""
    if "hmac" in form:
        key = base64.b64decode(msg["hmac_key"])
        want = form["hmac"]
        return lambda b: hmac.compare_digest(keyed(key, b), want)
    want = form["sha256"].split(":", 1)[1]
    return lambda b: hashlib.sha256(b).hexdigest() == want


def _tombstone_names(msg: dict[str, Any], entry: dict[str, Any]) -> bool:
    if "hmac" in msg:
        return bool(entry.get("hmac") == msg["hmac"])
    return bool(entry.get("sha256") == msg["sha256"])


def check_receipt_records(records: list[dict[str, Any]], receipt: dict[str, Any]) -> list[str]:
    """Problems with the tombstones a receipt lists (each listed seq must be an ``erased`` record naming the
    message's digest)."""
    problems = []
    by_seq = {r["seq"]: r for r in records}
    msg = receipt["message"]
    for item in receipt.get("records", []):
        rec = by_seq.get(item["seq"])
        if rec is None:
            problems.append(f"seq {item['seq']} is not in the log")
        elif rec["type"] != ev.ERASED or not any(_tombstone_names(msg, e) for e in rec["data"].get("erased", [])):
            problems.append(f"seq {item['seq']} is a {rec['type']} record, not the tombstone of the erased message")
    return problems


def _forms(receipt: dict[str, Any]) -> list[tuple[Callable[[bytes], bool], int, str]]:
    """``(recogniser, length, how)`` of each form of the erased bytes a receipt names."""
    msg = receipt["message"]
    out = [(_matcher(msg, msg), msg["bytes"], "the erased bytes")]
    esc = msg.get("escaped")
    if isinstance(esc, dict) and isinstance(esc.get("bytes"), int) and (
            isinstance(esc.get("sha256"), str) or isinstance(esc.get("hmac"), str)):
        if esc["bytes"] != msg["bytes"]:  # (else the same bytes)
            out.append((_matcher(msg, esc), esc["bytes"], "the erased bytes (escaped in a JSON string)"))
    return out


def _search(data: Any, receipt: dict[str, Any], zstd: bool = False) -> list[str]:
    """Where ``data`` holds the erased bytes, in any encoding the store writes (copies.views)."""
    out = []
    forms = _forms(receipt)
    for encoding, view in views(bytes(data) if zstd else data, zstd):
        for match, length, how in forms:
            for at in _find_in(view, match, length):
                out.append(f"{how} at offset {at}" + ("" if encoding == "raw" else f" ({encoding})"))
    return out


def check_receipt(directory: Path, receipt: dict[str, Any]) -> list[str]:
    """Problems found checking an erasure receipt against a file session folder: every file in it, the session's
    trash entries (half-purged ones too) and the stale fork and import temp folders of the storage are searched
    for the erased bytes (by their keyed digest and length, as is and escaped in a JSON string, decompressed,
    inside base64), and the log must hold the listed tombstones."""
    check_receipt_shape(receipt)
    problems: list[str] = []
    sid = receipt.get("session_id") or directory.name
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.stat().st_size == 0:
            continue
        with open(p, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                problems.extend(f"{p.name} holds {x}" for x in _search(data, receipt, p.name.endswith(".zst")))
    # leftovers outside the folder that may hold copies: half-purged trash entries, fork and import temps
    for folder in purging_entries(directory.parent, sid) + stale_session_temps(directory.parent):
        for p in sorted(folder.rglob("*")):
            if p.is_file() and not p.is_symlink():
                problems.extend(f"{folder.name}/{p.relative_to(folder)} holds {x}"
                                for x in _search(p.read_bytes(), receipt, p.name.endswith(".zst")))
    for p in trash_files(directory.parent, sid):
        problems.extend(f"trash entry {p.parent.name}: {p.name} holds {x}"
                        for x in _search(p.read_bytes(), receipt, p.name.endswith(".zst")))
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
    problems: list[str] = []
    records = []
    async for batch in log.read_batches(0):
        records.extend(batch)
    for seq, raw in await log.raw_rows():
        where = "the checkpoint row" if seq == 0 else f"row seq {seq}"
        problems.extend(f"{where} holds {x}" for x in _search(raw, receipt))
    problems.extend(check_receipt_records(records, receipt))
    return problems


def check_receipt_shape(receipt: Any) -> None:
    """ValueError unless ``receipt`` looks like a receipt written by ``erase``."""
    msg: Any = receipt.get("message") if isinstance(receipt, dict) else None
    ok = isinstance(receipt, dict) and receipt.get("receipt") in _VERSIONS and isinstance(msg, dict) and (
        isinstance(msg.get("bytes"), int) and msg["bytes"] >= 2)
    if ok and receipt["receipt"] == 1:
        ok = isinstance(msg.get("sha256"), str) and msg["sha256"].startswith("sha256:")
    elif ok:
        try:
            ok = (isinstance(msg.get("hmac"), str) and msg["hmac"].startswith("hmac-sha256:")
                  and len(base64.b64decode(msg.get("hmac_key"), validate=True)) == 32)
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError("not an erasure receipt (a JSON object with \"receipt\": 2 and \"message\": {\"hmac\", "
                         "\"hmac_key\", \"bytes\"}, as erase writes, or a version 1 receipt with \"sha256\")")
