"""Retention on the file backend: the ledger, the trash folder, and applying a policy (I/O; retention.py
decides what expires).

Layout (docs/format.md, the storage tree and "The retention ledger"): ``<storage>/.retention/`` (0700) holds ``events.jsonl``, the retention
ledger (a chained, CRC-checked log like a session's, read and written through ``FileEventLog``; its ``lock``
is held by whoever changes the trash), and ``trash/<session_id>~<ledger seq>/``, each an expired session
folder moved there whole by one ``rename``.

Every change is recorded before it is made, so nothing disappears unrecorded: the ledger record (``trashed``,
``restored``, ``purged``) is made durable, then the folder is renamed (atomic: the session is in one place or
the other, never half moved). A process killed between the two leaves a record whose move did not happen;
the next retention command (or an open with ``apply_on_open``) reconciles it first: an unfinished trash is
cancelled (``trash_cancelled``: the session stays where it is, untouched), an unfinished restore or purge is
finished. A session whose writer lock is held is never moved: the mover takes that lock itself first.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ..model import codec
from .search import indexer as search_index
from ..errors import LedgerError, LogCorruptedError, SessionLockedError, SessionTrashedError
from ..storage.log import FileEventLog, FileLock, data_end
from ..storage.paths import LOCK_NAME, LOG_NAME, fsync_dir, make_private_dirs, validate_session_id
from ..storage.segments import MANIFEST_NAME as _MANIFEST  # (a folder holding only it is a session: a roll killed midway)
from ..model.retention import (CANCELLED, ENTRY_SEP, PURGED, RESTORE_CANCELLED, RESTORED, SEGMENTS_CANCELLED, TRASHED, Entry,
                        Expiry, Plan, RetentionPolicy, SegmentExpiry, SegmentInfo, SessionInfo, find_entry, fold, plan,
                        purge_plan)
from ..storage.segments import LogReader, load_manifest
from ..storage.trash_folder import (PURGING, RETENTION_DIR, TRASH_DIR, check_not_trashed, entries_for, retention_dir,
                                   trash_dir)

#: The ledger's chain root is the CRC-32 of ``session:.retention`` (an id no session can have).
LEDGER_ID = ".retention"
#: Why ``apply`` left a selected sealed segment in place when its session was not live.
SEGMENTS_NOT_APPLIED = ("the log changed since the plan, or an earlier expiry's record lies after these segments "
                        "(it expires with them later): nothing of the session was changed")


# -- measuring ------------------------------------------------------------------------------------------
def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return "sha256:" + h.hexdigest(), n


def folder_bytes(folder: Path | str) -> tuple[int, int]:
    """``(bytes, files)`` of every regular file under ``folder``."""
    total = files = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_size
            files += 1
    return total, files


def _flat_bytes(folder: str) -> int:
    """The bytes of the files directly in a session folder (where the store writes; no subfolders)."""
    total = 0
    with os.scandir(folder) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


def _is_live(folder: str) -> bool:
    """Whether a writer holds the session's lock right now (probed with a shared, non-blocking flock)."""
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _last_line(fd: int, end: int) -> bytes | None:
    """The last newline-terminated line before byte ``end`` of an open log (None if there is none)."""
    back = 0
    while True:
        back = min(end, max(back * 16, 4096))
        chunk = os.pread(fd, back, end - back)
        if not chunk.endswith(b"\n"):
            return None
        start = chunk.rfind(b"\n", 0, len(chunk) - 1) + 1
        if start > 0 or back == end:
            return chunk[start:] if chunk[start:].strip() else None


