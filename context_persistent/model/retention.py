"""Retention policies: which sessions expire, and why (pure: no I/O, no clock of its own).

A policy is checked once (:meth:`RetentionPolicy.from_config`, a ValueError naming the key and the rule) and
then evaluated by :func:`plan` over a description of the sessions (:class:`SessionInfo`: last activity, size,
whether a writer holds it). The plan says, for every session that a rule selects, which rule and why; the
I/O that moves expired sessions to the trash and records them in the ledger is in ``trash.py`` (file
backend) and ``pg/retention.py`` (PostgreSQL); expiring the oldest sealed segments of a kept session
(:func:`plan_segments` selects them) is in ``segment_expiry.py``. docs/operations.md, "Retention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..errors import LedgerError

#: The keys a ``retention`` configuration takes (docs/configuration.md).
POLICY_KEYS = ("max_age_days", "max_bytes", "max_sessions", "max_segments", "grace_days", "apply_on_open",
               "follow_host")
#: The rules, in the order they are checked (a session selected by several is reported under the first).
RULES = ("follow_host", "max_age_days", "max_sessions", "max_bytes")
#: The rules over the sealed segments of a kept session, in the order they are checked.
SEGMENT_RULES = ("max_age_days", "max_segments")
DEFAULT_GRACE_DAYS = 7.0


#: The largest day count a policy takes (about 2,700 years: a date that far ahead is still a date; 1e10 days is
#: not, and once ended in an OverflowError); counts and byte sizes stop at the largest 64-bit integer.
MAX_DAYS = 1_000_000
MAX_COUNT = 2**63 - 1


def _number(config: dict[str, Any], key: str, *, integer: bool, minimum: float) -> Any:
    value = config.get(key)
    if value is None:
        return None
    kind = "a whole number" if integer else "a number"
    maximum = MAX_COUNT if integer else MAX_DAYS
    rule = f"retention.{key} must be {kind} from {minimum:g} to {maximum:,} (or null for no limit), got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(rule)
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise ValueError(rule)
    return value


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What expires: sessions idle longer than ``max_age_days``; beyond the newest ``max_sessions``; the
    oldest while the store holds more than ``max_bytes``. Of a kept session's sealed log segments: those whose
    last record is older than ``max_age_days``, and the oldest beyond the newest ``max_segments`` (the active
    segment never). ``follow_host``: sessions linked to a host's session folder (an Amplifier CLI session) whose
    folder the host deleted. ``None`` means no limit of that kind. Expired
    sessions stay in the trash ``grace_days`` before ``trash purge`` may delete them; ``apply_on_open``
    applies the policy whenever a store is opened."""

    follow_host: bool = False
    max_age_days: float | None = None
    max_bytes: int | None = None
    max_sessions: int | None = None
    max_segments: int | None = None
    grace_days: float = DEFAULT_GRACE_DAYS
    apply_on_open: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "RetentionPolicy":
        """The policy of a ``retention`` configuration (a dict of :data:`POLICY_KEYS`); ValueError says what
        is wrong and what is allowed."""
        if isinstance(config, RetentionPolicy):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"retention must be a mapping of {', '.join(POLICY_KEYS)}; got {config!r}")
        unknown = sorted(set(config) - set(POLICY_KEYS))
        if unknown:
            raise ValueError(f"unknown retention key(s) {', '.join(map(str, unknown))}; allowed: "
                             f"{', '.join(POLICY_KEYS)}")
        grace = _number(config, "grace_days", integer=False, minimum=0)
        apply_on_open = config.get("apply_on_open", False)
        follow_host = config.get("follow_host", False)
        for key, flag in (("apply_on_open", apply_on_open), ("follow_host", follow_host)):
            if not isinstance(flag, bool):
                raise ValueError(f"retention.{key} must be true or false, got {flag!r}")
        policy = cls(follow_host=follow_host, max_age_days=_number(config, "max_age_days", integer=False, minimum=0),
                     max_bytes=_number(config, "max_bytes", integer=True, minimum=0),
                     max_sessions=_number(config, "max_sessions", integer=True, minimum=0),
                     max_segments=_number(config, "max_segments", integer=True, minimum=0),
                     grace_days=DEFAULT_GRACE_DAYS if grace is None else grace,
                     apply_on_open=apply_on_open)
        if apply_on_open and not policy.limits():
            raise ValueError("retention.apply_on_open is true but no limit is set: give at least one of "
                             "follow_host, max_age_days, max_bytes, max_sessions, max_segments")
        return policy

    def limits(self) -> dict[str, Any]:
        """The limits that are set, by rule name (session and segment rules; ``follow_host`` when true)."""
        return {rule: getattr(self, rule) for rule in (*RULES, "max_segments")
                if getattr(self, rule) is not None and getattr(self, rule) is not False}

    def segment_limits(self) -> dict[str, Any]:
        """The limits that apply to sealed segments, by rule name."""
        return {rule: getattr(self, rule) for rule in SEGMENT_RULES if getattr(self, rule) is not None}

    def as_dict(self) -> dict[str, Any]:
        """The policy as recorded in the ledger (every key, ``None`` for no limit)."""
        return {"follow_host": self.follow_host, "max_age_days": self.max_age_days, "max_bytes": self.max_bytes, "max_sessions": self.max_sessions,
                "max_segments": self.max_segments, "grace_days": self.grace_days, "apply_on_open": self.apply_on_open}


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session as a policy sees it: when it was last written (the time of its last record), its size in
    bytes, and whether a writer holds it right now (``live``: never trashed). ``host_gone``: for a session
    linked to a host's session folder that the host deleted, a sentence saying so (``follow_host``); else None."""

    session_id: str
    last_activity: datetime
    bytes: int
    live: bool = False
    host_gone: str | None = None


