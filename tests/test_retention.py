"""Retention policies on the file backend: the policy model and plan (pure), the trash and its ledger, restore,
purge, the open refusal of a trashed session, apply_on_open and the CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import PYTHON
from context_persistent import LedgerError, PersistentContextManager, SessionLockedError, SessionTrashedError
from context_persistent.operations import trash
from context_persistent.model.codec import Links
from context_persistent.storage.log import scan
from context_persistent.model.retention import RetentionPolicy, SessionInfo, plan

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _info(sid: str, days_ago: float, size: int = 100, live: bool = False) -> SessionInfo:
    return SessionInfo(sid, T0 - timedelta(days=days_ago), size, live)


# -- the policy model --------------------------------------------------------------------------------
@pytest.mark.parametrize("config, words", [
    ({"max_age_days": -1}, "max_age_days must be a number from 0 to 1,000,000"),
    ({"max_age_days": "30"}, "max_age_days must be a number"),
    ({"max_age_days": float("nan")}, "max_age_days"),
    ({"max_sessions": 2.5}, "max_sessions must be a whole number"),
    ({"max_bytes": True}, "max_bytes must be a whole number"),
    ({"grace_days": -3}, "grace_days"),
    ({"apply_on_open": "yes"}, "apply_on_open must be true or false"),
    ({"apply_on_open": True}, "no limit is set"),
    ({"max_age": 3}, "unknown retention key(s) max_age; allowed: max_age_days"),
    ([1], "retention must be a mapping"),
])
def test_policy_errors_say_what_is_allowed(config: Any, words: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        RetentionPolicy.from_config(config)
    assert words in str(e.value)


def test_store_config_checks_the_policy() -> None:
    cfg = PersistentContextManager.check_config({"retention": {"max_age_days": 30, "grace_days": 1}})
    assert cfg["retention"] == RetentionPolicy(max_age_days=30, grace_days=1)
    with pytest.raises(ValueError, match="retention.max_sessions"):
        PersistentContextManager.check_config({"retention": {"max_sessions": -1}})
    assert PersistentContextManager.check_config({})["retention"] is None


# -- the plan (pure) ---------------------------------------------------------------------------------
def test_plan_by_age() -> None:
    p = plan(RetentionPolicy(max_age_days=30), [_info("old", 31), _info("new", 29), _info("edge", 30)], T0)
    assert [e.session_id for e in p.expire] == ["old"]
    assert p.expire[0].rule == "max_age_days" and "31.0 days old" in p.expire[0].reason
    assert sorted(s.session_id for s in p.kept) == ["edge", "new"]


def test_plan_by_count_keeps_the_newest() -> None:
    infos = [_info(f"s{i}", days_ago=i) for i in range(5)]
    p = plan(RetentionPolicy(max_sessions=2), infos, T0)
    assert [e.session_id for e in p.expire] == ["s4", "s3", "s2"]  # oldest first
    assert [s.session_id for s in p.kept] == ["s1", "s0"]


def test_plan_by_size_drops_oldest_until_it_fits() -> None:
    infos = [_info("a", 3, 500), _info("b", 2, 300), _info("c", 1, 300)]
    assert [e.session_id for e in plan(RetentionPolicy(max_bytes=600), infos, T0).expire] == ["a"]
    assert [e.session_id for e in plan(RetentionPolicy(max_bytes=299), infos, T0).expire] == ["a", "b", "c"]
    assert plan(RetentionPolicy(max_bytes=1100), infos, T0).expire == []


def test_plan_rules_combine_and_report_the_first() -> None:
    infos = [_info("a", 100, 10), _info("b", 5, 10), _info("c", 4, 10), _info("d", 1, 10)]
    p = plan(RetentionPolicy(max_age_days=50, max_sessions=2), infos, T0)
    assert [(e.session_id, e.rule) for e in p.expire] == [("a", "max_age_days"), ("b", "max_sessions")]


def test_plan_live_sessions_are_reported_not_replaced() -> None:
    infos = [_info("old-live", 9, live=True), _info("mid", 5), _info("new", 1)]
    p = plan(RetentionPolicy(max_sessions=2), infos, T0)
    assert [e.session_id for e in p.live] == ["old-live"] and p.expire == []


def test_plan_excludes_the_session_being_opened() -> None:
    p = plan(RetentionPolicy(max_age_days=1), [_info("me", 9), _info("other", 9)], T0, frozenset({"me"}))
    assert [e.session_id for e in p.expire] == ["other"]


# -- applying on the file backend -------------------------------------------------------------------
async def _make(storage: Path, sid: str, n: int = 3) -> list[dict[str, Any]]:
    store = await PersistentContextManager.open(storage_path=storage, session_id=sid)
    msgs = [{"role": "user", "content": f"{sid} message {i}"} for i in range(n)]
    for m in msgs:
        await store.add_message(m)
    await store.close()
    return msgs


def _ledger(storage: Path) -> list[dict[str, Any]]:
    path = storage / ".retention" / "events.jsonl"
    records = [rec for rec, _ in scan(path)]
    links = Links(".retention")
    for rec in records:
        assert links.check(rec) is None  # chained like a session's log, from its own root
    return records


def _sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


async def test_apply_moves_expired_sessions_and_records_them(storage: Path) -> None:
    for sid in ("a", "b", "c"):
        await _make(storage, sid)
    digest = _sha(storage / "a" / "events.jsonl")
    report = await trash.apply_file(storage, RetentionPolicy(max_sessions=2, grace_days=3))
    assert [t["session_id"] for t in report["trashed"]] == ["a"]
    assert not (storage / "a").exists()
    entry = storage / ".retention" / "trash" / "a~1"
    assert (entry / "events.jsonl").is_file()
    for p in (storage / ".retention", storage / ".retention" / "trash", entry):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    assert stat.S_IMODE((storage / ".retention" / "events.jsonl").stat().st_mode) == 0o600
    [rec] = _ledger(storage)
    assert rec["type"] == "trashed"
    d = rec["data"]
    assert d["session_id"] == "a" and d["entry"] == "a~1" and d["rule"] == "max_sessions"
    assert d["log"]["sha256"] == digest and d["policy"]["max_sessions"] == 2 and d["grace_days"] == 3
    assert datetime.fromisoformat(d["purge_after"]) - datetime.fromisoformat(rec["ts"]) < timedelta(days=3, seconds=1)
    # the others are untouched; ls does not list the trash
    assert sorted(p.name for p in storage.iterdir()) == [".retention", ".search", "b", "c"]  # (.search: the index)


async def test_trashed_session_does_not_open_and_restore_brings_it_back(storage: Path) -> None:
    msgs = await _make(storage, "gone")
    await _make(storage, "stays")
    await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    for readonly in (False, True):
        with pytest.raises(SessionTrashedError) as e:
            await PersistentContextManager.open(storage_path=storage, session_id="gone", readonly=readonly)
        assert "gone~1" in str(e.value) and "trash restore gone~1" in str(e.value)
    assert not (storage / "gone").exists()  # the refused open created nothing
    from context_persistent.store.importing import import_

    src = await PersistentContextManager.open(storage_path=storage, session_id="stays", readonly=True)
    with pytest.raises(SessionTrashedError):  # nor does an import or fork take the id
        await src.fork("gone")
    await src.close()
    with pytest.raises(SessionTrashedError):
        await import_(storage / "stays" / "events.jsonl", session_id="gone", storage_path=storage)
    listed = await trash.list_trash(storage)
    assert [(r["entry"], r["state"], r["present"]) for r in listed] == [("gone~1", "trashed", True)]
    data = await trash.restore(storage, "gone")
    assert data["entry"] == "gone~1"
    store = await PersistentContextManager.open(storage_path=storage, session_id="gone")
    assert await store.get_messages() == msgs
    await store.add_message({"role": "user", "content": "after restore"})
    await store.close()
    assert await trash.list_trash(storage) == []
    assert [r["state"] for r in await trash.list_trash(storage, all_entries=True)] == ["restored"]
    assert [r["type"] for r in _ledger(storage)] == ["trashed", "restored"]


async def test_restore_refuses_a_changed_entry_and_an_occupied_id(storage: Path) -> None:
    await _make(storage, "x")
    await _make(storage, "y")
    await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    log = storage / ".retention" / "trash" / "x~1" / "events.jsonl"
    original = log.read_bytes()
    with open(log, "ab") as f:
        f.write(b"\n")
    with pytest.raises(LedgerError, match="changed in the trash; nothing was restored"):
        await trash.restore(storage, "x~1")
    log.write_bytes(original)
    (storage / "x").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="exists"):
        await trash.restore(storage, "x~1")
    (storage / "x").rmdir()
    with pytest.raises(ValueError, match="no trash entry 'nope'"):
        await trash.restore(storage, "nope")
    await trash.restore(storage, "x~1")
    with pytest.raises(ValueError, match="was restored"):
        await trash.restore(storage, "x~1")


async def test_purge_respects_the_grace_period(storage: Path) -> None:
    for sid in ("p", "q", "r"):
        await _make(storage, sid)
    await trash.apply_file(storage, RetentionPolicy(max_sessions=1, grace_days=2))
    out = await trash.purge(storage)
    assert out["purged"] == [] and {r["entry"] for r in out["refused"]} == {"p~1", "q~2"}
    assert (storage / ".retention" / "trash" / "p~1").is_dir()
    later = datetime.now(timezone.utc) + timedelta(days=2, minutes=1)
    out = await trash.purge(storage, ["p~1"], now=later)
    assert [(p["entry"], p["forced"]) for p in out["purged"]] == [("p~1", False)]
    out = await trash.purge(storage, ["q"], force=True, reason="user asked")
    assert [(p["entry"], p["forced"]) for p in out["purged"]] == [("q~2", True)]
    assert os.listdir(storage / ".retention" / "trash") == []
    recs = _ledger(storage)
    assert [r["type"] for r in recs] == ["trashed", "trashed", "purged", "purged"]
    assert recs[3]["data"]["reason"] == "user asked" and recs[3]["data"]["forced"] is True
    # a purged session's id is free again
    store = await PersistentContextManager.open(storage_path=storage, session_id="p")
    assert await store.get_messages() == []
    await store.close()


async def test_a_live_session_is_never_trashed(storage: Path) -> None:
    await _make(storage, "old")
    await _make(storage, "new")
    holder = await PersistentContextManager.open(storage_path=storage, session_id="old")
    try:
        p = await trash.plan_file(storage, RetentionPolicy(max_sessions=1))
        assert [e.session_id for e in p.live] == ["old"] and p.expire == []
        report = await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
        assert report["trashed"] == [] and [s["session_id"] for s in report["skipped"]] == ["old"]
        # a session that becomes live after the plan: trash_session takes its lock, so it is refused too
        expiry = trash.plan(RetentionPolicy(max_sessions=1), [SessionInfo("old", T0, 1)] +
                            [SessionInfo("new", T0 + timedelta(days=1), 1)], T0 + timedelta(days=2)).expire[0]
        ledger = await trash.Ledger.open(storage)
        try:
            with pytest.raises(SessionLockedError):
                await trash.trash_session(ledger, expiry, RetentionPolicy(max_sessions=1), T0)
        finally:
            await ledger.close()
        assert (storage / "old" / "events.jsonl").is_file()
        await holder.add_message({"role": "user", "content": "still writing"})
    finally:
        await holder.close()
    assert not (storage / ".retention" / "events.jsonl").exists() or _ledger(storage) == []


async def test_age_uses_the_last_record(storage: Path) -> None:
    await _make(storage, "s")
    p = await trash.plan_file(storage, RetentionPolicy(max_age_days=10),
                              now=datetime.now(timezone.utc) + timedelta(days=9))
    assert p.expire == []
    p = await trash.plan_file(storage, RetentionPolicy(max_age_days=10),
                              now=datetime.now(timezone.utc) + timedelta(days=11))
    assert [e.session_id for e in p.expire] == ["s"]


async def test_apply_on_open_trashes_others_not_the_one_opened(storage: Path) -> None:
    await _make(storage, "me")
    await _make(storage, "other1")
    await _make(storage, "other2")
    store = await PersistentContextManager.open(storage_path=storage, session_id="me",
                                                retention={"max_sessions": 1, "apply_on_open": True})
    await store.close()
    # "me" is the oldest but is the one being opened: the two others exceed the count and go
    assert sorted(p.name for p in storage.iterdir()) == [".retention", ".search", "me"]
    assert sorted(r["session_id"] for r in await trash.list_trash(storage)) == ["other1", "other2"]
    # without apply_on_open, the policy in the config changes nothing on open
    await _make(storage, "third")
    store = await PersistentContextManager.open(storage_path=storage, session_id="me",
                                                retention={"max_sessions": 1})
    await store.close()
    assert (storage / "third").is_dir()


async def test_a_corrupt_ledger_record_stops_everything(storage: Path) -> None:
    await _make(storage, "a")
    await _make(storage, "b")
    await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    from context_persistent.model import codec
    ledger = storage / ".retention" / "events.jsonl"
    last = [rec for rec, _ in scan(ledger)][-1]
    with open(ledger, "ab") as f:
        f.write(codec.encode_event(2, "deleted", {"entry": "a~1"}, prev=last["crc"].encode()))
    with pytest.raises(LedgerError, match="not a ledger record"):
        await trash.list_trash(storage)
    with pytest.raises(LedgerError):
        await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    assert (storage / ".retention" / "trash" / "a~1").is_dir() and (storage / "b").is_dir()


async def test_reconcile_cancels_a_recorded_but_unmoved_trash(storage: Path) -> None:
    """What a process killed between the ledger record and the rename leaves (the crash test kills real
    processes at that point; this checks the state machine on its own)."""
    await _make(storage, "a")
    await _make(storage, "b")
    ledger = await trash.Ledger.open(storage)
    p = plan(RetentionPolicy(max_sessions=1), trash.sessions(storage), datetime.now(timezone.utc))
    await ledger.append("trashed", {"entry": "a~1", "session_id": "a", "rule": "max_sessions", "reason": "test",
                                    "policy": {}, "log": {}, "bytes": 0, "purge_after": T0.isoformat()})
    await ledger.close()
    assert [r["state"] for r in await trash.list_trash(storage)] == ["interrupted"]
    store = await PersistentContextManager.open(storage_path=storage, session_id="a")  # not moved: opens
    await store.close()
    assert [e.session_id for e in p.expire] == ["a"]
    report = await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    assert report["reconciled"] == [{"entry": "a~1", "action": "trash cancelled (interrupted before the move)"}]
    assert [r["type"] for r in _ledger(storage)] == ["trashed", "trash_cancelled", "trashed"]


# -- the command line --------------------------------------------------------------------------------
def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "context_persistent", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_cli_plan_apply_list_restore_purge(storage: Path, subprocess_env: dict[str, str]) -> None:
    for sid in ("c1", "c2", "c3"):
        asyncio.run(_make(storage, sid))
    s = ["--storage", str(storage)]
    r = _cli(subprocess_env, "retention", "plan", "--max-sessions", "1", *s)
    assert r.returncode == 0, r.stderr
    assert "expire c1" in r.stdout and "expire c2" in r.stdout and "2 session(s) to expire" in r.stdout
    assert sorted(p.name for p in storage.iterdir()) == [".search", "c1", "c2", "c3"]  # a plan changes nothing
    r = _cli(subprocess_env, "retention", "apply", "--max-sessions", "1", "--grace-days", "0.5", "--json", *s)
    assert r.returncode == 0, r.stderr
    assert [t["entry"] for t in json.loads(r.stdout)["trashed"]] == ["c1~1", "c2~2"]
    r = _cli(subprocess_env, "trash", "list", *s)
    assert r.returncode == 0 and "c1~1  trashed" in r.stdout and "c2~2  trashed" in r.stdout
    r = _cli(subprocess_env, "show", "c1", *s)
    assert r.returncode == 1 and "trash restore c1~1" in r.stderr
    r = _cli(subprocess_env, "trash", "restore", "c1", *s)
    assert r.returncode == 0 and "restored c1~1 as session c1" in r.stdout
    r = _cli(subprocess_env, "trash", "purge", "c2~2", *s)
    assert r.returncode == 1 and "within its grace period" in r.stdout
    r = _cli(subprocess_env, "trash", "purge", "c2~2", "--force", "--reason", "gdpr", *s)
    assert r.returncode == 0 and "purged c2~2" in r.stdout
    r = _cli(subprocess_env, "trash", "list", "--all", "--json", *s)
    assert [x["state"] for x in json.loads(r.stdout)] == ["restored", "purged"]
    r = _cli(subprocess_env, "retention", "apply", *s)
    assert r.returncode == 2 and "give at least one limit" in r.stderr
    r = _cli(subprocess_env, "retention", "plan", "--max-sessions", "-2", *s)
    assert r.returncode == 2 and "--max-sessions: expected a whole number from 0 to" in r.stderr


async def test_a_segmented_session_moves_and_comes_back_whole(storage: Path) -> None:
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg", segment_bytes=4096)
    msgs = [{"role": "user", "content": f"message {i} " + "s" * 300} for i in range(60)]
    for m in msgs:
        await store.add_message(m)
    await store.close()
    await _make(storage, "newer")
    names = sorted(p.name for p in (storage / "seg").iterdir())
    assert "segments.json" in names and any(n.startswith("segment-") for n in names)
    report = await trash.apply_file(storage, RetentionPolicy(max_sessions=1))
    assert [t["session_id"] for t in report["trashed"]] == ["seg"]
    entry = storage / ".retention" / "trash" / "seg~1"
    assert sorted(p.name for p in entry.iterdir() if p.name != "lock") == [n for n in names if n != "lock"]
    [rec] = _ledger(storage)
    assert rec["data"]["manifest"]["sha256"] == _sha(entry / "segments.json")
    assert rec["data"]["bytes"] >= 60 * 300
    # a changed segment manifest is refused at restore; the original comes back whole
    original = (entry / "segments.json").read_bytes()
    os.chmod(entry / "segments.json", 0o600)
    (entry / "segments.json").write_bytes(original + b" ")
    with pytest.raises(LedgerError, match="segment manifest differs"):
        await trash.restore(storage, "seg")
    (entry / "segments.json").write_bytes(original)
    await trash.restore(storage, "seg")
    store = await PersistentContextManager.open(storage_path=storage, session_id="seg")
    assert await store.get_messages() == msgs
    await store.close()


async def test_a_writer_that_opened_the_folder_just_before_it_was_trashed_does_not_write_there(
        storage: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: a writer has the session folder open (its descriptor) when retention moves it to the trash;
    after taking the lock it finds the folder gone from its place and refuses, writing nothing in the trash."""
    import context_persistent.storage.log as log_module

    await _make(storage, "racy")
    await _make(storage, "newer")
    real = log_module.FileLock
    moved = []

    def lock_after_the_move(path: Path, session_id: str, dir_fd: int | None = None) -> Any:
        if session_id == "racy" and not moved:
            moved.append(True)
            os.rename(storage / "racy", storage / ".retention" / "trash" / "racy~1")
        return real(path, session_id, dir_fd)

    ledger = await trash.Ledger.open(storage)  # record the move the way apply does, then let the writer race it
    digest = _sha(storage / "racy" / "events.jsonl")
    await ledger.append("trashed", {"entry": "racy~1", "session_id": "racy", "rule": "max_sessions",
                                    "reason": "test", "policy": {}, "log": {"bytes": 0, "sha256": digest},
                                    "manifest": None, "bytes": 0, "purge_after": T0.isoformat()})
    await ledger.close()
    monkeypatch.setattr(log_module, "FileLock", lock_after_the_move)
    with pytest.raises(SessionTrashedError, match="racy~1"):
        await PersistentContextManager.open(storage_path=storage, session_id="racy")
    assert moved and not (storage / "racy").exists()
    assert _sha(storage / ".retention" / "trash" / "racy~1" / "events.jsonl") == digest
    monkeypatch.setattr(log_module, "FileLock", real)
    await trash.restore(storage, "racy")
    store = await PersistentContextManager.open(storage_path=storage, session_id="racy")
    assert len(await store.get_messages()) == 3
    await store.close()
