"""Provider-reported usage (pure): a report made into a ``usage_reported`` event's data, and the fold of those
events into a usage ledger (tokens and cost per session, day or model; docs/tokens.md, docs/format.md).

A report is counted once: a record is in the log whole or not at all (a kill loses at most the report that
had not been written yet, never repeats one), a report that carries an ``id`` (the provider's response id)
is counted once per storage however often it was recorded, and a fork copies the history, not the usage
records (its ledger starts empty; the parent's reports stay the parent's).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any, Final

from .events import USAGE_REPORTED
from .values import Frozen, Value

#: Who recorded a report (the ``source`` of a ``usage_reported`` event).
SOURCES: Final = ("amplifier", "openai-agents", "agent-framework", "autogen", "pydantic-ai", "api")
#: The token fields of a report, each an int >= 0 or None (not reported).
TOKEN_FIELDS: Final = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")
#: How each field is spelled by the hosts we know (amplifier_core ``Usage``, OpenAI's chat completions,
#: Anthropic's messages API, Agent Framework's ``UsageDetails``), first match wins.
SPELLINGS: Final = {
    "input_tokens": ("input_tokens", "prompt_tokens", "input_token_count"),
    "output_tokens": ("output_tokens", "completion_tokens", "output_token_count"),
    "cache_read_tokens": ("cache_read_tokens", "cache_read_input_tokens", "cache_read_input_token_count"),
    "cache_write_tokens": ("cache_write_tokens", "cache_creation_input_tokens", "cache_creation_input_token_count"),
    "reasoning_tokens": ("reasoning_tokens", "reasoning_output_token_count"),
}
#: How a usage ledger groups its rows.
GROUPS: Final = ("session", "day", "model")


#: ``name=`` where a field of a usage text may start: at the start, or after spaces or a comma.
_FIELD = re.compile(r"(?:^|[\s,]+)([A-Za-z_][A-Za-z0-9_]*)=")
_DECIMAL = re.compile(r"""Decimal\((['"])([^'"]*)\1\)""")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: Far more than any usage text a host sends: a longer one, or one with more fields, is refused unparsed.
MAX_USAGE_TEXT = 16_384
MAX_USAGE_FIELDS = 100
_CLOSERS = {"'": "'", '"': '"', "[": "]", "{": "}", "(": ")"}


def _literal(text: str) -> tuple[bool, Any]:
    """(parsed, value) of one field's value as Python prints it: None, True/False, a number, a quoted string,
    ``Decimal('0.01')``, nan/inf, or a list/dict of literals."""
    text = text.strip()
    if text in _NON_FINITE:
        return True, _NON_FINITE[text]
    m = _DECIMAL.fullmatch(text)
    if m:
        try:
            return True, Decimal(m.group(2))
        except ArithmeticError:
            return False, None
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def parse_usage_text(text: str) -> dict[str, Any]:
    """A usage report given as text: the ``str()`` of a pydantic model (``'input_tokens=876 output_tokens=28
    reasoning_tokens=None cost_usd=Decimal('0.01')'``, as amplifier-core 2.0.2's hook registry hands
    ``provider:response`` handlers the ``Usage``), its ``repr()`` (``Usage(input_tokens=876, ...)``) or a JSON
    object. A value Python's printing cannot be read back from (``<object at 0x...>``) is kept as its text, so
    a token field holding one is refused by the checks that follow; ValueError for text that is not fields."""
    s = text.strip()
    if len(s) > MAX_USAGE_TEXT:
        raise ValueError(f"usage text is {len(s):,} characters; a report is at most {MAX_USAGE_TEXT:,}")
    if s.startswith("{"):
        try:
            doc = json.loads(s)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            return doc
    wrapped = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\((.*)\)", s, re.S)
    if wrapped:
        s = wrapped.group(1).strip()
    found = list(_FIELD.finditer(s))
    if not found or found[0].start() != 0:
        raise ValueError(f"usage text must be name=value fields (as 'input_tokens=876 output_tokens=28 "
                         f"cost_usd=None'), got {text[:80]!r}")
    if len(found) > MAX_USAGE_FIELDS:
        raise ValueError(f"usage text has {len(found)} name=value fields; a report has at most {MAX_USAGE_FIELDS}")
    ends = [f.start() for f in found[1:]] + [len(s)]
    out: dict[str, Any] = {}
    i = 0
    while i < len(found):
        start = found[i].end()
        value: Any = s[start:ends[i]].strip()
        j = i + 1
        closer = _CLOSERS.get(value[:1])
        # A quoted or bracketed value may hold ' name=': it ends at the first later field boundary where it
        # closes and reads back. Any other value ends at the next field.
        for k in range(i, len(found) if closer else i + 1):
            piece = s[start:ends[k]].strip()
            if closer and not piece.endswith(closer):
                continue
            ok, parsed = _literal(piece)
            if ok:
                value, j = parsed, k + 1
                break
        out[found[i].group(1)] = value  # (what does not read back stays text: checked as such below)
        i = j
    return out


def as_mapping(usage: Any) -> Mapping[str, Any]:
    """A report as a mapping: a Mapping as it is, a text by :func:`parse_usage_text`, a pydantic model by
    ``model_dump()``, another object by its attributes. TypeError for anything else."""
    if isinstance(usage, Mapping):
        return usage
    if isinstance(usage, str):
        return parse_usage_text(usage)
    dump = getattr(usage, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dumped
    names = {n for spellings in SPELLINGS.values() for n in spellings} | {"cost_usd", "total_tokens"}
    found = {n: getattr(usage, n) for n in names if getattr(usage, n, None) is not None}
    if not found:
        raise TypeError(f"usage must be a mapping or an object with token fields (input_tokens/prompt_tokens, "
                        f"output_tokens/completion_tokens, ...), got {type(usage).__name__}")
    return found


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise ValueError(f"usage {name} must be a non-negative integer or None, got {value!r}")
    if isinstance(value, (float, Decimal)):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"usage {name} must be a non-negative integer or None, got {value!r}")
        value = int(value)
    if value < 0:
        raise ValueError(f"usage {name} must be a non-negative integer or None, got {value!r}")
    return int(value)


def _text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
    return value


def usage_data(usage: Any, *, provider: str | None = None, model: str | None = None, request_seq: int | None = None,
               estimated_tokens: int | None = None, source: str = "api", id: str | None = None,
               input_includes_cache: bool | None = None) -> dict[str, Any]:
    """The ``usage_reported`` event data for one report (docs/format.md). ValueError says which value is wrong
    and what is allowed (negative or non-integer tokens, a negative cost, an unknown source)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {source!r}")
    m = as_mapping(usage)
    data: dict[str, Any] = {"provider": _text("provider", provider), "model": _text("model", model or m.get("model"))}
    reported = False
    for name, spellings in SPELLINGS.items():
        value = None
        for spelling in spellings:
            value = m.get(spelling)
            if value is not None:
                break
        # (a plain non-negative int, the usual case, needs no checks: this runs on every provider response)
        data[name] = value if type(value) is int and value >= 0 else _count(name, value)
        reported = reported or value is not None
    if not reported:
        raise ValueError(f"usage reports no tokens: none of {', '.join(s for v in SPELLINGS.values() for s in v)} "
                         f"in {sorted(m)!r}")
    cost = m.get("cost_usd")
    if isinstance(cost, str):  # (amplifier_core's Usage dumps its Decimal cost as text)
        try:
            cost = Decimal(cost)
        except ArithmeticError:
            raise ValueError(f"usage cost_usd must be a non-negative number or None, got {cost!r}") from None
    if cost is not None:
        if isinstance(cost, bool) or not isinstance(cost, (int, float, Decimal)) or not math.isfinite(cost) \
                or cost < 0:
            raise ValueError(f"usage cost_usd must be a non-negative number or None, got {cost!r}")
        cost = float(cost)
    data["cost_usd"] = cost
    data["request_seq"] = _count("request_seq", request_seq)
    data["estimated_tokens"] = _count("estimated_tokens", estimated_tokens)
    data["source"] = source
    data["id"] = _text("id", id)
    if input_includes_cache is not None and not isinstance(input_includes_cache, bool):
        raise ValueError(f"input_includes_cache must be true, false or None, got {input_includes_cache!r}")
    data["input_includes_cache"] = input_includes_cache
    return data


def _looks_like(data: Mapping[str, Any], *words: str) -> bool:
    text = f"{data.get('provider') or ''} {data.get('model') or ''}".lower()
    return any(w in text for w in words)


def input_includes_cache(data: Mapping[str, Any]) -> bool:
    """Whether a report's ``input_tokens`` already include its cached tokens: as the recorder said, else
    OpenAI's convention for OpenAI-like providers (cached tokens are part of ``prompt_tokens``), else
    Anthropic's (``input_tokens`` are the uncached part): for an unknown provider the request is then counted
    as input + cache read + cache write, which over-counts rather than under-counts."""
    said = data.get("input_includes_cache")
    if isinstance(said, bool):
        return said
    return _looks_like(data, "openai", "azure", "gpt", "o1", "o3", "o4") and not _looks_like(data, "claude",
                                                                                               "anthropic")


def request_tokens(data: Mapping[str, Any]) -> int | None:
    """The provider's count of the request a report answers (None when it reported no input)."""
    n = data.get("input_tokens")
    if n is None:
        return None
    if input_includes_cache(data):
        return int(n)
    return int(n) + int(data.get("cache_read_tokens") or 0) + int(data.get("cache_write_tokens") or 0)


# -- prices ------------------------------------------------------------------------------------------------------
PRICE_FIELDS: Final = ("input", "output", "cache_read", "cache_write")


class Prices(Frozen):
    """A user's price table: USD per million tokens per model name or ``fnmatch`` pattern (docs/tokens.md,
    "Prices"). The package ships none: prices change, and a stale built-in table would be silently wrong."""

    __slots__ = ("models",)
    models: dict[str, dict[str, float]]

    def __init__(self, models: dict[str, dict[str, float]]) -> None:
        object.__setattr__(self, "models", models)

    @classmethod
    def from_json(cls, doc: Any, where: str = "prices") -> "Prices":
        """From the parsed price file; ValueError says what is wrong and what the format is."""
        fmt = ('{"models": {"claude-sonnet-4-5": {"input": 3.0, "output": 15.0, "cache_read": 0.3, '
               '"cache_write": 3.75}, "gpt-4o*": {...}}} (USD per million tokens)')
        if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict) or set(doc) - {"models", "note"}:
            raise ValueError(f"{where}: expected {fmt}")
        models: dict[str, dict[str, float]] = {}
        for name, row in doc["models"].items():
            if not isinstance(row, dict) or not row or set(row) - set(PRICE_FIELDS):
                raise ValueError(f"{where}: model {name!r} needs some of {', '.join(PRICE_FIELDS)}; expected {fmt}")
            for k, v in row.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"{where}: {name}.{k} must be a non-negative number (USD per million "
                                     f"tokens), got {v!r}")
            models[str(name)] = {k: float(v) for k, v in row.items()}
        return cls(models)

    def row_for(self, model: str | None) -> dict[str, float] | None:
        """The prices of ``model``: its exact name, else the longest pattern that matches it."""
        if model is None:
            return None
        if model in self.models:
            return self.models[model]
        matching = [p for p in self.models if fnmatch.fnmatchcase(model, p)]
        return self.models[max(matching, key=len)] if matching else None

    def cost(self, data: Mapping[str, Any]) -> float | None:
        """The cost of a report by this table (None: its model is not in the table, or a price it needs is)."""
        row = self.row_for(data.get("model"))
        if row is None:
            return None
        inp, cr, cw = (int(data.get(k) or 0) for k in ("input_tokens", "cache_read_tokens", "cache_write_tokens"))
        if input_includes_cache(data):
            inp = max(0, inp - cr - cw)
        parts = {"input": inp, "output": int(data.get("output_tokens") or 0), "cache_read": cr, "cache_write": cw}
        total = 0.0
        for k, n in parts.items():
            if n:
                price = row.get(k, row.get("input") if k.startswith("cache") else None)
                if price is None:
                    return None
                total += n * price / 1_000_000
        return total


