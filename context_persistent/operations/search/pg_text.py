"""The text side of the PostgreSQL index (pure: no I/O): words, ``tsvector`` and ``tsquery`` literals, snippets.

Both sides are made here, in Python, so that a document and a query are cut into words by one rule and the
server's parser never gets a say (docs/search.md, "PostgreSQL"): a word is a run of letters and digits
(``[^\\W_]+``), lower-cased and without diacritics (``résumé`` → ``resume``), and each Chinese, Japanese or
Korean character is a word of its own, as in the SQLite index. The ``tsvector`` is sent as a literal
(``'word':1,7 'bash':9A``: the ``tools`` column's words carry weight A, so ``tools:bash`` is ``'bash':A``);
the query, parsed with SQLite FTS5's grammar (text.py), becomes a ``tsquery`` literal. PostgreSQL's limits are
kept here, visibly: positions stop at 16,383, a word keeps at most 256 positions, a word longer than 2,047
bytes is left out (as ``to_tsvector`` would), and a document's vector stays under 1 MB (the words after that
point are not indexed; its text is still stored).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from .text import COLUMNS, MARK_CLOSE, MARK_OPEN, QueryError, cjk, query_patterns, translate

_WORD = re.compile(r"[^\W_]+")
MAX_POS = 16383
MAX_POSITIONS = 256
MAX_LEXEME = 2047
MAX_VECTOR = 900_000  # bytes of the literal's words and positions: under PostgreSQL's 1 MB per tsvector


def _fold(word: str) -> str:
    word = word.lower()
    if word.isascii():
        return word
    stripped = "".join(c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c))
    return unicodedata.normalize("NFC", stripped)


def spans(text: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, word)`` of every word of ``text``, folded; CJK characters one word each."""
    for m in _WORD.finditer(text):
        run = m.group()
        if run.isascii() or cjk().search(run) is None:
            yield m.start(), m.end(), _fold(run)
            continue
        base, at = m.start(), 0
        for c in cjk().finditer(run):
            if c.start() > at:
                yield base + at, base + c.start(), _fold(run[at:c.start()])
            yield base + c.start(), base + c.end(), c.group()
            at = c.end()
        if at < len(run):
            yield base + at, base + len(run), _fold(run[at:])


def words(text: str) -> list[str]:
    return [w for _, _, w in spans(text)]


def _quote(word: str) -> str:
    return "'" + word.replace("\\", "\\\\").replace("'", "''") + "'"


def vector(body: str, tools: str) -> str:
    """The ``tsvector`` literal of a document: ``body``'s words (weight D), then ``tools``' (weight A)."""
    positions: dict[tuple[str, str], list[int]] = {}
    size = 0
    pos = 0
    for column, weight in ((body, ""), (tools, "A")):
        pos += 1  # (a gap: a phrase never runs from one column into the other)
        for word in words(column):
            pos += 1
            if len(word.encode()) > MAX_LEXEME:
                continue
            at = positions.get((word, weight))
            if at is None:
                size += len(word) + 8
                if size > MAX_VECTOR:
                    break
                at = positions[(word, weight)] = []
            if len(at) < MAX_POSITIONS:
                at.append(min(pos, MAX_POS))
                size += 2
    by_word: dict[str, list[str]] = {}
    for (word, weight), at in positions.items():
        by_word.setdefault(word, []).extend(f"{p}{weight}" for p in dict.fromkeys(at))
    return " ".join(f"{_quote(w)}:{','.join(ps)}" for w, ps in by_word.items())


# -- queries --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Term:
    """Words in a row (a phrase when more than one), the last one a prefix when ``prefix``, in ``weights``."""

    words: tuple[str, ...]
    prefix: bool = False
    weights: str = ""


#: A query that can match nothing (a word made of punctuation only, as ``""`` in FTS5).
NOTHING = ("nothing",)


