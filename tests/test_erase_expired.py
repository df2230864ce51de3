"""Erasure after segment expiry: a message carried by an ``expired`` record, and one whose only copy is an
expired segment in the trash, are erased from the record and the trash files alike; the receipt lists where
they were and ``verify_erasure`` checks every one of those files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import LogCorruptedError, PersistentContextManager

from context_persistent.operations import trash
from context_persistent.operations.repair import verify
from context_persistent.model.retention import RetentionPolicy
from context_persistent.storage.segments import decompress_all, load_manifest

SID = "seg"


async def _session(storage: Path, compress: bool, n: int = 40) -> list[dict[str, Any]]:
    """A segmented session: a system prompt, ``n`` messages, the second one (index 2) pinned; then every
    sealed segment but the newest expired into the trash."""
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096,
                                                compress_sealed=compress)
    msgs = [{"role": "system", "content": "be brief, secret prompt " + "p" * 40}]
    msgs += [{"role": "user", "content": f"message {i} secret-{i:04d} " + "s" * 300} for i in range(n)]
    for m in msgs:
        await store.add_message(m)
    await store.pin(2)
    await store.close()
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert report["segments_expired"]
    return msgs


def _holders(storage: Path, needle: bytes) -> list[str]:
    """Every file under the storage root holding ``needle`` (compressed segments searched decompressed)."""
    out = []
    for p in sorted(storage.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name.endswith(".zst"):
            data = decompress_all(data)
        if needle in data or orjson.dumps(needle.decode())[1:-1] in data:
            out.append(str(p.relative_to(storage)))
    return out


async def _reopened(storage: Path) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, readonly=True)
    try:
        return await store.get_messages()
    finally:
        await store.close()


@pytest.mark.parametrize("compress", [False, True])
async def test_a_carried_message_is_erased_from_the_expired_record_and_the_trash(storage: Path,
                                                                                 compress: bool) -> None:
    msgs = await _session(storage, compress)
    pinned = orjson.dumps(msgs[2])
    assert any(".retention/trash" in h for h in _holders(storage, pinned))  # the original, expired
    assert any(h.startswith(SID + "/") for h in _holders(storage, pinned))  # the copy the expired record carries
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    before = await store.get_messages()
    assert before[:2] == [msgs[0], msgs[2]]
    boundary = load_manifest(storage / SID, SID).boundary  # type: ignore[union-attr]
    assert boundary is not None
    receipt = await store.erase(1, reason="gdpr")
    want = [before[0], *before[2:]]
    assert await store.get_messages() == want
    assert [(r["seq"], r["type"]) for r in receipt["records"]] == [(boundary.expired_seq, "expired")]
    [moved] = receipt["trash"]
    assert moved["entry"] == f"{SID}~1" and [r["seq"] for r in moved["records"]] == [4]  # message_added
    assert _holders(storage, pinned) == []
    assert await store.verify_erasure(receipt) == []
    # the system prompt, carried too: its slot becomes a system placeholder, so the fold stays the same
    prompt = orjson.dumps(msgs[0])
    receipt2 = await store.erase(0)
    assert await store.get_messages() == want[1:] and _holders(storage, prompt) == []
    assert await store.verify_erasure(receipt2) == [] and await store.verify_erasure(receipt) == []
    with pytest.raises(ValueError, match="already erased"):
        await store.erase(seq=4)
    await store.close()
    assert verify(storage / SID, SID).ok
    assert await _reopened(storage) == want[1:]  # seeded from the tombstone of the expired record
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    await store.add_message({"role": "user", "content": "after"})
    await store.close()  # (writes a checkpoint: the next open starts from it)
    assert await _reopened(storage) == [*want[1:], {"role": "user", "content": "after"}]


async def test_a_message_only_in_the_trash_is_erased_there(storage: Path) -> None:
    """Expired and not carried: no view shows it, only its trash entry holds it; erase rewrites that file."""
    msgs = await _session(storage, False)
    target = msgs[3]  # index 3 (seq 5): expired, not pinned
    needle = orjson.dumps(target)
    assert [h.split("/")[1] for h in _holders(storage, needle)] == ["trash"]
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    before = await store.get_messages()
    assert target not in before
    manifest = (storage / SID / "segments.json").read_bytes()
    receipt = await store.erase(seq=5, reason="gdpr")
    assert receipt["records"] == [] and receipt["message"]["hmac"].startswith("hmac-sha256:")
    assert receipt["log"]["rewritten"] == [] and (storage / SID / "segments.json").read_bytes() == manifest
    assert [(t["entry"], [r["seq"] for r in t["records"]]) for t in receipt["trash"]] == [(f"{SID}~1", [5])]
    assert _holders(storage, needle) == [] and await store.get_messages() == before
    assert await store.verify_erasure(receipt) == []
    with pytest.raises(ValueError, match="already erased"):
        await store.erase(seq=5)
    await store.close()
    # the trash entry still lists and purges; a purged message cannot be erased: nothing holds it
    [listed] = await trash.list_trash(storage)
    assert listed["present"]
    await trash.purge(storage, [f"{SID}~1"], force=True)
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    with pytest.raises(ValueError, match="nor any trash entry holds it .purged.: no record holds its bytes"):
        await store.erase(seq=6)
    await store.close()


async def test_a_second_expiry_takes_the_tombstone_along(storage: Path) -> None:
    """An erased copy is not carried again; the tombstone of the first expired record goes to the trash with
    its segment, and the session opens and verifies."""
    msgs = await _session(storage, False)
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID, segment_bytes=4096)
    await store.erase(1)
    more = [{"role": "user", "content": f"later {i} " + "t" * 300} for i in range(40)]
    for m in more:
        await store.add_message(m)
    want = await store.get_messages()
    await store.close()
    report = await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    assert [r["entry"] for r in report["segments_expired"]] == [f"{SID}~2"]
    got = await _reopened(storage)
    assert got[0] == msgs[0] and msgs[2] not in got and got[-1] == more[-1]
    assert got == [m for m in want if m in got] and verify(storage / SID, SID).ok
    assert _holders(storage, orjson.dumps(msgs[2])) == []


def test_cli_erase_and_verify_name_the_trash(storage: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from context_persistent.cli import main

    msgs = asyncio.run(_session(storage, True))
    st = ["--storage", str(storage)]
    receipt = tmp_path / "r.json"
    assert main([*st, "erase", SID, "--seq", "5", "--receipt", str(receipt)]) == 0
    out = capsys.readouterr().out
    assert f"trash entry {SID}~1, expired segment " in out and "seq 5 (message_added) replaced by a tombstone" in out
    assert _holders(storage, orjson.dumps(msgs[3])) == []
    assert main([*st, "verify", SID, "--receipt", str(receipt)]) == 0
    assert "its expired segments in the trash 1" in capsys.readouterr().out
    # the bytes put back into the trash entry are found there
    [entry] = (storage / ".retention" / "trash").iterdir()
    (entry / "notes.txt").write_bytes(b"x")  # (not a segment: not searched)
    seg = sorted(entry.glob("segment-*.zst"))[0]
    from context_persistent.storage.segments import compress

    os.chmod(seg, 0o600)
    seg.write_bytes(compress(decompress_all(seg.read_bytes()) + orjson.dumps(msgs[3]) + b"\n")[0])
    assert main([*st, "verify", SID, "--receipt", str(receipt)]) == 1
    assert f"trash entry {SID}~1: {seg.name} holds the erased bytes" in capsys.readouterr().out


async def test_a_damaged_trash_file_refuses_the_erase_and_changes_nothing(storage: Path) -> None:
    msgs = await _session(storage, False)
    [entry] = (storage / ".retention" / "trash").iterdir()
    seg = sorted(entry.glob("segment-*.jsonl"))[-1]
    os.chmod(seg, 0o600)
    seg.write_bytes(seg.read_bytes()[:-20] + b"garbage\n")  # its last record cut short
    before = {p: p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file() and p.name != "lock"}
    store = await PersistentContextManager.open(storage_path=storage, session_id=SID)
    with pytest.raises(LogCorruptedError, match=f"nothing was erased .*trash purge {entry.name} --force"):
        await store.erase(1)  # carried; its original is in the trash entry
    assert await store.get_messages() == [msgs[0], msgs[2], *(await store.get_messages())[2:]]
    await store.close()
    after = {p: p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file() and p.name != "lock"}
    # (checkpoints and the search index are caches: the index is emptied of the session and built again)
    assert {p: b for p, b in after.items() if "checkpoint" not in p.name and ".search" not in p.parts} == {
        p: b for p, b in before.items() if "checkpoint" not in p.name and ".search" not in p.parts}