# -- the ledger ----------------------------------------------------------------------------------------------------
class Totals(Value):
    """The sums of a group of reports. ``cost_usd`` sums the known costs; ``uncosted`` counts the reports whose
    cost is unknown (no ``cost_usd`` reported and no price for their model)."""

    __slots__ = ("reports", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                 "reasoning_tokens", "cost_usd", "cost_reported", "cost_priced", "uncosted")

    def __init__(self, reports: int = 0, input_tokens: int = 0, output_tokens: int = 0, cache_read_tokens: int = 0,
                 cache_write_tokens: int = 0, reasoning_tokens: int = 0, cost_usd: float = 0.0, cost_reported: int = 0,
                 cost_priced: int = 0, uncosted: int = 0) -> None:
        self.reports = reports
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cache_read_tokens = cache_read_tokens
        self.cache_write_tokens = cache_write_tokens
        self.reasoning_tokens = reasoning_tokens
        self.cost_usd = cost_usd
        self.cost_reported = cost_reported
        self.cost_priced = cost_priced
        self.uncosted = uncosted

    def add(self, data: Mapping[str, Any], priced: float | None) -> None:
        self.reports += 1
        for name in TOKEN_FIELDS:
            setattr(self, name, getattr(self, name) + int(data.get(name) or 0))
        if data.get("cost_usd") is not None:
            self.cost_usd += float(data["cost_usd"])
            self.cost_reported += 1
        elif priced is not None:
            self.cost_usd += priced
            self.cost_priced += 1
        else:
            self.uncosted += 1

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["cost_usd"] = round(self.cost_usd, 10) if self.reports - self.uncosted else None
        return out


