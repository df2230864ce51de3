"""Secrets that never reach disk: a scanner run on every message before its record is written (opt-in).

Configured with the ``secret_scanner`` key (docs/configuration.md, docs/operations.md "Secrets"):

- ``"builtin"``: the built-in patterns (:data:`BUILTIN_PATTERNS`);
- a list whose items are ``"builtin"`` or extra patterns, ``{"name": KIND, "pattern": REGEX}`` (or a bare
  regex string, kind ``custom``): the built-in patterns plus those;
- a callable ``scan(text) -> iterable of (start, end, kind)`` (API only): the built-in patterns plus what it
  finds; or a :class:`SecretScanner` built by hand (used as it is).

Every string value of a message (not its keys) is scanned; each match is replaced by ``[secret:KIND]``. A
pattern with a group named ``secret`` replaces only that group (``Bearer [secret:bearer_token]``). The record
gets ``"secrets": [{"kind", "count"}]`` next to the message (with ``"index"`` for a list of messages): what
was removed, never the secret.

Cost: off, one ``is None`` test per append. On with the built-in patterns only, a few ``bytes.find`` of the
message's JSON for the fixed strings the patterns need (``AKIA``, ``-----BEGIN``, ``ghp_``, ``sk-``, ``eyJ``,
``earer`` …, :data:`BUILTIN_LITERALS`); only a message holding one is walked, and in it each built-in pattern
runs only on strings holding one of its fixed strings. With extra patterns or a callable, every string is
walked and matched against those (a custom regex cannot be reduced to fixed strings safely).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from . import codec

#: The built-in patterns: kind -> regex (a group named ``secret`` limits what is replaced).
BUILTIN_PATTERNS: dict[str, str] = {
    "aws_access_key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    # PEM private keys and PGP private key blocks (cut short: up to the end of the text).
    "private_key": (r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
                    r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)"),
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
    "gitlab_token": r"\bglpat-[A-Za-z0-9_\-]{20,}",
    "slack_token": r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",
    "anthropic_api_key": r"\bsk-ant-[A-Za-z0-9_\-]{20,}",
    "openai_api_key": r"\bsk-(?!ant-)(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}",
    # Linear time: a header never runs over a "-eyJ" (where another match could start) and its quantifiers are
    # possessive, so each character is scanned from one start at most. (A greedy header scanned to the end of
    # every "eyJab-eyJab-..." run from each of its starts: quadratic, minutes of a stalled loop for 1 MB.) A
    # header holding "-eyJ" is matched from its last one: what is left before it is part of the header, never
    # of the payload or the signature.
    "jwt": r"\beyJ(?:[A-Za-z0-9_]|-(?!eyJ)){5,}+\.eyJ[A-Za-z0-9_\-]{5,}+\.[A-Za-z0-9_\-]{5,}",
    "bearer_token": r"(?i:\bbearer)\s+(?P<secret>[A-Za-z0-9\-._~+/]{16,}=*)",
}

#: Fixed strings one of which every match of a built-in pattern contains: a pattern is only run on a text
#: holding one of its strings, and with the built-in patterns alone, a message whose JSON holds none of them
#: is not walked at all (``str.find`` and ``bytes.find`` are far cheaper than a regex scan).
BUILTIN_LITERALS: dict[str, tuple[str, ...]] = {
    "aws_access_key": ("AKIA", "ASIA"),
    "private_key": ("-----BEGIN",),
    "github_token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    "gitlab_token": ("glpat-",),
    "slack_token": ("xox",),
    "anthropic_api_key": ("sk-ant-",),
    "openai_api_key": ("sk-",),
    "jwt": ("eyJ",),
    "bearer_token": ("earer", "EARER"),  # (Bearer, bearer, BEARER)
}
_ALL_LITERALS = tuple(sorted({lit.encode() for lits in BUILTIN_LITERALS.values() for lit in lits}))

_KIND = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

Finder = Callable[[str], Iterable[tuple[int, int, str]]]


class SecretScanner:
    """Finds secrets in text and redacts them in messages.

    ``patterns``: kind -> regex (string or compiled). ``finder``: an extra ``finder(text) -> (start, end,
    kind)`` spans. ``prefilter``: byte strings one of which the JSON of every message holding a match
    contains (None: walk every message). ``literals``: kind -> strings one of which every match of that
    pattern contains (a pattern without: run on every string).
    """

    def __init__(self, patterns: dict[str, Any], finder: Finder | None = None,
                 prefilter: tuple[bytes, ...] | None = None,
                 literals: dict[str, tuple[str, ...]] | None = None) -> None:
        lits = literals or {}
        self.patterns = [(kind, re.compile(p) if isinstance(p, str) else p, lits.get(kind))
                         for kind, p in patterns.items()]
        self.finder = finder
        self.prefilter = prefilter

    def find(self, text: str) -> list[tuple[int, int, str]]:
        """The spans to redact in ``text``, sorted, overlaps merged (the earliest match's kind wins)."""
        spans: list[tuple[int, int, str]] = []
        for kind, rx, lits in self.patterns:
            if lits is not None and not any(lit in text for lit in lits):
                continue
            for m in rx.finditer(text):
                if "secret" in rx.groupindex and m.group("secret") is not None:
                    spans.append((m.start("secret"), m.end("secret"), kind))
                elif m.end() > m.start():
                    spans.append((m.start(), m.end(), kind))
        if self.finder is not None:
            for start, end, kind in self.finder(text):
                if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(text)):
                    raise ValueError(f"the secret scanner returned the span ({start!r}, {end!r}) for a text of "
                                     f"{len(text)} characters; spans are (start, end, kind) with 0 <= start < end")
                spans.append((start, end, str(kind)))
        if not spans:
            return spans
        spans.sort(key=lambda s: (s[0], -s[1]))
        merged = [spans[0]]
        for start, end, kind in spans[1:]:
            last = merged[-1]
            if start < last[1]:
                if end > last[1]:
                    merged[-1] = (last[0], end, last[2])
            else:
                merged.append((start, end, kind))
        return merged

    def redact_text(self, text: str, counts: dict[str, int]) -> str:
        spans = self.find(text)
        if not spans:
            return text
        out = []
        pos = 0
        for start, end, kind in spans:
            out.append(text[pos:start])
            out.append(f"[secret:{kind}]")
            counts[kind] = counts.get(kind, 0) + 1
            pos = end
        out.append(text[pos:])
        return "".join(out)

    def _walk(self, value: Any, counts: dict[str, int]) -> Any:
        if isinstance(value, str):
            return self.redact_text(value, counts)
        if isinstance(value, dict):
            return {k: self._walk(v, counts) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, counts) for v in value]
        return value

    def redact(self, message: dict[str, Any], encoded: bytes) -> tuple[dict[str, Any], bytes, list[dict[str, Any]]] | None:
        """``(redacted message, its JSON, [{"kind", "count"}])`` if ``message`` (JSON ``encoded``) holds a
        secret, else None (the message is stored as it is)."""
        if self.prefilter is not None and not any(encoded.find(lit) >= 0 for lit in self.prefilter):
            return None
        counts: dict[str, int] = {}
        clean = self._walk(message, counts)
        if not counts:
            return None
        return clean, codec.dumps(clean), [{"kind": k, "count": n} for k, n in counts.items()]


