"""The erasure tombstone and where a message sits (erasure.py): the ``erased`` record that replaces a record
at the same seq with the same CRC (``tombstone``, its data from ``erased_data``), a record's message slots,
the record holding a message (``find_target``) and the log's records read with their positions."""

from __future__ import annotations

import hashlib
import hmac
import zlib
from pathlib import Path
from typing import Any

import orjson

from ..model import codec
from ..model import events as ev
from ..model.projection import make_key

PAD_CHARS = 48


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def keyed(key: bytes, data: bytes) -> str:
    """The digest a tombstone keeps of an erased message: HMAC-SHA256 under the erase's own random key, which
    only the receipt holds (docs/format.md, "Erasure tombstones": an unsalted hash of a short secret could be
    reversed by guessing; without the key the tombstone confirms no guess)."""
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


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


def erased_data(rec: dict[str, Any], indices: list[int], reason: str, when: str, key: bytes) -> dict[str, Any]:
    """The tombstone data for erasing the messages at ``indices`` of ``rec`` (a message record or a tombstone
    of a ``messages_replaced`` record, erased again); ``key``: the erase's HMAC key (:func:`keyed`)."""
    kind, data, seq = rec["type"], rec["data"], rec["seq"]
    expired = ev.expired_of(rec)
    if expired is not None:
        return _erased_expired(rec, expired, indices, reason, when, key)
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
        out["erased"].append({"index": i, "key": make_key(seq, i), "role": m.get("role"), "hmac": keyed(key, blob)})
        if kind != ev.MESSAGE_ADDED and "messages" in out:
            out["messages"][i] = None
    if kind == ev.ERASED:
        out["reason"] = reason
        out["erased_at"] = when
    return out


def _erased_expired(rec: dict[str, Any], expired: dict[str, Any], indices: list[int], reason: str,
                    when: str, key: bytes) -> dict[str, Any]:
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
        out["erased"].append({"index": i, "key": carried[i]["key"], "role": m.get("role"), "hmac": keyed(key, blob)})
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


# -- the log's records, with their positions ------------------------------------------------------
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