class UsageLedger(Value):
    """The fold of ``usage_reported`` records into totals grouped ``by`` session, day (UTC, from the record's
    ``ts``) or model; ``since`` (an ISO date or time) leaves out older records. Apply records with
    :meth:`apply`, in any order of sessions; a report with an ``id`` already counted is skipped."""

    __slots__ = ("by", "since", "prices", "groups", "total", "sessions", "skipped_duplicates", "_ids")

    def __init__(self, by: str = "session", since: str | None = None, prices: Prices | None = None) -> None:
        if by not in GROUPS:
            raise ValueError(f"by must be one of {', '.join(GROUPS)}; got {by!r}")
        self.by = by
        self.since = since
        self.prices = prices
        self.groups: dict[str, Totals] = {}
        self.total = Totals()
        self.sessions: set[str] = set()
        self.skipped_duplicates = 0
        self._ids: set[tuple[Any, str]] = set()  # (the report ids counted)

    def apply(self, session_id: str, rec: Mapping[str, Any]) -> bool:
        """Fold one record (others than ``usage_reported`` are ignored); True if it was counted."""
        if rec.get("type") != USAGE_REPORTED:
            return False
        data = rec.get("data")
        ts = str(rec.get("ts") or "")
        if not isinstance(data, Mapping) or (self.since is not None and ts < self.since):
            return False
        rid = data.get("id")
        if isinstance(rid, str):
            key = (data.get("provider"), rid)
            if key in self._ids:
                self.skipped_duplicates += 1
                return False
            self._ids.add(key)
        group = session_id if self.by == "session" else ts[:10] if self.by == "day" else str(data.get("model"))
        priced = self.prices.cost(data) if self.prices is not None and data.get("cost_usd") is None else None
        self.groups.setdefault(group, Totals()).add(data, priced)
        self.total.add(data, priced)
        self.sessions.add(session_id)
        return True

    def apply_all(self, session_id: str, records: Iterable[Mapping[str, Any]]) -> None:
        for rec in records:
            self.apply(session_id, rec)

    def rows(self) -> list[dict[str, Any]]:
        """One row per group, in order of the group's name."""
        return [{self.by: g, **t.as_dict()} for g, t in sorted(self.groups.items())]
