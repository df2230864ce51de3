"""Erase reaches every copy (#28, 1-5): the registry of places (operations/copies.py) knows every file the store
writes, and a property test runs random operations in real processes, kills them in the middle of each
file-writing step, erases, then searches every byte under the storage root in every encoding the store writes
(raw, JSON-escaped, base64, zstd) for the erased secret."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import PYTHON
from context_persistent import PersistentContextManager
from context_persistent.model import codec
from context_persistent.operations import copies
from context_persistent.operations.tombstones import _forge_pad

CHILD = Path(__file__).with_name("copies_child.py")
TOKEN = b"PIN7391SECRETa8f2"  # (alphanumeric: the same bytes raw and escaped inside a JSON string)
SECRET = {"role": "user", "content": "my pin is " + TOKEN.decode()}


# -- searching every byte ---------------------------------------------------------------------------
def _base64_cores(token: bytes) -> list[bytes]:
    """The part of the base64 of ``token`` that any base64 text holding it contains, at each of the three
    alignments (the first and last characters depend on the neighbouring bytes: left out)."""
    out = []
    for shift in range(3):
        enc = base64.b64encode(b"\0" * shift + token + b"\0\0\0")
        first = (shift * 4 + 2) // 3 + 1
        last = ((shift + len(token)) * 4) // 3 - 1
        out.append(enc[first:last])
    return out


def _holds(data: bytes, token: bytes, depth: int = 0) -> list[str]:
    """Encodings in which ``data`` holds ``token``: raw (also JSON-escaped, the token needing no escape),
    base64 at any alignment, inside any zstd frame."""
    found = []
    if token in data:
        found.append("raw")
    if any(core in data for core in _base64_cores(token)):
        found.append("base64")
    if depth < 2:
        at = data.find(copies.ZSTD_MAGIC)
        while at >= 0:
            try:
                plain = zstandard.ZstdDecompressor().decompressobj().decompress(data[at:])
            except zstandard.ZstdError:
                plain = b""
            found += [f"zstd+{x}" for x in _holds(plain, token, depth + 1)]
            at = data.find(copies.ZSTD_MAGIC, at + 1)
    return found


def _copies_under(root: Path, others: set[str]) -> list[str]:
    """Every file under ``root`` (sessions in ``others``, made from this one by a completed fork, left out)
    that holds the token, with how."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in others or not p.is_file() or p.is_symlink():
            continue
        how = _holds(p.read_bytes(), TOKEN)
        if how:
            out.append(f"{rel}: {how}")
    return out


def test_the_search_finds_the_token_in_every_encoding() -> None:
    """The test's own search finds the token raw, escaped, base64 at every alignment and inside zstd."""
    for pre in (b"", b"x", b"xy", b"xyz"):
        assert "base64" in _holds(b'{"raw_b64":"' + base64.b64encode(pre + TOKEN + b"\xff") + b'"}', TOKEN)
    assert _holds(orjson.dumps(orjson.dumps(SECRET).decode()), TOKEN) == ["raw"]
    assert "zstd+raw" in _holds(b"junk" + zstandard.ZstdCompressor().compress(b"a" * 999 + TOKEN), TOKEN)
    assert _holds(b"nothing here", TOKEN) == []