def make_scanner(value: Any) -> SecretScanner | None:
    """The scanner a ``secret_scanner`` setting describes (None: off); ValueError says what is allowed."""
    if value is None or value is False:
        return None
    if isinstance(value, SecretScanner):
        return value
    allowed = ("secret_scanner must be null, \"builtin\", a list of \"builtin\" and {\"name\": KIND, \"pattern\": "
               "REGEX} items (or regex strings), a callable text -> [(start, end, kind)], or a SecretScanner")
    if value == "builtin":
        return SecretScanner(BUILTIN_PATTERNS, prefilter=_ALL_LITERALS, literals=BUILTIN_LITERALS)
    if callable(value):
        return SecretScanner(BUILTIN_PATTERNS, finder=value, literals=BUILTIN_LITERALS)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{allowed}; got {value!r}")
    patterns: dict[str, Any] = dict(BUILTIN_PATTERNS)
    extra = bare = 0
    for i, item in enumerate(value):
        if item == "builtin":
            continue
        if isinstance(item, str):
            bare += 1
            name, pattern = "custom" if bare == 1 else f"custom{bare}", item
        elif isinstance(item, dict) and set(item) == {"name", "pattern"} and isinstance(item["pattern"], str):
            name, pattern = item["name"], item["pattern"]
            if not isinstance(name, str) or not _KIND.match(name):
                raise ValueError(f"secret_scanner[{i}]: name must be 1-64 letters, digits, '_', '.' or '-'; "
                                 f"got {name!r}")
        else:
            raise ValueError(f"secret_scanner[{i}] is {item!r}; {allowed}")
        try:
            patterns[name] = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"secret_scanner[{i}]: {pattern!r} is not a valid regular expression: {e}") from None
        if patterns[name].search(""):
            raise ValueError(f"secret_scanner[{i}]: {pattern!r} matches the empty string")
        extra += 1
    return SecretScanner(patterns, prefilter=_ALL_LITERALS if not extra else None, literals=BUILTIN_LITERALS)


def redact_messages(scanner: SecretScanner, messages: list[dict[str, Any]], parts: list[bytes]
                    ) -> tuple[list[dict[str, Any]], list[bytes], list[dict[str, Any]]]:
    """Redact a list of messages (their JSON ``parts``): ``(messages, parts, [{"index", "kind", "count"}])``."""
    found: list[dict[str, Any]] = []
    out_m, out_p = list(messages), list(parts)
    for i, (m, p) in enumerate(zip(messages, parts)):
        hit = scanner.redact(m, p)
        if hit is not None:
            out_m[i], out_p[i] = hit[0], hit[1]
            found.extend({"index": i, **k} for k in hit[2])
    return out_m, out_p, found


__all__ = ["BUILTIN_PATTERNS", "SecretScanner", "make_scanner", "redact_messages"]