@dataclass(frozen=True, slots=True)
class Expiry:
    """One session a rule selects: ``rule`` (a :data:`RULES` name) and ``reason`` (a sentence with the figures).
    ``live`` sessions are reported but never trashed."""

    session: SessionInfo
    rule: str
    reason: str

    @property
    def session_id(self) -> str:
        return self.session.session_id


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A sealed log segment as a policy sees it (docs/format.md, "Segments"): its file name, the seqs it
    holds, the time of its last record and its size in bytes (uncompressed)."""

    name: str
    first_seq: int
    last_seq: int
    last_record: datetime
    bytes: int


@dataclass(frozen=True, slots=True)
class SegmentExpiry:
    """One sealed segment of a kept session that a segment rule selects (``rule``: a :data:`SEGMENT_RULES`
    name; ``reason``: a sentence with the figures)."""

    session_id: str
    segment: SegmentInfo
    rule: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        s = self.segment
        return {"session_id": self.session_id, "segment": s.name, "first_seq": s.first_seq, "last_seq": s.last_seq,
                "last_record": s.last_record.isoformat(), "bytes": s.bytes, "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a policy selects at ``now``: ``expire`` (to be trashed), ``live`` (selected, but a writer holds
    them: skipped), ``kept`` (every other session), and the totals before and after. ``segments``: the sealed
    segments of kept sessions that the segment rules select; ``segments_live``: those of kept sessions a
    writer holds (never touched)."""

    now: datetime
    policy: RetentionPolicy
    expire: list[Expiry] = field(default_factory=list)
    live: list[Expiry] = field(default_factory=list)
    kept: list[SessionInfo] = field(default_factory=list)
    segments: list[SegmentExpiry] = field(default_factory=list)
    segments_live: list[SegmentExpiry] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def row(e: Expiry) -> dict[str, Any]:
            return {"session_id": e.session_id, "rule": e.rule, "reason": e.reason, "bytes": e.session.bytes,
                    "last_activity": e.session.last_activity.isoformat()}

        return {"now": self.now.isoformat(), "policy": self.policy.as_dict(),
                "expire": [row(e) for e in self.expire], "live": [row(e) for e in self.live],
                "kept": [s.session_id for s in self.kept],
                "bytes_expiring": sum(e.session.bytes for e in self.expire),
                "segments": [e.as_dict() for e in self.segments],
                "segments_live": [e.as_dict() for e in self.segments_live]}