# -- the registry -----------------------------------------------------------------------------------
async def test_every_file_the_store_writes_is_a_known_place(tmp_path: Path) -> None:
    """Every name in a session folder after rolls, compression, checkpoints, repair, exports and erasure, and
    the temp names exports, forks and imports use, is in the registry."""
    from context_persistent.transfer import atomic_files, new_session

    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s", segment_bytes=4096,
                                                compress_sealed=True, checkpoint_every=5)
    for i in range(40):
        await store.add_message({"role": "user", "content": f"m{i} " + "x" * 200})
    await store.export(tmp_path / "s" / "compaction-0000000001.jsonl", view="reasoning")
    await store.erase(seq=3)
    await store.close()
    names = {p.name for p in (tmp_path / "s").iterdir()}
    assert all(copies.place_of(n) is not None for n in names), [n for n in names if copies.place_of(n) is None]
    for name in ("events.jsonl.repair-tmp", "events.jsonl.repair-quarantine.tmp", "events.jsonl.quarantine-x",
                 "events.jsonl.torn-1-2-ab", "checkpoint.json.tmp", "checkpoint.base.tmp", "segments.json.tmp",
                 "segment-000002.jsonl.zst.tmp", "segment-active.jsonl.tmp", "events.jsonl.erasing"):
        assert copies.place_of(name) is not None, name
    export_tmp = f".compaction-0000000001.jsonl.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    assert copies.place_of(export_tmp) is not None  # (write_atomic's pattern: "."+name+".tmp-<pid>-<8 hex>")
    assert atomic_files._TMP_FILE_RE.pattern == copies.EXPORT_TMP.pattern
    assert new_session._TMP_RE.pattern == copies.SESSION_TMP.pattern and new_session.TMP_PREFIX == ".tmp-"
    assert copies.SESSION_TMP.fullmatch(f".tmp-fork-1-{os.getpid()}-{os.urandom(4).hex()}")


def test_the_receipt_names_what_erase_does_not_reach() -> None:
    """The PostgreSQL receipt lists dead row versions and the WAL; both backends list snapshots."""
    pg = {n["what"] for n in copies.not_covered("postgres")}
    assert {"dead row versions", "write-ahead log", "snapshots"} <= pg
    assert {n["what"] for n in copies.not_covered("file")} == {"snapshots"}


# -- the tombstone keeps nothing that confirms a guess -----------------------------------------------
async def test_a_tombstone_and_the_chain_confirm_no_guess_of_a_short_secret(tmp_path: Path) -> None:
    """The tombstone holds no unsalted hash or length of the erased message, and the original CRC (still named
    by the next record's prev) fits every guess of a 4-digit PIN equally: a salt exists for each."""
    store = await PersistentContextManager.open(storage_path=tmp_path, session_id="s")
    await store.add_message({"role": "user", "content": "pin 4711"})
    await store.add_message({"role": "user", "content": "next"})
    receipt = await store.erase(seq=2)
    await store.close()
    lines = (tmp_path / "s" / "events.jsonl").read_bytes().splitlines(keepends=True)
    tomb = codec.decode(lines[1])
    entry = tomb["data"]["erased"][0]
    assert set(entry) == {"index", "key", "role", "hmac"} and entry["hmac"].startswith("hmac-sha256:")
    import hashlib

    assert hashlib.sha256(orjson.dumps({"role": "user", "content": "pin 4711"})).hexdigest() not in lines[1].decode()
    assert "hmac_key" in receipt["message"]  # (the key is in the receipt only)
    crc = int(tomb["crc"], 16)
    for guess in ("0000", "4711", "9999"):  # each guess: a record with some salt has exactly this CRC
        head = (b'{"v":2,"seq":2,"prev":"%s","ts":"%s","type":"message_added","data":{"message":%s},"salt":"'
                % (tomb["prev"].encode(), tomb["ts"].encode(), orjson.dumps({"role": "user", "content": f"pin {guess}"})))
        pad = _forge_pad(head, b'"', crc)
        codec.decode(head + pad + b'","crc":"%08x"}\n' % crc)


