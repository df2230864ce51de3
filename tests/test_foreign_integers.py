"""Foreign files (CLI transcripts, the reference module's files, snapshots) are read exactly or refused:
an integer beyond 64 bits, which orjson would silently turn into a float, is refused naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from context_persistent import MalformedInputError, PersistentContextManager, import_
BIG = 123456789012345678901234567890


def _write_lines(path: Path, objs: list[object]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")  # Python's json, as a user would
    return path


def _messages(n_before: int, value: object) -> list[object]:
    msgs: list[object] = [{"role": "user", "content": f"m{i}"} for i in range(n_before)]
    msgs.append({"role": "assistant", "content": "n", "metadata": {"count": value}})
    return msgs


@pytest.mark.parametrize("name,source", [("transcript.jsonl", "transcript"), ("context-messages.jsonl", "reference"),
                                         ("transcript.jsonl", "auto")])
@pytest.mark.parametrize("value", [BIG, -BIG, (1 << 64), -(1 << 63) - 1])
async def test_an_integer_beyond_64_bits_in_a_message_file_is_refused_naming_the_line(
        storage: Path, tmp_path: Path, name: str, source: str, value: int) -> None:
    path = _write_lines(tmp_path / name, _messages(3, value))
    with pytest.raises(MalformedInputError, match=rf"{name}: line 4: holds the integer {value}, outside the 64-bit"):
        await import_(path, session_id="s", storage_path=storage, source=source)
    assert not storage.exists() or list(storage.iterdir()) == []


async def test_the_first_line_is_checked_by_detection_too(storage: Path, tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "export.jsonl", [{"role": "user", "content": "x", "n": BIG}])
    with pytest.raises(MalformedInputError, match="line 1: holds the integer"):
        await import_(path, session_id="s", storage_path=storage)


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
async def test_a_snapshot_edited_to_hold_a_big_integer_is_refused(storage: Path, tmp_path: Path, fmt: str) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="a") as store:
        await store.add_message({"role": "user", "content": "hi", "metadata": {"n": 7}})
        await store.add_message({"role": "assistant", "content": "yo"})
        snap = tmp_path / f"snap.{fmt}"
        await store.export(snap, format=fmt)
    text = snap.read_text()
    assert text.count('"n": 7') + text.count('"n":7') == 1
    snap.write_text(text.replace('"n": 7', f'"n": {BIG}').replace('"n":7', f'"n":{BIG}'))
    with pytest.raises(MalformedInputError, match=f"holds the integer {BIG}") as info:
        await import_(snap, session_id="b", storage_path=storage)
    line = next(i for i, ln in enumerate(snap.read_text().splitlines(), 1) if str(BIG) in ln)
    assert info.value.line == line
    assert not (storage / "b").exists()


async def test_the_64_bit_extremes_long_digit_strings_and_long_floats_are_kept_exactly(
        storage: Path, tmp_path: Path) -> None:
    values = [(1 << 64) - 1, -(1 << 63), "123456789012345678901234567890", 0.12345678901234567890123, 1e300]
    msgs = [{"role": "user", "content": "v", "metadata": {"v": v}} for v in values]
    path = _write_lines(tmp_path / "transcript.jsonl", msgs)
    await import_(path, session_id="s", storage_path=storage)
    async with await PersistentContextManager.open(storage_path=storage, session_id="s", readonly=True) as store:
        got = [m["metadata"]["v"] for m in await store.get_messages()]
    assert got == values
    assert [type(v) for v in got] == [type(v) for v in values]


async def test_an_integer_of_hundreds_of_digits_is_refused_with_a_short_quote(storage: Path, tmp_path: Path) -> None:
    path = tmp_path / "transcript.jsonl"
    path.write_text('{"role": "user", "content": "x"}\n{"role": "user", "content": "y", "n": ' + "9" * 300 + "}\n")
    with pytest.raises(MalformedInputError, match=r"line 2: holds the integer 9{20}…9{8} \(300 digits\)"):
        await import_(path, session_id="s", storage_path=storage)