def _age_days(now: datetime, then: datetime) -> float:
    return (now - then) / timedelta(days=1)


def plan_segments(policy: RetentionPolicy, session_id: str, sealed: list[SegmentInfo],
                  now: datetime) -> list[SegmentExpiry]:
    """Which of a kept session's sealed segments (``sealed``, oldest first) the segment rules expire at ``now``.

    Always the oldest ones, without a gap (a log can only lose its beginning): going from the oldest, a
    segment expires if its last record is more than ``max_age_days`` days before ``now`` (``max_age_days``),
    else if more than ``max_segments`` sealed segments are left from it on (``max_segments``); the first
    segment neither rule selects, and every newer one, stays. The active segment is not in ``sealed``: it
    never expires.
    """
    out: list[SegmentExpiry] = []
    total = len(sealed)
    for i, seg in enumerate(sealed):
        age = _age_days(now, seg.last_record)
        if policy.max_age_days is not None and age > policy.max_age_days:
            out.append(SegmentExpiry(session_id, seg, "max_age_days",
                                     f"its last record ({seg.last_record.isoformat()}) is {age:.1f} days old; "
                                     f"max_age_days is {policy.max_age_days:g}"))
        elif policy.max_segments is not None and total - i > policy.max_segments:
            out.append(SegmentExpiry(session_id, seg, "max_segments",
                                     f"{total} sealed segments; max_segments is {policy.max_segments}: this is "
                                     f"one of the {total - policy.max_segments} oldest"))
        else:
            break
    return out


def plan(policy: RetentionPolicy, sessions: list[SessionInfo], now: datetime,
         exclude: frozenset[str] = frozenset(), sealed: dict[str, list[SegmentInfo]] | None = None) -> Plan:
    """Which of ``sessions`` the policy expires at ``now`` and why.

    Rules, each over the sessions no earlier rule selected, oldest last activity first (ties by id):
    ``follow_host``: the host deleted the session's folder (``SessionInfo.host_gone``); ``max_age_days``: last activity more than that many days before ``now``; ``max_sessions``: every session
    beyond the newest N; ``max_bytes``: the oldest, until the total of the rest is within the limit. A live
    session a rule selects is listed in ``live`` and still counts as selected (the rule does not pick a newer
    session in its place: it is considered again at the next apply). Sessions in ``exclude`` (the one being
    opened) are never selected and count as kept.

    ``sealed`` (session id -> its sealed segments, oldest first) adds, for every kept session but those in
    ``exclude``, the segments :func:`plan_segments` selects (``segments``, or ``segments_live`` when a writer
    holds the session).
    """
    out = Plan(now=now, policy=policy)
    ordered = sorted(sessions, key=lambda s: (s.last_activity, s.session_id))
    chosen: dict[str, tuple[str, str]] = {}
    if policy.follow_host:
        for s in ordered:
            if s.session_id not in exclude and s.host_gone is not None:
                chosen[s.session_id] = ("follow_host", s.host_gone)
    if policy.max_age_days is not None:
        for s in ordered:
            age = _age_days(now, s.last_activity)
            if s.session_id not in exclude and s.session_id not in chosen and age > policy.max_age_days:
                chosen[s.session_id] = ("max_age_days", f"last activity {s.last_activity.isoformat()} is "
                                        f"{age:.1f} days old; max_age_days is {policy.max_age_days:g}")
    if policy.max_sessions is not None:
        remaining = [s for s in ordered if s.session_id not in chosen]
        surplus = len(remaining) - policy.max_sessions
        for s in remaining:
            if surplus <= 0:
                break
            if s.session_id in exclude:
                continue
            chosen[s.session_id] = ("max_sessions", f"{len(remaining)} sessions; max_sessions is "
                                    f"{policy.max_sessions}: this is one of the {len(remaining) - policy.max_sessions} "
                                    "oldest")
            surplus -= 1
    if policy.max_bytes is not None:
        remaining = [s for s in ordered if s.session_id not in chosen]
        total = sum(s.bytes for s in remaining)
        start = total
        for s in remaining:
            if total <= policy.max_bytes:
                break
            if s.session_id in exclude:
                continue
            chosen[s.session_id] = ("max_bytes", f"the store holds {start} bytes; max_bytes is {policy.max_bytes}: "
                                    f"the oldest sessions go until the rest fit ({total} bytes before this one)")
            total -= s.bytes
    for s in ordered:
        if s.session_id not in chosen:
            out.kept.append(s)
            if sealed and s.session_id not in exclude and policy.segment_limits():
                picked = plan_segments(policy, s.session_id, sealed.get(s.session_id, []), now)
                (out.segments_live if s.live else out.segments).extend(picked)
            continue
        rule, reason = chosen[s.session_id]
        (out.live if s.live else out.expire).append(Expiry(s, rule, reason))
    return out


