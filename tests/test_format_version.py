"""The format version in every record: newer versions are refused clearly, older ones upgraded on read."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, UnsupportedFormatError
from context_persistent.model import codec
from context_persistent.storage.paths import LOG_NAME
from context_persistent.operations.repair import repair, verify

S = "s"


async def _session(storage: Path, n: int = 3) -> Path:
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        for i in range(n):
            await store.add_message({"role": "user", "content": f"m{i}"})
    return storage / S / LOG_NAME


def _record(version: int, seq: int, type_: str, data: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(codec, "FORMAT_VERSION", version)
        return codec.encode_event(seq, type_, data)


@pytest.mark.parametrize("where", ["last", "middle"])
async def test_a_record_of_a_newer_major_version_is_refused_clearly(storage: Path, where: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid record written by a newer format makes open raise UnsupportedFormatError; it is never cut or skipped."""
    log = await _session(storage)
    newer = _record(3, 5, "message_added", {"message": {"role": "user", "content": "from the future"}}, monkeypatch)
    data = log.read_bytes()
    if where == "last":
        log.write_bytes(data + newer)
    else:
        lines = data.splitlines(keepends=True)
        log.write_bytes(b"".join(lines[:2]) + newer + b"".join(lines[2:]))
    before = log.read_bytes()
    with pytest.raises(UnsupportedFormatError, match="format version 3, newer than this program's 2"):
        await PersistentContextManager.open(storage_path=storage, session_id=S)
    with pytest.raises(UnsupportedFormatError):
        verify(storage / S, S)
    with pytest.raises(UnsupportedFormatError):
        repair(storage / S, S)  # repair never quarantines records it cannot understand
    assert log.read_bytes() == before
    assert not [p for p in (storage / S).iterdir() if ".torn-" in p.name or ".quarantine-" in p.name]


def _v2_to_v3(rec: dict[str, Any]) -> dict[str, Any]:
    """An example upcaster: version 2 called the message text ``text``; version 3 calls it ``content``."""
    if rec["type"] == "message_added":
        message = dict(rec["data"]["message"])
        if "text" in message:
            message["content"] = message.pop("text")
        rec = {**rec, "data": {**rec["data"], "message": message}}
    return {**rec, "v": 3}


async def test_older_records_are_upgraded_on_read_and_the_file_is_not_rewritten(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With format 3 current, version-2 records pass through the registered upcaster as they are read; new
    records are written as version 3; the old bytes stay as they were."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        await store.add_message({"role": "user", "text": "written by v1"})
    log = storage / S / LOG_NAME
    v1_bytes = log.read_bytes()
    monkeypatch.setattr(codec, "FORMAT_VERSION", 3)
    monkeypatch.setitem(codec.UPCASTERS, 2, _v2_to_v3)
    async with await PersistentContextManager.open(storage_path=storage, session_id=S) as store:
        assert await store.get_messages() == [{"role": "user", "content": "written by v1"}]
        await store.add_message({"role": "user", "content": "written by v2"})
    data = log.read_bytes()
    assert data.startswith(v1_bytes)
    assert data[len(v1_bytes):].startswith(b'{"v":3,')
    assert verify(storage / S, S).ok


async def test_a_missing_or_broken_upcaster_is_a_clear_error(storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An old record with no upcaster registered, or an upcaster returning the wrong version, fails clearly."""
    await _session(storage)
    monkeypatch.setattr(codec, "FORMAT_VERSION", 3)
    with pytest.raises(UnsupportedFormatError, match="no upcaster from version 2 to 3"):
        await PersistentContextManager.open(storage_path=storage, session_id=S)
    monkeypatch.setitem(codec.UPCASTERS, 2, lambda rec: rec)
    with pytest.raises(UnsupportedFormatError, match="did not return a version 3 record"):
        await PersistentContextManager.open(storage_path=storage, session_id=S, readonly=True)


async def test_a_checkpoint_written_under_another_format_is_ignored(storage: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """After a format change the old checkpoint is not trusted: the log is replayed through the upcasters."""
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, checkpoint_every=1) as store:
        for i in range(3):
            await store.add_message({"role": "user", "text": f"t{i}"})
    monkeypatch.setattr(codec, "FORMAT_VERSION", 3)
    monkeypatch.setitem(codec.UPCASTERS, 2, _v2_to_v3)
    async with await PersistentContextManager.open(storage_path=storage, session_id=S, readonly=True) as store:
        assert "log format 2" in store.stats()["checkpoint"]["ignored"]
        assert await store.get_messages() == [{"role": "user", "content": f"t{i}"} for i in range(3)]


@pytest.mark.parametrize("version", [0, -1, "1", None])
def test_a_record_without_a_valid_version_is_rejected(version: Any) -> None:
    """A checksummed record whose 'v' is missing, zero, negative or not an int is not a record."""
    body = codec.encode_event(1, "cleared", {}).replace(b'{"v":2,', b'{"v":%s,' % codec.dumps(version))
    head = body[: body.rindex(b',"crc"')]
    line = b'%s,"crc":"%08x"}\n' % (head, zlib.crc32(b"}", zlib.crc32(head)))
    with pytest.raises(codec.RecordError, match="no valid format version"):
        codec.decode(line)
