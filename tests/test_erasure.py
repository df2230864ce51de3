"""Erasure: a message's bytes leave the log, the checkpoint, side files and compaction exports; a tombstone
keeps seqs and the chain; the receipt is checked by verify (API and CLI, both backends)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager, ReadOnlyError

from context_persistent.model import codec
from context_persistent.cli import main
from context_persistent.operations.erasure import check_receipt, tombstone
from context_persistent.operations.tombstones import _forge_pad
from context_persistent.operations.repair import verify

SECRET = {"role": "user", "content": "my passport number is X1234567, please remember it"}
NEEDLE = orjson.dumps(SECRET)


async def _open(storage: Path, session: str = "s", **cfg: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=session, **cfg)


def _everything(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _holders(folder: Path, needle: bytes = NEEDLE) -> list[str]:
    return sorted(name for name, data in _everything(folder).items() if needle in data)


async def _session(storage: Path, **cfg: Any) -> PersistentContextManager:
    store = await _open(storage, **cfg)
    await store.add_message({"role": "system", "content": "sys"})
    await store.add_message({"role": "user", "content": "hello"})
    await store.add_message(SECRET)  # seq 4
    await store.add_message({"role": "assistant", "content": "noted"})
    return store


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_erase_on_an_open_writer_removes_the_bytes_and_keeps_the_chain(storage: Path, fsync: str) -> None:
    store = await _session(storage, fsync=fsync)
    before = await store.get_messages()
    receipt = await store.erase(2, reason="user request")
    import base64
    import hashlib
    import hmac

    from context_persistent.operations.erasure import escaped

    key = base64.b64decode(receipt["message"]["hmac_key"])
    assert len(key) == 32
    assert receipt["message"] == {"seq": 4, "index": 0, "key": 4 << 20, "role": "user",
                                  "hmac_key": receipt["message"]["hmac_key"],
                                  "hmac": "hmac-sha256:" + hmac.new(key, NEEDLE, hashlib.sha256).hexdigest(),
                                  "bytes": len(NEEDLE),
                                  "escaped": {"hmac": "hmac-sha256:" + hmac.new(key, escaped(NEEDLE),
                                                                                hashlib.sha256).hexdigest(),
                                              "bytes": len(escaped(NEEDLE))}}
    assert [r["seq"] for r in receipt["records"]] == [4]
    # views behave as if the message were redacted
    assert await store.get_messages() == [m for m in before if m != SECRET]
    assert SECRET not in await store.get_conversation_view()
    await asyncio.gather(*(store.add_message({"role": "user", "content": "after"}) for _ in range(1)))
    assert _holders(storage / "s") == []  # (the chain continues after an erase: verified below)
    assert await store.verify_erasure(receipt) == []
    await store.close()
    report = verify(storage / "s", "s")
    assert report.ok, report.problems
    again = await _open(storage)
    assert await again.get_messages() == [m for m in before if m != SECRET] + [{"role": "user", "content": "after"}]
    assert again.stats()["events"]["erased"] == 1
    await again.close()
    # the tombstone: same seq, ts, prev and crc as the record it replaced
    lines = (storage / "s" / "events.jsonl").read_bytes().splitlines()
    tomb = codec.decode(lines[3])
    assert tomb["type"] == "erased" and tomb["seq"] == 4 and tomb["data"]["reason"] == "user request"
    assert codec.decode(lines[4])["prev"] == tomb["crc"]
    assert check_receipt(storage / "s", receipt) == []


async def test_erase_reaches_checkpoints_side_files_and_compaction_exports(storage: Path) -> None:
    store = await _session(storage, checkpoint_every=2)
    folder = storage / "s"
    await store.close()  # writes a checkpoint holding the message
    # a torn tail holding a copy (a write that a crash cut short, saved to a side file by the next open)
    with open(folder / "events.jsonl", "ab") as f:
        f.write(b'{"v":2,"seq":6,"prev":"00000000","ts":"x","type":"message_added","data":{"message":' + NEEDLE)
    store = await _open(storage, checkpoint_every=2)
    assert store.recovered is not None
    (folder / "events.jsonl.repair-tmp").write_bytes(NEEDLE)  # left by a repair that was killed
    export = folder / "compaction-0000000005.jsonl"  # what export_on_compact writes
    await store.export(export, view="reasoning")
    holders = _holders(folder)
    assert "checkpoint.json" in holders and "events.jsonl" in holders and export.name in holders
    assert any(h.startswith("events.jsonl.torn-") for h in holders)
    receipt = await store.erase(seq=4)
    assert _holders(folder) == []
    assert [c["action"] for c in receipt["checkpoints"]] == ["deleted"]
    assert len(receipt["side_files"]) == 1 and receipt["side_files"][0]["copies"] == 1
    assert receipt["exports"] == [{"where": str(export), "lines": 1, "action": "rewritten"}]
    assert receipt["removed_temp_files"] == ["events.jsonl.repair-tmp"]
    # the rewritten export is still a valid snapshot: it imports, without the message
    from context_persistent import import_
    await import_(export, session_id="copy", storage_path=storage)
    copy = await _open(storage, "copy")
    assert SECRET not in await copy.get_messages() and len(await copy.get_messages()) == 2
    await copy.close()
    await store.add_message({"role": "user", "content": "more"})
    await store.close()  # a new checkpoint, without the message
    assert (folder / "checkpoint.json").exists() and _holders(folder) == []
    again = await _open(storage)
    assert again.stats()["checkpoint"]["loaded_seq"] > 0
    assert SECRET not in await again.get_messages()
    await again.close()
    assert verify(folder, "s").ok


async def test_every_copy_is_erased_and_a_replaced_list_keeps_its_other_messages(storage: Path) -> None:
    store = await _session(storage)
    await store.replace_messages(await store.get_messages())  # seq 6 carries a copy forward
    await store.pin(1)
    receipt = await store.erase(2)  # the message as it is now: index 2 of the messages_replaced record
    assert receipt["message"]["seq"] == 6 and receipt["message"]["index"] == 2
    assert sorted(r["seq"] for r in receipt["records"]) == [4, 6]
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
               {"role": "assistant", "content": "noted"}]
    assert await store.get_messages() == history
    # a second erasure in the same replaced record rewrites its tombstone
    await store.erase(0)
    assert await store.get_messages() == history[1:]
    await store.close()
    again = await _open(storage)
    assert await again.get_messages() == history[1:]
    assert again.stats()["pinned"] == 1  # (the pin of seq 6 index 1 survives)
    await again.close()
    assert _holders(storage / "s") == [] and verify(storage / "s", "s").ok


async def test_a_message_no_longer_in_the_history_can_be_erased_by_seq(storage: Path) -> None:
    store = await _session(storage)
    await store.clear()
    await store.add_message({"role": "user", "content": "new"})
    receipt = await store.erase(seq=4)
    assert receipt["records"][0]["seq"] == 4
    assert _holders(storage / "s") == []
    past = await store.at(5)  # the history as of before the clear: the message is gone there too
    assert SECRET not in await past.get_messages()
    await past.close()
    await store.close()


async def test_bad_requests_change_nothing(storage: Path) -> None:
    store = await _session(storage)
    log = storage / "s" / "events.jsonl"
    before = log.read_bytes()
    for kwargs, match in [({}, "exactly one"), ({"message_index": 1, "seq": 4}, "exactly one"),
                          ({"seq": 1}, "session_started record"), ({"seq": 99}, "seq must be"),
                          ({"message_index": 9}, "out of range"), ({"seq": 4, "reason": 3}, "reason"),
                          ({"seq": 4, "index": -1}, "index")]:
        with pytest.raises(ValueError, match=match):
            await store.erase(**kwargs)
    assert log.read_bytes()[:len(before)] == before
    await store.erase(seq=4)
    with pytest.raises(ValueError, match="already erased"):
        await store.erase(seq=4)
    await store.close()
    ro = await _open(storage, readonly=True)
    with pytest.raises(ReadOnlyError):
        await ro.erase(seq=2)
    await ro.close()


def test_the_tombstone_pad_reaches_any_crc() -> None:
    rng = random.Random(7)
    for _ in range(200):
        head = bytes(rng.randrange(32, 127) for _ in range(rng.randrange(0, 300)))
        target = rng.getrandbits(32)
        pad = _forge_pad(head, b'"}', target)
        assert zlib.crc32(head + pad + b'"}' + b"}") == target and set(pad) <= set(b"ac")


def test_a_version_1_record_gets_a_version_1_tombstone() -> None:
    line = b'{"v":1,"seq":2,"ts":"2024-01-01T00:00:00+00:00","type":"message_added","data":{"message":%s}' % NEEDLE
    line += b',"crc":"%08x"}\n' % zlib.crc32(b"}", zlib.crc32(line))
    rec = codec.decode(line)
    from context_persistent.operations.erasure import erased_data

    tomb = tombstone(rec, erased_data(rec, [0], "", codec.now_iso(), b"k" * 32))
    assert tomb.startswith(b'{"v":1,"seq":2,"ts"') and codec.decode(tomb)["crc"] == rec["crc"]
    assert NEEDLE not in tomb


def test_cli_erase_writes_a_receipt_that_verify_checks(storage: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    async def make() -> None:
        store = await _session(storage)
        await store.close()

    asyncio.run(make())
    receipt_path = tmp_path / "r.json"
    st = ["--storage", str(storage)]
    assert main([*st, "erase", "s", "--seq", "4", "--receipt", str(receipt_path), "--reason", "gdpr"]) == 0
    out = capsys.readouterr().out
    assert "seq 4 (message_added" in out and "receipt written" in out
    assert oct(os.stat(receipt_path).st_mode & 0o777) == "0o600"
    receipt = json.loads(receipt_path.read_text())
    assert receipt["reason"] == "gdpr" and NEEDLE not in receipt_path.read_bytes()
    assert main([*st, "verify", "s", "--receipt", str(receipt_path)]) == 0
    assert "are nowhere in the session" in capsys.readouterr().out
    # a copy of the bytes put back is found
    with open(storage / "s" / "notes.txt", "wb") as f:
        f.write(b"x" + NEEDLE)
    assert main([*st, "verify", "s", "--receipt", str(receipt_path)]) == 1
    assert "notes.txt holds the erased bytes at offset 1" in capsys.readouterr().out
    (storage / "s" / "notes.txt").unlink()
    # usage errors: no such message, not a receipt
    assert main([*st, "erase", "s", "--seq", "4"]) == 2
    assert "already erased" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main([*st, "verify", "s", "--receipt", str(tmp_path / "bad.json")]) == 2
    assert main([*st, "erase", "nope", "--seq", "2"]) == 1


async def test_cli_erase_refuses_a_locked_session(storage: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    store = await _session(storage)
    try:
        code = await asyncio.to_thread(main, ["--storage", str(storage), "erase", "s", "--seq", "4"])
    finally:
        await store.close()
    assert code == 1
    assert "erase needs the session to itself" in capsys.readouterr().err
    assert NEEDLE in (storage / "s" / "events.jsonl").read_bytes()


@pytest.mark.postgres
async def test_erase_on_postgres_updates_the_rows(pg_config: dict[str, str], sid: str, storage: Path) -> None:
    store = await _open(storage, sid, **pg_config, checkpoint_every=2)
    await store.add_message({"role": "user", "content": "hello"})
    await store.add_message(SECRET)
    await store.add_message({"role": "assistant", "content": "noted"})
    await store.close()
    store = await _open(storage, sid, **pg_config, checkpoint_every=2)
    rows = await store._log.raw_rows()
    assert any(NEEDLE in raw for _, raw in rows) and any(seq == 0 for seq, _ in rows)  # (0: the checkpoint)
    receipt = await store.erase(1)
    assert receipt["backend"] == "postgres" and receipt["records"][0]["seq"] == 3
    assert receipt["checkpoints"] and await store.verify_erasure(receipt) == []
    assert not any(NEEDLE in raw for _, raw in await store._log.raw_rows())
    await store.add_message({"role": "user", "content": "after"})
    await store.close()
    again = await _open(storage, sid, **pg_config)
    assert [m["content"] for m in await again.get_messages()] == ["hello", "noted", "after"]
    await again.close()
    # the CLI: erase with --dsn, then verify the receipt against the rows
    receipt_path = storage.parent / "pg-receipt.json"
    dsn = ["--dsn", pg_config["dsn"], "--pg-schema", pg_config["pg_schema"]]
    code = await asyncio.to_thread(main, [*dsn, "erase", sid, "--seq", "2", "--receipt", str(receipt_path)])
    assert code == 0
    assert await asyncio.to_thread(main, [*dsn, "verify", sid, "--receipt", str(receipt_path)]) == 0
    again = await _open(storage, sid, **pg_config)
    assert [m["content"] for m in await again.get_messages()] == ["noted", "after"]
    await again.close()


async def test_a_quarantined_copy_is_found_and_removed(storage: Path) -> None:
    from context_persistent.operations.erasure import escaped
    from context_persistent.operations.repair import repair

    store = await _session(storage)
    await store.add_message(SECRET)  # seq 6: a second copy, damaged below and quarantined by repair
    await store.add_message({"role": "user", "content": "last"})
    await store.close()
    log = storage / "s" / "events.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"crc":"', b'"crc":"0', 1)[:-3] + b'"}\n'  # a checksum that no longer matches
    log.write_bytes(b"".join(lines))
    assert repair(storage / "s", "s").quarantine_file
    holders = _holders(storage / "s", escaped(NEEDLE))
    assert len(holders) == 1 and holders[0].startswith("events.jsonl.quarantine-")
    store = await _open(storage)
    receipt = await store.erase(seq=4)
    await store.close()
    assert receipt["side_files"][0]["copies"] == 1
    assert _holders(storage / "s") == [] and _holders(storage / "s", escaped(NEEDLE)) == []
    assert check_receipt(storage / "s", receipt) == []
    # the check finds an escaped copy too
    (storage / "s" / "events.jsonl.quarantine-x").write_bytes(b'{"raw":"' + escaped(NEEDLE) + b'"}\n')
    assert [p.split(" at ")[0] for p in check_receipt(storage / "s", receipt)] == [
        "events.jsonl.quarantine-x holds the erased bytes (escaped in a JSON string)"]


async def test_a_follower_continues_across_an_erase(storage: Path) -> None:
    store = await _session(storage)
    seen: list[int] = []

    async def follow() -> None:
        async for rec in store.follow(after_seq=0):
            seen.append(rec["seq"])
            if rec["seq"] == 7:
                return

    task = asyncio.ensure_future(follow())
    while len(seen) < 5:
        await asyncio.sleep(0.05)
    await store.erase(seq=4)
    await store.add_message({"role": "user", "content": "x"})
    await store.add_message({"role": "user", "content": "y"})
    await asyncio.wait_for(task, 10)
    assert seen == [1, 2, 3, 4, 5, 6, 7]  # (the tombstone keeps seq 4's crc: no LogChangedError)
    await store.close()


@pytest.mark.parametrize("seed", range(12))
async def test_random_histories_lose_exactly_the_erased_message(storage: Path, seed: int) -> None:
    """Whatever happened before (replacements carrying messages forward, clears, pins, redactions, duplicates),
    erasing a message removes exactly the messages with its bytes from the history, and the log stays valid."""
    rng = random.Random(seed)
    store = await _open(storage, checkpoint_every=rng.choice([3, 10_000]))
    pool = [{"role": rng.choice(["user", "assistant"]), "content": f"m{i} " + "x" * rng.randrange(50)}
            for i in range(6)]
    for _ in range(rng.randrange(5, 25)):
        op = rng.random()
        msgs = await store.get_messages()
        if op < 0.6 or not msgs:
            await store.add_message(rng.choice(pool))
        elif op < 0.75:
            await store.replace_messages(rng.sample(msgs, rng.randrange(len(msgs) + 1)) + [rng.choice(pool)])
        elif op < 0.8:
            await store.clear()
        elif op < 0.9:
            await store.pin(rng.randrange(len(msgs)))
        else:
            await store.redact(rng.randrange(len(msgs)))
    msgs = await store.get_messages()
    if not msgs:
        await store.add_message(pool[0])
        msgs = await store.get_messages()
    victim = msgs[rng.randrange(len(msgs))]
    receipt = await store.erase(msgs.index(victim))
    expected = [m for m in msgs if m != victim]
    assert await store.get_messages() == expected
    await store.close()
    # no checkpoint the close wrote (its front and message sections) holds the erased bytes
    assert [name for name in _holders(storage / "s", orjson.dumps(victim)) if name.startswith("checkpoint")] == []
    again = await _open(storage)
    assert await again.get_messages() == expected
    assert await again.verify_erasure(receipt) == []
    await again.close()
    assert verify(storage / "s", "s").ok