def purge_due(trashed_at: datetime, grace_days: float, now: datetime) -> bool:
    """Whether a trash entry's grace period is over at ``now``."""
    return now >= trashed_at + timedelta(days=grace_days)


# -- the ledger's records (shared by the file and PostgreSQL backends) ---------------------------------
#: Separates the session id from the ledger seq in a trash entry's name (never part of a session id).
ENTRY_SEP = "~"
TRASHED, CANCELLED, RESTORED, RESTORE_CANCELLED, PURGED = (
    "trashed", "trash_cancelled", "restored", "restore_cancelled", "purged")
#: Segment expiry (segment_expiry.py): the oldest sealed segments of a kept session go to a trash entry.
SEGMENTS_TRASHED, SEGMENTS_CANCELLED = "segments_trashed", "segments_cancelled"
#: Ledger record types and the data keys each must have (a record without them is corrupt, never skipped).
LEDGER_TYPES: dict[str, tuple[str, ...]] = {
    TRASHED: ("entry", "session_id", "rule", "reason", "policy", "log", "bytes", "purge_after"),
    CANCELLED: ("entry", "session_id", "reason"),
    RESTORED: ("entry", "session_id"),
    RESTORE_CANCELLED: ("entry", "session_id", "reason"),
    PURGED: ("entry", "session_id", "forced", "reason"),
    SEGMENTS_TRASHED: ("entry", "session_id", "rule", "reason", "policy", "segments", "first_seq", "last_seq", "bytes",
                       "purge_after"),
    SEGMENTS_CANCELLED: ("entry", "session_id", "reason"),
}


@dataclass
class Entry:
    """A trash entry as the ledger folds it: the ``trashed`` record's data, its seq and time, and its state
    (``trashed``, ``trash_cancelled``, ``restored``, ``restore_cancelled`` (back in the trash) or ``purged``)."""

    name: str
    session_id: str
    seq: int
    trashed_at: datetime
    data: dict[str, Any]
    state: str = TRASHED
    history: list[dict[str, Any]] = field(default_factory=list)
    #: ``session`` (a whole session folder) or ``segments`` (expired sealed segments of a kept session).
    kind: str = "session"

    @property
    def purge_after(self) -> datetime:
        return datetime.fromisoformat(self.data["purge_after"])

    def as_dict(self) -> dict[str, Any]:
        return {"entry": self.name, "session_id": self.session_id, "state": self.state,
                "trashed_at": self.trashed_at.isoformat(), "purge_after": self.data["purge_after"],
                "rule": self.data["rule"], "reason": self.data["reason"], "bytes": self.data["bytes"],
                "log": self.data.get("log"), "policy": self.data["policy"], "ledger_seq": self.seq,
                "history": self.history, "kind": self.kind,
                **({"segments": [s["name"] for s in self.data["segments"]], "first_seq": self.data["first_seq"],
                    "last_seq": self.data["last_seq"]} if self.kind == "segments" else {})}


