"""What verify and repair return (repair.py, verify.py): the findings (``Problem``, ``Gap``), verify's
``Report`` and repair's ``RepairResult``, and the names of the side files they leave in a session folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..model import events as ev
from ..storage.paths import LOG_NAME
from .semantic import Finding

#: The audit event repair appends to a log it rebuilt (the projection ignores it).
REPAIRED = ev.LOG_REPAIRED
QUARANTINE_PREFIX = LOG_NAME + ".quarantine-"
TORN_PREFIX = LOG_NAME + ".torn-"


@dataclass
class Problem:
    """One finding: ``kind`` (corrupt, torn, seq, link, session, unloadable, segment), where it is (line and
    byte offset in the whole log: global positions for a segmented log), and why."""

    kind: str
    line: int
    offset: int
    length: int
    reason: str
    seq: int | None = None
    #: What these bytes held that the history loses without them (seqs, event type, message), as far as
    #: can be told; None for a problem that removes nothing (an unloadable record is kept).
    lost: str | None = None

    def describe(self) -> str:
        what = {"corrupt": "corrupt record", "torn": "torn tail", "seq": "out-of-order record",
                "unloadable": "unloadable record", "link": "foreign record", "session": "foreign log",
                "segment": "damaged sealed segment"}[self.kind]
        text = f"{what} at line {self.line} (byte offset {self.offset}, {self.length} bytes): {self.reason}"
        return text + (f"; {self.lost}" if self.lost else "")


@dataclass
class Gap:
    """Seqs ``after_seq + 1 .. next_seq - 1`` are missing; ``explained`` if a repair recorded it."""

    after_seq: int
    next_seq: int
    explained: bool = False
    #: Bad bytes sit where the missing seqs were: the gap is that corruption, already reported as a problem.
    corrupt: bool = False


@dataclass
class Report:
    """What verify found in one session (``ok`` means exit code 0)."""

    session_id: str
    path: str
    size: int
    records: int = 0
    first_seq: int = 0
    last_seq: int = 0
    problems: list[Problem] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)
    writer_pid: int | None = None
    #: Semantic findings on the history the log folds into (semantic.py): tool-call pairing and order.
    semantic: list[Finding] = field(default_factory=list)
    #: The sealed segments' files, in order (empty for a single-file log); each was checked (check_segments).
    segments: list[str] = field(default_factory=list)
    #: When the oldest segments expired (segment retention): ``{last_seq, expired_seq, start}``, else None.
    expired: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return (not self.problems and all(g.explained or g.corrupt for g in self.gaps)
                and self.checkpoint.get("ok", True) and not any(f.problem for f in self.semantic))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class RepairResult:
    """What repair did; ``changed`` is False when the log needed nothing."""

    session_id: str
    path: str
    changed: bool
    kept: int
    quarantined: list[Problem]
    quarantine_file: str | None
    gaps: list[Gap]
    checkpoint_removed: bool
    old_size: int
    new_size: int
    audit_seq: int | None
    unfixable: list[Problem]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