class _Parser:
    """SQLite FTS5's query grammar (NOT binds tighter than AND, AND than OR; implicit AND between terms)."""

    def __init__(self, query: str) -> None:
        translate(query)  # (the same checks and errors as the SQLite index: length, NUL, quotes, columns)
        self.query = query
        self.toks = query_patterns()[0].findall(query)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def fail(self, why: str) -> QueryError:
        return QueryError(f"bad query {self.query!r}: {why} (docs/search.md, 'Query language')")

    def parse(self) -> tuple:
        node = self.or_()
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.peek()!r}")
        return node

    def or_(self) -> tuple:
        node = self.and_()
        while self.peek() == "OR":
            self.take()
            node = ("or", node, self.and_())
        return node

    def and_(self) -> tuple:
        node = self.not_()
        while True:
            tok = self.peek()
            if tok == "AND":
                self.take()
            elif tok is None or tok in ("OR", ")", ","):
                return node
            node = ("and", node, self.not_())

    def not_(self) -> tuple:
        node = self.primary()
        while self.peek() == "NOT":
            self.take()
            node = ("not", node, self.primary())
        return node

    def primary(self, weights: str = "") -> tuple:
        tok = self.peek()
        if tok is None or tok in ("AND", "OR", "NOT", ")", ","):
            raise self.fail("an operator with nothing on one side" if tok else "it ends where a word is expected")
        self.take()
        if tok == "(":
            node = self.or_()
            if self.peek() != ")":
                raise self.fail("unbalanced parenthesis")
            self.take()
            return node
        if tok == "NEAR" and self.peek() == "(":
            return self.near(weights)
        if tok.startswith('"'):
            inner = tok[1:-1].replace('""', '"')
            prefix = self.peek() == "*"
            if prefix:
                self.take()
            return self.term(words(inner), prefix, weights)
        column = re.match(r"^(-?)(\{[a-z ]*\}|[a-z]+):(.*)$", tok, re.S)
        if column is not None and (column.group(2).startswith("{") or column.group(2) in COLUMNS):
            names = column.group(2).strip("{}").split()
            chosen = [c for c in COLUMNS if (c in names) != bool(column.group(1))]
            w = "".join({"body": "D", "tools": "A"}[c] for c in chosen) if len(chosen) < len(COLUMNS) else ""
            rest = column.group(3)
            if rest:
                self.toks.insert(self.i, rest)
            return self.primary(w)
        star = tok.endswith("*") and len(tok) > 1
        return self.term(words(tok.rstrip("*") if star else tok), star, weights)

    def near(self, weights: str) -> tuple:
        self.take()  # "("
        node: tuple | None = None
        while self.peek() not in (None, ")", ","):
            term = self.primary(weights)
            node = term if node is None else ("and", node, term)
        if self.peek() == ",":
            self.take()
            if self.peek() is None or not self.take().isdigit():
                raise self.fail("NEAR(...) takes words, then a comma and a number")
        if self.peek() != ")" or node is None:
            raise self.fail("unbalanced NEAR(...)")
        self.take()
        return node

    def term(self, found: list[str], prefix: bool, weights: str) -> tuple:
        found = [w for w in found if len(w.encode()) <= MAX_LEXEME]
        return ("term", Term(tuple(found), prefix, weights)) if found else NOTHING


def _simplify(node: tuple) -> tuple:
    kind = node[0]
    if kind in ("term", "nothing"):
        return node
    a, b = _simplify(node[1]), _simplify(node[2])
    if kind == "or":
        return b if a == NOTHING else a if b == NOTHING else ("or", a, b)
    if kind == "and":
        return NOTHING if NOTHING in (a, b) else ("and", a, b)
    return NOTHING if a == NOTHING else a if b == NOTHING else ("not", a, b)  # (a NOT b)


def _emit(node: tuple) -> str:
    kind = node[0]
    if kind == "term":
        t: Term = node[1]
        last = len(t.words) - 1
        parts = [_quote(w) + (":" if t.weights or (t.prefix and i == last) else "") + ("*" if t.prefix and i == last
                 else "") + t.weights for i, w in enumerate(t.words)]
        return parts[0] if len(parts) == 1 else "(" + " <-> ".join(parts) + ")"
    a, b = _emit(node[1]), _emit(node[2])
    return {"or": f"({a} | {b})", "and": f"({a} & {b})", "not": f"({a} & !{b})"}[kind]


def compile_query(query: str) -> tuple[str | None, list[Term]]:
    """``(tsquery literal, the terms a snippet marks)`` for a user's query; the literal is None when the query
    can match nothing. QueryError for a query that is not valid."""
    tree = _simplify(_Parser(query).parse())
    if tree == NOTHING:
        return None, []
    marks: list[Term] = []

    def positive(node: tuple, negated: bool) -> None:
        if node[0] == "term":
            if not negated:
                marks.append(node[1])
        elif node[0] != "nothing":
            positive(node[1], negated)
            positive(node[2], negated if node[0] != "not" else True)

    positive(tree, False)
    return _emit(tree), marks


def snippet(body: str, marks: list[Term], width: int = 16) -> str:
    """About ``width`` words of ``body`` around its first word a term of the query names, each such word
    between MARK_OPEN and MARK_CLOSE, ``…`` where text was left out (FTS5's ``snippet`` for this index)."""
    exact = {w for t in marks for w in (t.words if not t.prefix else t.words[:-1])}
    prefixes = tuple(t.words[-1] for t in marks if t.prefix)
    found: list[tuple[int, int, bool]] = []
    first = None
    for start, end, word in spans(body):
        hit = word in exact or (bool(prefixes) and word.startswith(prefixes))
        found.append((start, end, hit))
        if hit and first is None:
            first = len(found) - 1
        if first is not None and len(found) >= first + width - 3:
            break
        if first is None and len(found) > 64:
            del found[:-8]  # (only the few words before the first match are shown)
    if not found:
        return body[:200]
    at = 0 if first is None else max(0, first - 3)
    chosen = found[at:at + width]
    text = []
    for i, (start, end, hit) in enumerate(chosen):
        if i:
            text.append(body[chosen[i - 1][1]:start])
        text.append(f"{MARK_OPEN}{body[start:end]}{MARK_CLOSE}" if hit else body[start:end])
    lead = "…" if chosen[0][0] > 0 and body[:chosen[0][0]].strip() else ""
    tail = "…" if body[chosen[-1][1]:].strip() else ""
    return (lead + "".join(text) + tail).replace(MARK_CLOSE + MARK_OPEN, "")  # (数据库: one mark, as FTS5)