def fold(records: list[dict[str, Any]], path: Any) -> dict[str, Entry]:
    """The trash entries a ledger's records describe, by name. LedgerError for a record of an unknown type,
    without the keys its type needs, or naming an entry out of order."""
    entries: dict[str, Entry] = {}
    for rec in records:
        kind, data, seq = rec["type"], rec["data"], rec["seq"]
        need = LEDGER_TYPES.get(kind)
        if need is None:
            raise LedgerError(f"{path}: seq {seq} is a {kind!r} record, which is not a ledger record (allowed: "
                              f"{', '.join(LEDGER_TYPES)}); nothing was changed")
        if not isinstance(data, dict) or any(k not in data for k in need):
            raise LedgerError(f"{path}: seq {seq} ({kind}) lacks one of {', '.join(need)}; nothing was changed")
        name = data["entry"]
        if kind in (TRASHED, SEGMENTS_TRASHED):
            if name in entries or name != f"{data['session_id']}{ENTRY_SEP}{seq}":
                raise LedgerError(f"{path}: seq {seq} trashes entry {name!r}, which is not "
                                  f"'<session_id>{ENTRY_SEP}{seq}' or was used before; nothing was changed")
            entries[name] = Entry(name, data["session_id"], seq, datetime.fromisoformat(rec["ts"]), data,
                                  kind="segments" if kind == SEGMENTS_TRASHED else "session")
            continue
        entry = entries.get(name)
        if entry is None:
            raise LedgerError(f"{path}: seq {seq} ({kind}) names entry {name!r}, which no earlier record trashed; "
                              "nothing was changed")
        entry.state = CANCELLED if kind == SEGMENTS_CANCELLED else kind
        entry.history.append({"seq": seq, "type": kind, "ts": rec["ts"],
                              **{k: v for k, v in data.items() if k not in ("entry", "session_id")}})
    return entries


# -- segment expiry: the ``expired`` event (docs/format.md, "Event types") -----------------------------------
def find_entry(entries: dict[str, Entry], name: str, list_command: str) -> Entry:
    """The trash entry ``name`` names (an entry's name, or a session id with exactly one entry in the trash);
    ValueError naming the entries and ``list_command`` otherwise, or when the entry is not in the trash."""
    entry = entries.get(name)
    if entry is None:
        hits = [e for e in entries.values() if e.session_id == name and e.state in (TRASHED, RESTORE_CANCELLED)]
        if len(hits) == 1:
            return hits[0]
        listed = ", ".join(e.name for e in hits) or "none"
        raise ValueError(f"no trash entry {name!r} (entries of that session in the trash: {listed}); "
                         f"`{list_command}` shows them")
    if entry.state not in (TRASHED, RESTORE_CANCELLED):
        raise ValueError(f"trash entry {name!r} is not in the trash: it was {entry.state.replace('_', ' ')}")
    return entry


def purge_plan(entries: dict[str, Entry], names: list[str] | None, list_command: str, now: datetime, *,
               force: bool, reason: str) -> tuple[list[tuple[Entry, dict[str, Any], dict[str, Any]]], list[dict[str, Any]]]:
    """What a purge does (the file and the PostgreSQL trash alike): for each entry to delete, its ``purged``
    ledger record and its result row; and the entries refused (still within their grace period, no ``force``).
    ``names`` None: every entry in the trash; otherwise each as :func:`find_entry` resolves it."""
    if names is None:
        chosen = [e for e in entries.values() if e.state in (TRASHED, RESTORE_CANCELLED)]
    else:
        chosen = [find_entry(entries, n, list_command) for n in names]
    todo, refused = [], []
    for entry in chosen:
        due = purge_due(entry.trashed_at, entry.data.get("grace_days", 0), now)
        if not due and not force:
            refused.append({"entry": entry.name, "purge_after": entry.data["purge_after"],
                            "why": "within its grace period (give --force to purge it now)"})
            continue
        record = {"entry": entry.name, "session_id": entry.session_id, "forced": not due,
                  "reason": reason or ("grace period over" if due else "forced"),
                  "bytes": entry.data["bytes"], "log": entry.data["log"]}
        todo.append((entry, record, {"entry": entry.name, "session_id": entry.session_id,
                                     "bytes": entry.data["bytes"], "forced": not due}))
    return todo, refused