# -- the property test --------------------------------------------------------------------------------
def _child(storage: Path, *args: str, crash_at: str | None = None, kill: bool = False, report: bool = False) -> str:
    """Run one operation in a child process: ``crash_at`` makes it SIGKILL itself at that step, ``kill`` SIGKILLs
    it when it says PAUSED. Returns its last line (or KILLED; ``report``: all its lines)."""
    env = dict(os.environ)
    env.pop("CONTEXT_PERSISTENT_CRASH_AT", None)
    if crash_at:
        env["CONTEXT_PERSISTENT_CRASH_AT"] = crash_at
    proc = subprocess.Popen([PYTHON, str(CHILD), str(storage), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    last = ""
    said = []
    for raw in proc.stdout:
        last = raw.decode().strip()
        said.append(last)
        if last == "PAUSED" and kill:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode == -signal.SIGKILL:
        return "KILLED"
    assert proc.returncode == 0, (args, last, err)
    return "\n".join(said) if report else last


async def _setup(storage: Path) -> int:
    """Session ``s``: the secret (returns its seq), a set_messages copy of it in a record then damaged with a
    byte that is not UTF-8 (repair keeps it as base64), records after it."""
    store = await PersistentContextManager.open(storage_path=storage, session_id="s", recognise_replay=False)
    await store.add_message({"role": "system", "content": "be brief"})
    await store.add_message(SECRET)
    seq = 3  # (after session_started and the system message)
    for i in range(3):
        await store.add_message({"role": "assistant", "content": f"reply {i}"})
    await store.set_messages(await store.get_messages(), reason="QZQZ")
    await store.add_message({"role": "user", "content": "after the copy"})
    await store.close()
    log = storage / "s" / "events.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if b"QZQZ" in line)
    lines[i] = lines[i].replace(b"QZQZ", b"Q\xff\xfeZ")
    log.write_bytes(b"".join(lines))
    return seq


APPEND_CRASHES = [None, "roll-manifest", "roll-renamed", "roll-created", "compress-written", "compress-manifest",
                  "compress-renamed", "checkpoint-written"]
OPS = st.one_of(
    st.tuples(st.just("append"), st.sampled_from(APPEND_CRASHES)),
    st.tuples(st.just("export"), st.booleans()),
    st.tuples(st.just("fork"), st.booleans()),
    st.tuples(st.just("expire+purge"), st.booleans()),
)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(repair_crash=st.sampled_from([None, "repair-quarantine-written", "repair-log-written"]),
       ops=st.lists(OPS, min_size=2, max_size=4),
       erase_crash=st.sampled_from([None, "erase-copies-written"]))
def test_erase_leaves_no_copy_after_random_killed_operations(tmp_path_factory: pytest.TempPathFactory,
                                                             repair_crash: str | None, ops: list[Any],
                                                             erase_crash: str | None) -> None:
    """Random operations, each possibly killed in the middle of its file-writing step (repair's quarantine, rolls,
    compression, checkpoints, a compaction export, a fork's temp folder, a trash purge, the erase itself), then an
    erase: no byte under the storage root holds the secret in any encoding, forks made from it aside."""
    import asyncio

    storage = tmp_path_factory.mktemp("copies") / "store"
    seq = asyncio.run(_setup(storage))
    assert any(h.startswith(".search/") for h in _copies_under(storage, set())), "the search index should hold it"
    if repair_crash:
        assert _child(storage, "repair", crash_at=repair_crash) == "KILLED"
    _child(storage, "repair")
    assert any("base64" in h for h in _copies_under(storage, set())), "the quarantine should hold a base64 copy"
    forks: set[str] = set()
    for n, (op, arg) in enumerate(ops):
        if op == "append":
            _child(storage, "append", "16", crash_at=arg)
        elif op == "export":
            _child(storage, "export", *(["pause"] if arg else []), kill=arg)
        elif op == "fork":
            name = f"copy-{n}"
            if _child(storage, "fork", name, *(["pause"] if arg else []), kill=arg) == "DONE":
                forks.add(name)
        else:
            _child(storage, "append", "16")  # (sealed segments to expire)
            _child(storage, "expire")
            _child(storage, "purge", *(["pause"] if arg else []), kill=arg)
    if erase_crash:
        _child(storage, "erase", str(seq), crash_at=erase_crash)
    said = _child(storage, "erase", str(seq), report=True)
    left = _copies_under(storage, forks)
    if "REFUSED" in said:  # its record was purged from the trash: only pieces erase cannot name may be left
        assert "no record holds its bytes" in said and all(f"{x.split(':')[0].split('/')[-1]}" in said for x in left)
        assert all("quarantine" in x or "compaction-" in x for x in left), left
    else:
        assert left == []