def last_record(folder: Path | str, session_id: str = "") -> dict[str, Any] | None:
    """The last valid record of a session's active log file (None if its end is torn, it is empty (a log that
    just rolled into a sealed segment) or missing (a roll killed between its renames: the next open restores
    it))."""
    try:
        fd = os.open(os.path.join(folder, LOG_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        line = _last_line(fd, data_end(fd))
    finally:
        os.close(fd)
    if line is None:
        return None
    try:
        return codec.decode(line)
    except codec.RecordError:
        return None


def describe(storage: Path | str, session_id: str) -> SessionInfo:
    """A session as a policy sees it: last activity is the time of its last record (the log file's
    modification time if its last record is torn), size is every file in its folder."""
    folder = os.path.join(storage, session_id)
    rec = last_record(folder)
    if rec is not None:
        when = datetime.fromisoformat(rec["ts"])
    else:  # (the active file's time: when it was last written, or created by a roll right after an append)
        log = os.path.join(folder, LOG_NAME)
        when = datetime.fromtimestamp(os.stat(log if os.path.exists(log) else os.path.join(folder, _MANIFEST))
                                      .st_mtime, timezone.utc)
    return SessionInfo(session_id, when, _flat_bytes(folder), _is_live(folder))


def sessions(storage: Path | str) -> list[SessionInfo]:
    """Every session folder (one holding an ``events.jsonl``) in the storage root."""
    out: list[SessionInfo] = []
    try:
        entries = sorted(e.name for e in os.scandir(storage) if e.is_dir() and not e.name.startswith("."))
    except FileNotFoundError:
        return out
    for name in entries:
        if not (os.path.isfile(os.path.join(storage, name, LOG_NAME))
                or os.path.isfile(os.path.join(storage, name, _MANIFEST))):
            continue
        try:
            validate_session_id(name)
        except ValueError:
            continue
        out.append(describe(storage, name))
    return out


def sealed_segments(storage: Path | str, session_id: str) -> list[SegmentInfo]:
    """The sealed segments of a session, oldest first, each with the time of its last record (read from the
    segment: one line, one zstd frame if compressed); [] for a single-file log. A last record that does not
    decode is corruption: LogCorruptedError (never skipped)."""
    folder = Path(storage) / session_id
    manifest = load_manifest(folder, session_id)
    if manifest is None or not manifest.segments:
        return []
    out: list[SegmentInfo] = []
    with LogReader(folder, session_id) as reader:
        for seg in manifest.segments:
            line = reader.line_ending_at(seg.end)
            try:
                rec = codec.decode(line)
            except codec.RecordError as e:
                path, offset = reader.where(seg.end - len(line))
                raise LogCorruptedError(str(path), 0, offset, f"the last record of sealed segment {seg.name} "
                                        f"does not decode ({e}); `context-persistent verify` checks the log") from None
            if rec["seq"] != seg.last_seq:
                path, offset = reader.where(seg.end - len(line))
                raise LogCorruptedError(str(path), 0, offset, f"the last record of sealed segment {seg.name} has "
                                        f"seq {rec['seq']}; the manifest says {seg.last_seq}")
            out.append(SegmentInfo(seg.name, seg.first_seq, seg.last_seq, datetime.fromisoformat(rec["ts"]),
                                   seg.size))
    return out


def _sealed_of(storage: Path, infos: list[SessionInfo], policy: RetentionPolicy) -> dict[str, list[SegmentInfo]]:
    """The sealed segments of each session, when the policy has a segment rule (else nothing is read)."""
    if not policy.segment_limits():
        return {}
    return {s.session_id: sealed_segments(storage, s.session_id) for s in infos}


def _manifest_digest(folder: Path) -> dict[str, Any] | None:
    """``{bytes, sha256}`` of a segmented session's manifest (which holds each sealed segment's SHA-256), or
    None for a single-file log."""
    path = folder / _MANIFEST
    if not path.exists():
        return None
    digest, size = _sha256_file(path)
    return {"bytes": size, "sha256": digest}


# -- the ledger -----------------------------------------------------------------------------------------
class Ledger:
    """The retention ledger of a storage root, open for writing (holding ``.retention/lock``) or reading."""

    def __init__(self, storage: Path, log: FileEventLog, records: list[dict[str, Any]]) -> None:
        self.storage = storage
        self.log = log
        self.records = records
        self.entries = fold(records, log.path)

    @classmethod
    async def open(cls, storage: Path, *, readonly: bool = False) -> "Ledger":
        """Open the ledger (creating ``.retention/`` on a write open). A writer holds its lock:
        SessionLockedError names the process applying retention meanwhile."""
        folder = retention_dir(storage)
        if readonly and not (folder / LOG_NAME).exists():
            log = None
        else:
            if not readonly:
                make_private_dirs(trash_dir(storage))
            log = FileEventLog(folder, LEDGER_ID, readonly=readonly)
        records: list[dict[str, Any]] = []
        if log is not None:
            try:
                async for batch in log.read_batches(0):
                    records.extend(batch)
                if log.torn is not None and not readonly:
                    log.cut_torn_tail()  # (a write cut short by a crash: nothing it said was acted on)
            except BaseException:
                await log.close()
                raise
        return cls(storage, log, records) if log is not None else _EmptyLedger(storage)

    async def append(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Write one ledger record durably (fsync) and fold it; returns the record."""
        seq = self.log.last_seq + 1
        line = codec.encode_event(seq, kind, data, prev=self.log.last_crc or codec.root_crc(LEDGER_ID))
        await self.log.append((line,), seq)
        rec = codec.decode(line)
        self.records.append(rec)
        self.entries = fold(self.records, self.log.path)
        return rec

    @property
    def next_seq(self) -> int:
        return self.log.last_seq + 1

    async def close(self) -> None:
        await self.log.close()


class _EmptyLedger(Ledger):
    """A storage root with no ledger yet (read-only): no entries."""

    def __init__(self, storage: Path) -> None:
        self.storage = storage
        self.records = []
        self.entries = {}

    async def close(self) -> None:
        return None


# -- moving ---------------------------------------------------------------------------------------------
def _rename(src: Path, dst: Path) -> None:
    """Move a folder by one rename (the commit point) and make both parents durable."""
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def _remove(storage: Path, name: str) -> None:
    """Delete a trash entry: rename it to ``.purging-<name>`` (a half-deleted folder is never listed), then
    delete that."""
    trash = trash_dir(storage)
    doomed = trash / (PURGING + name)
    if (trash / name).exists():
        _rename(trash / name, doomed)
    if doomed.exists():
        shutil.rmtree(doomed)
    fsync_dir(trash)


async def reconcile(ledger: Ledger) -> list[dict[str, Any]]:
    """Finish or roll back what a killed process left between a ledger record and its rename; returns what
    was done. Called (holding the ledger lock) before every change."""
    storage = ledger.storage
    trash = trash_dir(storage)
    done: list[dict[str, Any]] = []
    for name in sorted(os.listdir(trash)):
        if name.startswith(PURGING):  # a purge killed while deleting: its record is written, finish it
            shutil.rmtree(trash / name)
            fsync_dir(trash)
            done.append({"entry": name[len(PURGING):], "action": "purge finished"})
    for entry in list(ledger.entries.values()):
        here = (trash / entry.name).exists()
        live = storage / entry.session_id
        if entry.kind == "segments":
            if entry.state == TRASHED and not here:
                done.extend(await _reconcile_segments(ledger, entry))
            elif entry.state == PURGED and here:
                _remove(storage, entry.name)
                done.append({"entry": entry.name, "action": "purge finished"})
            continue
        if entry.state in (TRASHED, RESTORE_CANCELLED) and not here:
            if entry.state == TRASHED and live.exists():
                await ledger.append(CANCELLED, {"entry": entry.name, "session_id": entry.session_id,
                                                "reason": "interrupted before the move: the session stayed in place"})
                done.append({"entry": entry.name, "action": "trash cancelled (interrupted before the move)"})
            else:
                raise LedgerError(f"trash entry {entry.name} is recorded in the ledger but {trash / entry.name} is "
                                  "missing: it was moved or deleted outside context-persistent; nothing was changed")
        elif entry.state == RESTORED and here:
            if live.exists():
                await ledger.append(RESTORE_CANCELLED, {"entry": entry.name, "session_id": entry.session_id,
                                                        "reason": f"{live} exists: the entry stays in the trash"})
                done.append({"entry": entry.name, "action": "restore cancelled (the session folder exists)"})
            else:
                _rename(trash / entry.name, live)
                done.append({"entry": entry.name, "action": "restore finished"})
        elif entry.state == PURGED and here:
            _remove(storage, entry.name)
            done.append({"entry": entry.name, "action": "purge finished"})
    return done


async def _reconcile_segments(ledger: Ledger, entry: Entry) -> list[dict[str, Any]]:
    """A segment expiry a killed process left before its files were in the trash: finished when the session's
    log holds its ``expired`` record (the views already are the expired ones), cancelled when it does not
    (nothing of the session changed). A session a writer holds is left for the next command."""
    from .segment_expiry import commit_and_move, find_expired

    folder = ledger.storage / entry.session_id
    if not folder.exists():
        raise LedgerError(f"trash entry {entry.name} records expired segments of session {entry.session_id}, whose "
                          f"folder {folder} is missing; nothing was changed")
    try:
        log = FileEventLog(folder, entry.session_id, create=False)  # (its open finishes committed moves)
    except SessionLockedError:
        return []
    try:
        if (trash_dir(ledger.storage) / entry.name).exists():
            return [{"entry": entry.name, "action": "segment expiry finished (files moved)"}]
        found = find_expired(log, entry.name)
        if found is None:
            await ledger.append(SEGMENTS_CANCELLED, {"entry": entry.name, "session_id": entry.session_id,
                                                     "reason": "interrupted before the expired record was written: "
                                                               "the session was not changed"})
            return [{"entry": entry.name, "action": "segment expiry cancelled (interrupted before its record)"}]
        make_private_dirs(trash_dir(ledger.storage))
        commit_and_move(log, ledger.storage, entry.name, found[0])
        return [{"entry": entry.name, "action": "segment expiry finished (manifest and files)"}]
    finally:
        await log.close()


async def trash_session(ledger: Ledger, expiry: Expiry, policy: RetentionPolicy, now: datetime) -> dict[str, Any]:
    """Move one expired session to the trash: take its writer lock (SessionLockedError if live), record it,
    rename its folder. Returns the ``trashed`` record's data."""
    storage = ledger.storage
    sid = expiry.session_id
    folder = storage / validate_session_id(sid)
    lock = FileLock(folder / LOCK_NAME, sid)
    try:
        digest, size = _sha256_file(folder / LOG_NAME) if (folder / LOG_NAME).exists() else (None, 0)
        rec = last_record(folder, sid)
        total, files = folder_bytes(folder)
        name = f"{sid}{ENTRY_SEP}{ledger.next_seq}"
        data = {"entry": name, "session_id": sid, "rule": expiry.rule, "reason": expiry.reason,
                "policy": policy.as_dict(), "last_activity": expiry.session.last_activity.isoformat(),
                "last_seq": rec["seq"] if rec else None, "bytes": total, "files": files,
                "log": {"bytes": size, "sha256": digest}, "manifest": _manifest_digest(folder),
                "grace_days": policy.grace_days,
                "purge_after": (now + timedelta(days=policy.grace_days)).isoformat()}
        await ledger.append(TRASHED, data)
        _rename(folder, trash_dir(storage) / name)
    finally:
        lock.release()
    await search_index.forget_removed(storage, sid)  # (its messages leave the search index with it)
    return data


# -- the operations -------------------------------------------------------------------------------------
def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(timezone.utc)


def _followed(root: Path, ledger: Ledger, policy: RetentionPolicy, host_home: Path | None) -> list[SessionInfo]:
    """Every session, with what ``follow_host`` sees when the policy has it (host_follow.py)."""
    infos = sessions(root)
    if not policy.follow_host:
        return infos
    from .host_follow import follow

    return follow(root, infos, ledger.entries, host_home)


async def plan_file(storage: str | os.PathLike[str], policy: RetentionPolicy, *, now: datetime | None = None,
                    exclude: frozenset[str] = frozenset(), host_home: Path | None = None) -> Plan:
    """What ``policy`` would expire in a storage folder now (a dry run: nothing is changed): sessions, and
    the sealed segments of kept ones (``Plan.segments``). ``host_home``: where ``follow_host`` looks for the
    host's folders (host_follow.py)."""
    root = Path(storage)
    ledger = await Ledger.open(root, readonly=True)
    try:
        infos = _followed(root, ledger, policy, host_home)
    finally:
        await ledger.close()
    return plan(policy, infos, _now(now), exclude, _sealed_of(root, infos, policy))


async def apply_file(storage: str | os.PathLike[str], policy: RetentionPolicy, *, now: datetime | None = None,
                     exclude: frozenset[str] = frozenset(), host_home: Path | None = None) -> dict[str, Any]:
    """Apply ``policy`` to a storage folder: reconcile, plan, move each expired session that no writer holds
    to the trash (recorded first), then expire the selected sealed segments of kept sessions. Returns
    ``{plan, trashed, skipped, reconciled, segments_expired, segments_kept}``;
    ``segments_expired``: one row per session whose oldest sealed segments went to a trash entry
    (segment_expiry.py); ``segments_kept``: the selected segments left in place, with why."""
    root = Path(storage)
    ledger = await Ledger.open(root)
    try:
        reconciled = await reconcile(ledger)
        when = _now(now)
        infos = _followed(root, ledger, policy, host_home)
        p = plan(policy, infos, when, exclude, _sealed_of(root, infos, policy))
        trashed, skipped = [], [{"session_id": e.session_id, "rule": e.rule, "why": "live: a writer holds it"}
                                for e in p.live]
        segments_kept = [{**e.as_dict(), "why": "live: a writer holds the session"} for e in p.segments_live]
        for expiry in p.expire:
            try:
                data = await trash_session(ledger, expiry, policy, when)
            except SessionLockedError as e:  # it became live since the plan: never trashed
                skipped.append({"session_id": expiry.session_id, "rule": expiry.rule, "why": f"live: {e}"})
                continue
            trashed.append({k: data[k] for k in ("entry", "session_id", "rule", "reason", "bytes", "purge_after")})
        segments_expired = await _expire_segments(ledger, p.segments, policy, when, segments_kept)
        return {"plan": p.as_dict(), "trashed": trashed, "skipped": skipped, "reconciled": reconciled,
                "segments_expired": segments_expired, "segments_kept": segments_kept}
    finally:
        await ledger.close()


async def _expire_segments(ledger: Ledger, picked: list[SegmentExpiry], policy: RetentionPolicy, when: datetime,
                           kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Expire the selected sealed segments, one trash entry per session (segment_expiry.py); a session that
    became live since the plan, or whose log changed, keeps them (added to ``kept``)."""
    from .segment_expiry import expire

    by_session: dict[str, list[SegmentExpiry]] = {}
    for e in picked:
        by_session.setdefault(e.session_id, []).append(e)
    out: list[dict[str, Any]] = []
    for sid, group in by_session.items():
        try:
            data = await expire(ledger.storage, ledger, sid, group, policy, when)
        except SessionLockedError as e:
            kept.extend({**x.as_dict(), "why": f"live: {e}"} for x in group)
            continue
        if data is None:
            kept.extend({**x.as_dict(), "why": SEGMENTS_NOT_APPLIED} for x in group)
            continue
        out.append({"entry": data["entry"], "session_id": sid, "segments": [s["name"] for s in data["segments"]],
                    "first_seq": data["first_seq"], "last_seq": data["last_seq"], "rule": data["rule"],
                    "bytes": data["bytes"], "purge_after": data["purge_after"]})
    return out


async def list_trash(storage: str | os.PathLike[str], *, all_entries: bool = False) -> list[dict[str, Any]]:
    """The trash entries (those in the trash now; with ``all_entries``, also restored, cancelled and purged
    ones), oldest first, as the ledger records them, each with ``present`` (its folder is in the trash)."""
    root = Path(storage)
    ledger = await Ledger.open(root, readonly=True)
    try:
        out = []
        for entry in sorted(ledger.entries.values(), key=lambda e: e.seq):
            in_trash = entry.state in (TRASHED, RESTORE_CANCELLED)
            if in_trash or all_entries:
                row = {**entry.as_dict(), "present": (trash_dir(root) / entry.name).is_dir()}
                if entry.state == TRASHED and not row["present"] and (root / entry.session_id).exists():
                    row["state"] = "interrupted"  # recorded, not moved: the next retention command cancels it
                out.append(row)
        return out
    finally:
        await ledger.close()


def _find(ledger: Ledger, name: str) -> Entry:
    return find_entry(ledger.entries, name, "context-persistent trash list")


async def restore(storage: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """Move a trash entry back to its session folder (the log's SHA-256 is checked against the ledger first).
    ``name`` is an entry name or a session id with exactly one entry in the trash."""
    root = Path(storage)
    ledger = await Ledger.open(root)
    try:
        await reconcile(ledger)
        entry = _find(ledger, name)
        if entry.kind == "segments":
            raise ValueError(f"trash entry {entry.name} holds the expired segments of session {entry.session_id} "
                             f"(seqs {entry.data['first_seq']}..{entry.data['last_seq']}); they cannot go back into "
                             "the log, whose later records follow the expired record: read them in "
                             f"{trash_dir(root) / entry.name} (plain or zstd JSONL), or purge the entry")
        src = trash_dir(root) / entry.name
        dst = root / entry.session_id
        if dst.exists():
            raise ValueError(f"cannot restore {entry.name}: {dst} exists (a new session under the same id); move "
                             "or remove that session first")
        digest, size = _sha256_file(src / LOG_NAME) if (src / LOG_NAME).exists() else (None, 0)
        manifest = _manifest_digest(src)
        if digest != entry.data["log"]["sha256"] or manifest != entry.data.get("manifest"):
            what = "log" if digest != entry.data["log"]["sha256"] else "segment manifest"
            raise LedgerError(f"trash entry {entry.name}: its {what} differs from what the ledger recorded (SHA-256): "
                              "it changed in the trash; nothing was restored")
        data = {"entry": entry.name, "session_id": entry.session_id, "log": {"bytes": size, "sha256": digest}}
        await ledger.append(RESTORED, data)
        _rename(src, dst)
        return data
    finally:
        await ledger.close()


async def purge(storage: str | os.PathLike[str], names: list[str] | None = None, *, force: bool = False,
                now: datetime | None = None, reason: str = "") -> dict[str, Any]:
    """Delete trash entries for good: the named ones (all whose grace period is over when ``names`` is None).
    An entry still within its grace period is refused unless ``force``. Each is recorded (``purged``) before
    it is deleted. Returns ``{purged, refused}``."""
    root = Path(storage)
    when = _now(now)
    ledger = await Ledger.open(root)
    try:
        await reconcile(ledger)
        todo, refused = purge_plan(ledger.entries, names, "context-persistent trash list", when, force=force,
                                   reason=reason)
        purged = []
        for entry, record, row in todo:
            await ledger.append(PURGED, record)  # (recorded before it is deleted)
            _remove(root, entry.name)
            purged.append(row)
        return {"purged": purged, "refused": refused}
    finally:
        await ledger.close()


async def apply_on_open(storage: Path, policy: RetentionPolicy, session_id: str) -> dict[str, Any] | None:
    """``apply_on_open``: apply ``policy`` to the other sessions of the storage root before ``session_id`` is
    opened. None when another process holds the ledger (it is applying retention right now)."""
    try:
        return await apply_file(storage, policy, exclude=frozenset({session_id}))
    except SessionLockedError:
        return None


__all__ = ["Entry", "Ledger", "LedgerError", "SessionTrashedError", "apply_file", "apply_on_open",
           "SEGMENTS_NOT_APPLIED", "check_not_trashed", "list_trash", "plan_file", "purge", "reconcile", "restore",
           "sealed_segments", "sessions",
           "trash_session"]
