"""What a message contributes to the search index, and the query language (pure: no I/O).

A message is indexed as two texts: ``body`` (its text, thinking, tool-call arguments and tool results) and
``tools`` (the names of the tools it calls or answers). Scripts written without spaces between words (Chinese,
Japanese, Korean) are cut into one token per character by an invisible separator (U+2063), in the index and in
the query alike, so that a word inside a sentence is found as a phrase of its characters; the separator is
removed again from snippets. The query language is SQLite FTS5's (docs/search.md), with one convenience: a
word holding punctuation FTS5 would refuse (``can't``, ``foo-bar``, ``a.b``) is searched as a phrase of its
parts instead of being an error.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

import orjson

from ...model import json_lossless

#: Indexed characters per message: a longer text (a huge tool output) is indexed up to here (docs/search.md).
MAX_TEXT = 1 << 20
#: The invisible separator put between the characters of scripts written without spaces.
SEP = "\u2063"
#: Characters cut into one token each: CJK ideographs, kana, Hangul syllables.
_CJK_CLASS = "([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002fa1f])"
#: Marks around a match in a snippet (replaced by the caller's marks: brackets, or bold on a terminal).
MARK_OPEN, MARK_CLOSE = "\x02", "\x03"
MAX_QUERY = 4096


@functools.cache
def cjk() -> re.Pattern[str]:
    """The pattern of one CJK character, compiled on first use: its character set takes ~4 ms to compile, which
    a process whose texts are all ASCII (the writer's indexer after a turn, #23) never needs to pay."""
    return re.compile(_CJK_CLASS)


def segment(text: str) -> str:
    """``text`` with a separator around each CJK character (a no-op for other scripts)."""
    if text.isascii() or not cjk().search(text):
        return text
    return cjk().sub(SEP + r"\1" + SEP, text)


def unsegment(text: str) -> str:
    return text.replace(SEP, "")


def _json(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json_lossless.dumps(value).decode()
    except TypeError:
        return repr(value)


def _block_texts(block: Any, body: list[str], tools: list[str]) -> None:
    if isinstance(block, str):
        body.append(block)
        return
    if not isinstance(block, dict):
        return
    kind = block.get("type")
    if kind == "text":
        body.append(_json(block.get("text", "")))
    elif kind == "thinking":
        body.append(_json(block.get("thinking", "")))
    elif kind in ("tool_use", "tool_call", "server_tool_use"):
        name = block.get("name", block.get("tool"))
        if isinstance(name, str):
            tools.append(name)
        body.append(_json(block.get("input", block.get("arguments", ""))))
    elif kind == "tool_result":
        inner = block.get("content", block.get("output"))
        if isinstance(inner, list):
            for part in inner:
                _block_texts(part, body, tools)
        elif inner is not None:
            body.append(_json(inner))


def message_texts(message: dict[str, Any]) -> tuple[str, str]:
    """``(body, tools)`` of a message as the index holds them (segmented, ``body`` cut at MAX_TEXT)."""
    body: list[str] = []
    tools: list[str] = []
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            _block_texts(block, body, tools)
    elif content is not None:
        body.append(_json(content))
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        fn = call.get("function")
        if isinstance(fn, dict):  # OpenAI: {"function": {"name", "arguments"}}
            name, args = fn.get("name"), fn.get("arguments")
        else:  # Amplifier's own form: {"id", "tool", "arguments"}
            name, args = call.get("tool", call.get("name")), call.get("arguments", call.get("input"))
        if isinstance(name, str):
            tools.append(name)
        if args is not None:
            body.append(_json(args))
    fc = message.get("function_call")
    if isinstance(fc, dict):
        if isinstance(fc.get("name"), str):
            tools.append(fc["name"])
        body.append(_json(fc.get("arguments", "")))
    if message.get("role") in ("tool", "function") and isinstance(message.get("name"), str):
        tools.append(message["name"])
    text = "\n".join(t for t in body if t)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT]
    return segment(_indexable(text)), segment(_indexable(" ".join(dict.fromkeys(tools))))


def _indexable(text: str) -> str:
    """``text`` as SQLite can hold it: a lone surrogate (a non-UTF-8 file name) becomes its escape ``\\udce9``,
    which a search for that escape finds."""
    return text.encode("utf-8", "backslashreplace").decode() if json_lossless.has_surrogate(text) else text


def fingerprint(message: Any) -> bytes:
    """A message's identity for the redaction rule (transfer/snapshot.py hides copies identical to a redacted
    message the same way)."""
    try:
        data = json_lossless.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # (an integer beyond 64 bits)
        data = repr(message).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


# -- the query language ---------------------------------------------------------------------------------
_OPERATORS = frozenset({"AND", "OR", "NOT"})
COLUMNS = ("body", "tools")


@functools.cache
def query_patterns() -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    """``(token, bare, column)``, compiled when the first query is parsed (not by the writer's indexer):
    ``token`` is a run that is one unit of the query (a quoted string, a parenthesis, or anything up to
    whitespace), ``bare`` a word that needs no quoting, ``column`` a column filter."""
    return (re.compile(r'-?\{[^}]*\}:[^\s(),"]*|"(?:[^"]|"")*"?|[(),]|[^\s(),"]+'),
            re.compile(r"[\w\u0080-\U0010ffff\x1a]+\*?", re.UNICODE),
            re.compile(r"^(-?)(\{[a-z ]*\}|[a-z]+):(.*)$", re.S))


class QueryError(ValueError):
    """A search query that is not valid: the message says what and where (one line)."""


def translate(query: str) -> str:
    """The FTS5 query for a user's ``query``; QueryError (a ValueError) if it cannot be one.

    Words, ``"phrases"``, ``prefix*``, ``AND``/``OR``/``NOT``, ``NEAR(a b, N)``, parentheses and column filters
    (``tools:bash``, ``body:error``) pass through; a word holding other punctuation becomes a phrase of its parts.
    """
    if not isinstance(query, str):
        raise QueryError(f"the query must be a string, got {type(query).__name__}")
    try:
        query.encode()
    except UnicodeEncodeError as e:
        raise QueryError(f"the query is not valid Unicode text ({e.reason} at character {e.start})") from None
    if "\x00" in query:
        raise QueryError("the query holds a NUL character")
    if len(query) > MAX_QUERY:
        raise QueryError(f"the query is {len(query)} characters long; at most {MAX_QUERY} are allowed")
    if not query.strip():
        raise QueryError("the query is empty; give words to search for (docs/search.md)")
    out: list[str] = []
    for tok in query_patterns()[0].findall(query):
        if tok.startswith('"'):
            if len(tok) < 2 or not tok.endswith('"') or tok.endswith('""') and len(tok) % 2:
                raise QueryError(f"unbalanced double quote in {query!r}")
            out.append(segment(tok))
        elif tok in ("(", ")", ",") or tok in _OPERATORS or tok == "NEAR":
            out.append(tok)
        else:
            out.append(_word(tok))
    return " ".join(out)


def _word(tok: str) -> str:
    _, bare, column = query_patterns()
    m = column.match(tok)
    if m is not None and (m.group(2).startswith("{") or m.group(2) in COLUMNS):
        names = m.group(2).strip("{}").split()
        unknown = [n for n in names if n not in COLUMNS]
        if unknown:
            raise QueryError(f"unknown column {unknown[0]!r}; the columns are {', '.join(COLUMNS)}")
        rest = m.group(3)
        return f"{m.group(1)}{m.group(2)}:" + (_word(rest) if rest else "")
    if bare.fullmatch(tok):
        return segment(tok)
    star = tok.endswith("*") and len(tok) > 1
    parts = [p for p in re.split(r"[^\w\u0080-\U0010ffff]+", tok[:-1] if star else tok) if p]
    if not parts:
        # nothing searchable in it (punctuation only): a phrase that matches nothing rather than an error
        return '""'
    phrase = segment(" ".join(parts)).replace('"', '""')
    return f'"{phrase}"' + ("*" if star else "")
