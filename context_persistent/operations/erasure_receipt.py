"""The erasure receipt (erasure.py): what ``erase`` hands out (``_receipt``), and the checks of a receipt
against a session's files or rows: the erased bytes (by SHA-256 and length, as is and escaped in a JSON string)
must be nowhere, and the log must hold the listed tombstones."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

from ..model import codec
from ..model import events as ev
from ..model.projection import make_key
from ..storage.paths import LOG_NAME
from .erasure_scrub import _read_trash_file, _scan_trash_file, escaped, trash_files
from .tombstones import _scan_file, sha256

RECEIPT_VERSION = 1


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
