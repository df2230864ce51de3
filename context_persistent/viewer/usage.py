"""Provider-reported usage for the token chart: the session's ``usage_reported`` events (the usage ledger's
records, docs/tokens.md), kept packed as the log is read, and the viewer's :class:`UsageProvider` over them.

Each report is five integers (its seq, the seq of the request it answers, the provider's count of that
request, the store's estimate of it, the output tokens): 40 bytes a report, whatever the session's length.
They are read in the same pass over the log as the notable events (timeline.py's index), so a session's
log is read once for both, then only what was appended. A chart gets at most ``limit`` of them: on a session
with more reports, the reports are split into ``limit`` runs of consecutive ones and each run is drawn as
its largest request, with how many reports the run holds.

A report is counted once, as the ledger counts it: a report whose ``id`` (with its provider) was seen
before in the session is skipped.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Mapping
from typing import Any

from ..model import events as ev
from ..model.usage import request_tokens

#: Reports one chart answer holds at most.
USAGE_POINTS = 600
_NONE = -1


class UsageSeries:
    """The usage reports of one session, in log order (so sorted by seq), packed."""

    __slots__ = ("seq", "request_seq", "input", "estimated", "output", "duplicate_seqs", "_ids")

    def __init__(self) -> None:
        self.seq, self.request_seq = array("q"), array("q")
        self.input, self.estimated, self.output = array("q"), array("q"), array("q")
        #: The seqs of the reports skipped as seen before (they are records all the same: time travel counts them).
        self.duplicate_seqs = array("q")
        self._ids: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.seq)

    def note(self, rec: Mapping[str, Any]) -> bool:
        """Add one ``usage_reported`` record (others are ignored); True if it was added."""
        data = rec.get("data")
        if rec.get("type") != ev.USAGE_REPORTED or not isinstance(data, Mapping):
            return False
        rid = data.get("id")
        if isinstance(rid, str):
            digest = hashlib.blake2b(f"{data.get('provider')}\x00{rid}".encode(), digest_size=12).digest()
            if digest in self._ids:
                self.duplicate_seqs.append(int(rec["seq"]))
                return False
            self._ids.add(digest)
        seq = int(rec["seq"])
        asked = data.get("request_seq")
        self.seq.append(seq)
        self.request_seq.append(asked if type(asked) is int and 0 <= asked <= seq else seq)
        self.input.append(_or_none(request_tokens(data)))
        self.estimated.append(_or_none(data.get("estimated_tokens")))
        self.output.append(_or_none(data.get("output_tokens")))
        return True

    @property
    def duplicates(self) -> int:
        return len(self.duplicate_seqs)

    def records_between(self, after: int, upto: int) -> int:
        """How many ``usage_reported`` records (skipped duplicates too) have a seq in ``after+1..upto``."""
        return sum(bisect.bisect_right(a, upto) - bisect.bisect_right(a, after) for a in (self.seq, self.duplicate_seqs))

    def upto(self, at_seq: int | None) -> int:
        """How many reports were made at or before ``at_seq`` (all of them when None)."""
        return len(self.seq) if at_seq is None else bisect.bisect_right(self.seq, at_seq)

    def entry(self, i: int, reports: int = 1) -> dict[str, Any]:
        return {"seq": self.seq[i], "request_seq": self.request_seq[i], "input_tokens": _value(self.input[i]),
                "estimated_tokens": _value(self.estimated[i]), "output_tokens": _value(self.output[i]),
                "reports": reports}

    def select(self, at_seq: int | None, limit: int) -> list[dict[str, Any]]:
        """The reports made at or before ``at_seq``, oldest first; when there are more than ``limit``, one
        entry per run of consecutive reports: its largest request, with ``reports`` the run's length."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        n = self.upto(at_seq)
        if n <= limit:
            return [self.entry(i) for i in range(n)]
        out = []
        for k in range(limit):
            lo, hi = k * n // limit, (k + 1) * n // limit
            run = self.input[lo:hi]
            best = lo + max(range(hi - lo), key=run.__getitem__)
            out.append(self.entry(best, hi - lo))
        return out


def _or_none(value: Any) -> int:
    return value if type(value) is int and value >= 0 else _NONE


def _value(v: int) -> int | None:
    return None if v == _NONE else v


def thin(reports: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` of a provider's reports, as :meth:`UsageSeries.select` thins them (for a provider
    that returned more than it was asked for)."""
    n = len(reports)
    if n <= limit:
        return reports
    out = []
    for k in range(limit):
        run = reports[k * n // limit:(k + 1) * n // limit]
        best = max(run, key=lambda r: r.get("input_tokens") or 0)
        out.append({**best, "reports": sum(int(r.get("reports") or 1) for r in run)})
    return out


class LogUsage:
    """The viewer's usage provider: the session's own ``usage_reported`` records (what ``read_usage`` and
    the ``usage`` command sum), read through the viewer's index of notable events (timeline.MarkIndex)."""

    def __init__(self, source: Any, index: Any) -> None:
        self.source = source
        self.index = index

    async def usage(self, session_id: str, *, at_seq: int | None, limit: int = USAGE_POINTS) -> list[dict[str, Any]]:
        marks = await self.index.of(self.source, session_id)
        return marks.usage.select(at_seq, limit)


__all__ = ["USAGE_POINTS", "LogUsage", "UsageSeries", "thin"]
