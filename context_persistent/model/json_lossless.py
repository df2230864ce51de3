"""JSON for every string Python holds, lone surrogates included (pure).

A Python ``str`` may hold a *lone surrogate* (U+D800 to U+DFFF on its own): ``os.fsdecode`` and ``os.listdir``
give one for each byte of a file name that is not UTF-8 (``b"caf\\xe9"`` becomes ``"caf\\udce9"``). UTF-8 cannot
encode it, so orjson refuses such a string both ways. JSON itself can: the escape ``\\udce9`` is valid JSON
text (RFC 8259, section 7), which Python's ``json`` reads back as the same string and jq reads (as U+FFFD).

:func:`dumps` is ``orjson.dumps`` (same options, same bytes) and, only for a value orjson refuses for a
surrogate, writes each lone surrogate as its ``\\uXXXX`` escape, everything else exactly as orjson writes it.
:func:`loads` is ``orjson.loads`` and, only for JSON orjson refuses that holds such an escape, Python's parser
with orjson's rules (no NaN or Infinity, strict UTF-8). The common path costs one try block: nothing is
scanned unless orjson has refused.

One string cannot round-trip and is refused: a high surrogate followed by a low one *as two code points*
(``"\\ud83d\\ude00"`` built by hand): written as two escapes, every JSON reader joins them into the one
character they encode (``"😀"``), which would change the string.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any, Callable

import orjson

__all__ = ["dumps", "has_surrogate", "loads"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
#: A surrogate's escape in JSON text (orjson refuses a lone one; a pair it reads).
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_orjson_dumps = orjson.dumps
_orjson_loads = orjson.loads


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a surrogate code point (which UTF-8 cannot encode)."""
    return _SURROGATE.search(text) is not None


def dumps(value: Any, option: int = 0, default: Callable[[Any], Any] | None = None) -> bytes:
    """``orjson.dumps(value, default=default, option=option)``; a lone surrogate in a string or key is written
    as its ``\\uXXXX`` escape. Raises ``orjson.JSONEncodeError`` (a TypeError) as orjson does."""
    try:
        return _orjson_dumps(value, default=default, option=option)
    except orjson.JSONEncodeError as e:
        if "surrogates" not in str(e):
            raise
        return _dumps_escaped(value, option, default, e)


def _dumps_escaped(value: Any, option: int, default: Callable[[Any], Any] | None,
                   error: orjson.JSONEncodeError) -> bytes:
    """Each surrogate becomes a marker (a control character and a nonce, which orjson escapes as
    ``\\u0001<nonce>``) followed by its 4 hex digits; orjson writes the rest; then each marker and its digits
    become the surrogate's escape. The nonce occurs in none of the value's strings, so no text of the value
    is mistaken for a marker."""
    strings: list[str] = []
    _collect(value, strings)
    for text in strings:
        pair = _PAIR.search(text)
        if pair is not None:
            raise orjson.JSONEncodeError(
                f"str holds a surrogate pair as two code points (U+{ord(pair.group()[0]):04X} "
                f"U+{ord(pair.group()[1]):04X}), which every JSON reader turns into the one character they "
                "encode, so it cannot be stored unchanged; join them first "
                "(text.encode('utf-16', 'surrogatepass').decode('utf-16'))")
    if not any(_SURROGATE.search(text) for text in strings):
        raise error  # (refused for a string a ``default`` returned, not one of the value's own)
    while True:
        marker = "\x01" + secrets.token_hex(8)
        if not any(marker in text for text in strings):
            break

    def mark(m: re.Match[str]) -> str:
        return "%s%04x" % (marker, ord(m.group()))

    out = _orjson_dumps(_replaced(value, mark), default=default, option=option)
    return re.sub(rb"\\u0001" + marker[1:].encode() + rb"([0-9a-f]{4})", rb"\\u\1", out)


def _collect(value: Any, out: list[str]) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            out.append(v)
        elif t is dict:
            for k, x in v.items():
                if type(k) is str:
                    out.append(k)
                stack.append(x)
        elif t is list or t is tuple:
            stack.extend(v)


def _replaced(value: Any, mark: Callable[[re.Match[str]], str]) -> Any:
    """A copy of ``value`` with every surrogate marked (containers copied, nothing else)."""
    t = type(value)
    if t is str:
        return _SURROGATE.sub(mark, value) if _SURROGATE.search(value) else value
    if t is dict:
        return {(_replaced(k, mark) if type(k) is str else k): _replaced(v, mark) for k, v in value.items()}
    if t is list or t is tuple:
        return [_replaced(v, mark) for v in value]
    return value


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """``orjson.loads(data)``; JSON holding a lone surrogate's escape is read with Python's parser under orjson's
    rules. Raises ``orjson.JSONDecodeError`` (orjson's own, when neither parser accepts it)."""
    try:
        return _orjson_loads(data)
    except orjson.JSONDecodeError as e:
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        if _ESCAPE.search(raw) is None:
            raise
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError):
            raise e from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is infinity when parsed as double")
    return value