def expired_data(boundary: Any, now: Any, first_seq: int, last_seq: int, boundary_crc: str, *,
                 segments: list[dict[str, Any]], rule: str, reason: str, policy: dict[str, Any],
                 expired_at: str) -> dict[str, Any]:
    """The data of an ``expired`` record for the records ``first_seq..last_seq`` (``boundary_crc``: the ``crc``
    of the record at ``last_seq``, which the first surviving record names as its ``prev``). Carried messages
    whose keys are older than ``first_seq`` were carried by an earlier ``expired`` record (one that this range
    covers): they are carried again.

    ``boundary`` is the session's projection folded up to ``last_seq``, ``now`` the projection the record is
    appended to. Carried (kept in every view): the messages of the range that are the leading system prompt
    or pinned in ``now``. ``layout`` is ``boundary``'s history with each carried message by key and each run of
    other messages as one placeholder (``system`` or ``other``: what the system-prompt rule needs to fold the
    surviving records the same way). A message of ``boundary`` that ``now`` no longer holds (a record after
    ``last_seq`` redacted, erased or replaced it) gets a placeholder of its own naming its key (``named``), so
    that the record removing it removes the placeholder at the same point of a replay seeded from here."""
    from .projection import MAX_BATCH, make_key

    low, high = make_key(first_seq), make_key(last_seq, MAX_BATCH - 1)
    lead = now.leading_system_count()
    keys = list(now.keys)
    carried = [{"key": k, "message": now.messages[i]} for i, k in enumerate(keys)
               if 0 <= k <= high and (i < lead or k in now.pinned)]  # (with those an earlier expiry carried)
    wanted = {c["key"] for c in carried}
    still = set(keys)
    layout: list[dict[str, Any]] = []
    for k, m in zip(boundary.keys, boundary.messages):
        if k in wanted:
            layout.append({"key": k})
            continue
        run = "system" if m.get("role") == "system" else "other"
        if k not in still:
            layout.append({"run": run, "named": k})
        elif not layout or layout[-1].get("run") != run or "named" in layout[-1]:
            layout.append({"run": run})
    return {"first_seq": first_seq, "last_seq": last_seq, "boundary_crc": boundary_crc, "segments": segments,
            "carried": carried, "layout": layout, "pinned": sorted(boundary.pinned & wanted),
            "session": dict(boundary.session), "rule": rule, "reason": reason, "policy": policy,
            "expired_at": expired_at}


def fold_after_expiry(session_id: str, data: dict[str, Any], records: Any) -> Any:
    """The projection of a log that begins after an ``expired`` record's range: seeded from the record
    (:meth:`Projection.seeded`), then every later record folded, the chain checked from ``boundary_crc``
    (ValueError at the first record that does not follow). ``records`` must include the ``expired`` record."""
    from .codec import Links
    from .projection import Projection

    p = Projection.seeded(data)
    links = Links(session_id, data["boundary_crc"], True)
    expect = data["last_seq"] + 1
    for rec in records:
        if rec["seq"] <= data["last_seq"]:
            continue
        if rec["seq"] != expect:
            raise ValueError(f"seq {rec['seq']} follows the expired range ending at {data['last_seq']}; "
                             f"expected {expect}")
        problem = links.check(rec)
        if problem is not None:
            raise ValueError(f"record seq {rec['seq']} {problem}")
        p.apply(rec)
        expect += 1
    return p


__all__ = ["DEFAULT_GRACE_DAYS", "ENTRY_SEP", "Entry", "Expiry", "LEDGER_TYPES", "POLICY_KEYS", "Plan", "RULES",
           "RetentionPolicy", "SEGMENTS_CANCELLED", "SEGMENTS_TRASHED", "SEGMENT_RULES", "SegmentExpiry", "SegmentInfo",
           "SessionInfo", "expired_data", "find_entry", "fold", "fold_after_expiry", "plan", "plan_segments", "purge_due", "purge_plan"]
