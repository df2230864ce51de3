"""Snapshot files and foreign message files: encoding, detection and parsing (pure: bytes in, bytes out).

The I/O (atomic writes, temp folders, aiofiles) lives in snapshot.py. See docs/snapshots.md for the format.

A snapshot holds one *view* of a session as a list of messages plus a header. Its checksum is defined once
for every format: ``sha256`` over the messages as compact JSON (orjson), one per line, each ending in
``\\n`` (the "canonical body"). For JSONL that is exactly the bytes after the header line; for JSON it is
recomputed from the parsed messages (orjson re-encodes what it wrote byte for byte); for Markdown it is the
bytes after the header line (Markdown is one-way: for people, never imported).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import orjson

from ..model import json_lossless
from ..model import events as ev
from ..errors import MalformedInputError, UnsupportedFormatError

#: The key that marks a snapshot header; its value is the snapshot format version.
MARKER: Final = "context_persistent_snapshot"
SNAPSHOT_VERSION: Final = 1
FORMATS: Final = ("jsonl", "json", "markdown")
VIEWS: Final = ("full", "conversation", "reasoning", "request")
SOURCES: Final = ("auto", "snapshot", "transcript", "reference")
MD_PREFIX: Final = b"<!-- context-persistent snapshot "
_BOM: Final = b"\xef\xbb\xbf"
#: File names the Amplifier CLI and the reference module use (the first rule of ``auto`` detection).
TRANSCRIPT_NAME: Final = "transcript.jsonl"
REFERENCE_NAME: Final = "context-messages.jsonl"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def format_for_path(path: str | Any) -> str:
    """The snapshot format a file name implies: ``.md``/``.markdown`` → markdown, ``.json`` → json, else jsonl."""
    suffix = Path(str(path)).suffix.lower()
    return {".md": "markdown", ".markdown": "markdown", ".json": "json"}.get(suffix, "jsonl")


#: How every note the request view puts in place of left-out messages begins (compaction/_base.py).
NOTE_PREFIX: Final = "[context-persistent: "


def note_indices(messages: Sequence[dict[str, Any]], history: Sequence[dict[str, Any]] = ()) -> list[int]:
    """Positions of the notes a request view holds: user messages the store wrote in place of left-out
    messages (``[context-persistent: … left out …]``, or a summary), not messages of the session. A message
    equal to one of ``history`` is the session's own, whatever its text."""
    found = [i for i, m in enumerate(messages)
             if m.get("role") == "user" and isinstance(m.get("content"), str)
             and m["content"].startswith(NOTE_PREFIX)]
    if found and history:
        own = {m["content"] for m in history
               if m.get("role") == "user" and isinstance(m.get("content"), str)
               and m["content"].startswith(NOTE_PREFIX)}
        found = [i for i in found if messages[i]["content"] not in own]
    return found


# -- writing ----------------------------------------------------------------------------------------
def message_lines(messages: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    """The canonical body, one line per message (the unit the checksum covers)."""
    dumps = json_lossless.dumps
    for m in messages:
        yield dumps(m) + b"\n"


def encode_snapshot(header: dict[str, Any], messages: Sequence[dict[str, Any]], fmt: str) -> Iterator[bytes]:
    """The file's bytes in chunks. ``header`` gets ``body_sha256`` filled in (the caller keeps it)."""
    check_choice("format", fmt, FORMATS)
    if fmt == "markdown":
        body = render_markdown(header, messages)
        header["body_sha256"] = sha256(body)
        yield MD_PREFIX + json_lossless.dumps(header) + b" -->\n"
        yield body
        return
    lines = list(message_lines(messages))
    h = hashlib.sha256()
    for line in lines:
        h.update(line)
    header["body_sha256"] = "sha256:" + h.hexdigest()
    if fmt == "jsonl":
        yield json_lossless.dumps(header) + b"\n"
        yield from _chunks(lines)
        return
    # JSON: indented for people; the checksum is over the canonical body, not these bytes.
    yield json_lossless.dumps({"header": header, "messages": list(messages)}, option=orjson.OPT_INDENT_2) + b"\n"


def json_document(header: dict[str, Any], messages: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    """The JSON form, a message at a time: the same bytes as ``json_lossless.dumps({"header": header, "messages":
    [...]}, option=OPT_INDENT_2) + b"\\n"``, with the brackets, commas and indentation written here (by
    :class:`JsonWriter`) so the messages are never held together."""
    w = JsonWriter({"header": header}, "messages")
    for m in messages:
        yield w.item(m)
    yield w.end()


class JsonWriter:
    """An indented JSON object written in pieces: the keys of ``fixed``, then ``key`` holding a list whose
    items are given one at a time (``item``), then ``end(after)`` with the keys of ``after``. The bytes equal
    ``json_lossless.dumps({**fixed, key: items, **after}, option=OPT_INDENT_2 | OPT_NON_STR_KEYS) + b"\\n"``."""

    OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS

    def __init__(self, fixed: dict[str, Any], key: str) -> None:
        start = json_lossless.dumps(fixed, option=self.OPTIONS)[:-2] + b",\n  " if fixed else b"{\n  "
        self.head = start + json_lossless.dumps(key) + b": ["
        self.first = True

    def item(self, value: Any) -> bytes:
        # Encoded two levels down, as inside the document: indented alike, and refused by orjson if the
        # document would be nested deeper than JSON readers accept (as encoding the whole document would).
        body = json_lossless.dumps([[value]], option=self.OPTIONS)[10:-6]
        if self.first:
            self.first = False
            return self.head + b"\n    " + body
        return b",\n    " + body

    def end(self, after: dict[str, Any] | None = None) -> bytes:
        close = b"]" if self.first else b"\n  ]"
        if self.first:
            self.first = False
            close = self.head + close
        rest = b",\n" + json_lossless.dumps(after, option=self.OPTIONS)[2:] if after else b"\n}"
        return close + rest + b"\n"


def _chunks(lines: Iterable[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    buf: list[bytes] = []
    n = 0
    for line in lines:
        buf.append(line)
        n += len(line)
        if n >= size:
            yield b"".join(buf)
            buf, n = [], 0
    if buf:
        yield b"".join(buf)


def render_markdown(header: dict[str, Any], messages: Sequence[dict[str, Any]]) -> bytes:
    """A readable transcript: one section per message, tool calls and results as fenced JSON."""
    out = [f"# Session `{header['session_id']}`\n",
           f"\nView **{header['view']}**, {len(messages)} messages, events {header['seq_range'][0]}–"
           f"{header['seq_range'][1]}, exported {header['created_at']}. One-way: import a JSONL or JSON "
           "snapshot instead.\n"]
    notes = set(header.get("notes") or ())
    for i, m in enumerate(messages, 1):
        label = " (a note in place of left-out messages, not a message of the session)" if i - 1 in notes else ""
        out.append(f"\n## {i}. {m.get('role')}{label}\n\n")
        content = m.get("content")
        if isinstance(content, str):
            out.append(content.rstrip("\n") + "\n")
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") in ("text", "output_text", "input_text"):
                    out.append(str(block.get("text", "")).rstrip("\n") + "\n")
                else:
                    out.append(_fenced(block))
        elif content is not None:
            out.append(_fenced(content))
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        if extra:
            out.append(_fenced(extra))
    return "".join(out).encode("utf-8", "backslashreplace")  # (a lone surrogate: its escape, \\udce9)


def _fenced(value: Any) -> str:
    text = json_lossless.dumps(value, option=orjson.OPT_INDENT_2).decode()
    return f"\n```json\n{text}\n```\n"


# -- detecting --------------------------------------------------------------------------------------
def detect(data: bytes, path: str) -> str:
    """``"markdown"``, ``"snapshot"`` or ``"messages"`` (a transcript or context-messages file).

    Rules, in order: a ``.md``/``.markdown`` name or our Markdown header → markdown; a first line that is a
    JSON object with the snapshot marker, or a whole-file JSON object whose ``header`` has it → snapshot;
    a first line that is a JSON object with a ``role`` → messages. Anything else is MalformedInputError.
    """
    data = data.removeprefix(_BOM)
    if Path(path).suffix.lower() in (".md", ".markdown") or data.startswith(MD_PREFIX):
        return "markdown"
    if not data.strip():
        raise MalformedInputError(path, None, "the file is empty, so its kind cannot be detected "
                                              "(give source='transcript' or 'reference' to import no messages)")
    first_no, first = next((i, ln) for i, ln in enumerate(data.split(b"\n"), 1) if ln.strip())
    try:
        obj = loads_exact(first, path, first_no)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        if MARKER in obj:
            return "snapshot"
        if "role" in obj:
            return "messages"
        raise MalformedInputError(path, first_no, "is a JSON object with neither a 'role' (a message) nor "
                                                  f"{MARKER!r} (a snapshot header)")
    try:
        whole = loads_exact(data, path, 1)
    except orjson.JSONDecodeError as e:
        raise MalformedInputError(path, first_no, f"is not JSON ({e}); expected a snapshot or one message "
                                                  "per line") from None
    if isinstance(whole, dict) and isinstance(whole.get("header"), dict) and MARKER in whole["header"]:
        return "snapshot"
    raise MalformedInputError(path, first_no, "is JSON but neither a snapshot nor a message per line")


def messages_kind(path: str, messages: Sequence[dict[str, Any]]) -> str:
    """``"transcript"`` or ``"reference"`` for a message-per-line file (the ``auto`` rules, in order).

    The file name decides when it is the one the writer uses (``transcript.jsonl`` /
    ``context-messages.jsonl``); else a system or developer message means the reference module (the CLI
    drops those from its transcript); else a transcript.
    """
    name = Path(path).name
    if name == TRANSCRIPT_NAME:
        return "transcript"
    if name == REFERENCE_NAME:
        return "reference"
    if any(m.get("role") in ("system", "developer") for m in messages):
        return "reference"
    return "transcript"


# -- parsing ----------------------------------------------------------------------------------------
#: The integers the store can hold (orjson's range: int64 and uint64). orjson.loads turns a longer integer
#: literal into a float silently; a foreign file holding one is refused instead (its value would change).
INT_MIN: Final = -(1 << 63)
INT_MAX: Final = (1 << 64) - 1
#: Any integer outside that range has at least 19 digits: only text with such a run is parsed again exactly.
_LONG_DIGITS: Final = re.compile(rb"[0-9]{19,}")


def _big_int(value: Any) -> int | None:
    """The first integer in a parsed JSON value that lies outside the 64-bit range, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is int:
            if not INT_MIN <= v <= INT_MAX:
                return v  # type: ignore[no-any-return]
        elif t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return None


def _big_int_text(raw: bytes, obj: Any) -> int | None:
    """When the exact parse failed: -1 if a long digit run outside strings can only be an integer literal
    beyond the 64-bit range (orjson read it as a float), else None."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if type(v) is float and v.is_integer() and not INT_MIN <= v <= INT_MAX:
            return -1
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
    return None


def loads_exact(raw: bytes, path: str, first_line: int | None) -> Any:
    """``json_lossless.loads(raw)``, refusing an integer orjson would change into a float (beyond 64 bits).

    MalformedInputError names the line that holds it (``first_line`` is the line ``raw`` starts on) and the
    allowed range. orjson.JSONDecodeError passes through for the caller to word.
    """
    obj = json_lossless.loads(raw)
    if _LONG_DIGITS.search(raw) is None:
        return obj
    try:
        big = _big_int(json.loads(raw))  # the exact parse, only for text with a long run of digits
    except (ValueError, RecursionError):  # more digits than Python converts (4300), or nested too deep
        big = _big_int_text(raw, obj)
    if big is None:
        return obj
    text = str(big) if big != -1 else "of thousands of digits"
    line = first_line
    if line is not None:
        at = re.search(rb"(?<![0-9.eE])%s(?![0-9.eE])" % text.encode(), raw) if big != -1 else _LONG_DIGITS.search(raw)
        line += raw.count(b"\n", 0, at.start()) if at is not None else 0
    shown = text if len(text) <= 40 else f"{text[:20]}…{text[-8:]} ({len(text.lstrip('-'))} digits)"
    raise MalformedInputError(path, line, f"holds the integer {shown}, outside the 64-bit range the store "
                                          f"keeps exactly ({INT_MIN} to {INT_MAX}); reading it would change it "
                                          "into an approximate float, so the file is refused (store such a "
                                          "number as a string)")


def _lines(data: bytes) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, line, is_unterminated_last)`` for each non-blank line."""
    parts = data.split(b"\n")
    last = len(parts)
    for no, raw in enumerate(parts, 1):
        if raw.strip():
            yield no, raw, no == last  # the piece after the final newline is unterminated


def _load_line(raw: bytes, no: int, unterminated: bool, path: str) -> Any:
    try:
        return loads_exact(raw, path, no)
    except orjson.JSONDecodeError as e:
        if unterminated:
            raise MalformedInputError(path, no, f"is truncated (the last line has no newline and is not "
                                                f"complete JSON: {e})") from None
        raise MalformedInputError(path, no, f"is not valid JSON ({e})") from None


def _check_message(obj: Any, no: int | None, path: str) -> dict[str, Any]:
    try:
        ev.validate_message(obj, "the message")
    except ValueError as e:
        raise MalformedInputError(path, no, str(e)) from None
    return obj  # type: ignore[no-any-return]


def parse_message_lines(data: bytes, path: str) -> tuple[list[dict[str, Any]], list[str | None]]:
    """Messages of a transcript / context-messages file and the top-level ``timestamp`` each carried.

    The ``timestamp`` key (added by the reference module and by newer Amplifier CLIs) is not part of the
    message: it is removed and returned separately. Blank lines are ignored; any other bad line is an
    error naming its number (a truncated last line says so).
    """
    data = data.removeprefix(_BOM)
    messages: list[dict[str, Any]] = []
    stamps: list[str | None] = []
    for no, raw, unterminated in _lines(data):
        obj = _load_line(raw, no, unterminated, path)
        if isinstance(obj, dict) and MARKER in obj:
            raise MalformedInputError(path, no, "is a context-persistent snapshot header; import it with "
                                                "source='snapshot' (or 'auto')")
        if isinstance(obj, dict) and isinstance(obj.get("timestamp"), str):
            obj = dict(obj)
            stamps.append(obj.pop("timestamp"))
        else:
            stamps.append(None)
        messages.append(_check_message(obj, no, path))
    return messages, stamps


def parse_snapshot(data: bytes, path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(header, messages)`` of a JSONL or JSON snapshot, checksum verified; Markdown is refused."""
    data = data.removeprefix(_BOM)
    if data.startswith(MD_PREFIX):
        raise ValueError(f"{path} is a Markdown snapshot: Markdown is one-way (for people to read) and "
                         "cannot be imported; export the session with format 'jsonl' or 'json' to move it")
    head, sep, rest = data.partition(b"\n")
    try:
        header = loads_exact(head, path, 1)
    except orjson.JSONDecodeError:
        header = None
    if isinstance(header, dict) and MARKER in header:
        _check_header(header, path)
        messages = _snapshot_jsonl_body(rest, path)
        body_digest = sha256(rest)
    else:
        header, messages = _snapshot_json(data, path)
        body_digest = sha256(b"".join(message_lines(messages)))
    n = header.get("messages")
    if isinstance(n, int) and n != len(messages):
        raise MalformedInputError(path, len(messages) + 2 if n > len(messages) else None,
                                  f"the header says {n} messages but the file holds {len(messages)} "
                                  "(truncated or edited after export)")
    if body_digest != header.get("body_sha256"):
        raise MalformedInputError(path, None, f"body checksum mismatch (header {header.get('body_sha256')}, "
                                              f"file {body_digest}): the messages were changed after export")
    return header, messages


def _check_header(header: dict[str, Any], path: str) -> None:
    version = header.get(MARKER)
    if not isinstance(version, int) or version < 1:
        raise MalformedInputError(path, 1, f"snapshot header has no valid format version ({version!r})")
    if version > SNAPSHOT_VERSION:
        raise UnsupportedFormatError(f"{path}: snapshot format version {version} is newer than this "
                                     f"program's {SNAPSHOT_VERSION}: upgrade context-persistent to import it")
    if not isinstance(header.get("body_sha256"), str):
        raise MalformedInputError(path, 1, "snapshot header has no body_sha256 checksum")


def _snapshot_jsonl_body(body: bytes, path: str) -> list[dict[str, Any]]:
    messages = []
    for no, raw, unterminated in _lines(body):
        obj = _load_line(raw, no + 1, unterminated, path)
        messages.append(_check_message(obj, no + 1, path))
    return messages


def _snapshot_json(data: bytes, path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        doc = loads_exact(data, path, 1)
    except orjson.JSONDecodeError as e:
        raise MalformedInputError(path, e.lineno, f"is not valid JSON ({e.msg}; truncated or edited?)") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("header"), dict) and MARKER in doc["header"]):
        raise MalformedInputError(path, 1, f"is not a context-persistent snapshot (no {MARKER!r} header)")
    header = doc["header"]
    _check_header(header, path)
    msgs = doc.get("messages")
    if not isinstance(msgs, list):
        raise MalformedInputError(path, None, "snapshot has no 'messages' list")
    for i, m in enumerate(msgs):
        try:
            ev.validate_message(m, f"messages[{i}]")
        except ValueError as e:
            raise MalformedInputError(path, None, str(e)) from None
    return header, msgs


def header_pins(header: dict[str, Any], count: int, path: str) -> list[int]:
    pins = header.get("pinned") or []
    if not isinstance(pins, list) or not all(isinstance(i, int) and 0 <= i < count for i in pins):
        raise MalformedInputError(path, 1, f"header 'pinned' must list message positions 0..{count - 1}")
    return sorted(set(pins))


NOTE_CHOICES: Final = ("refuse", "drop", "keep")


def header_notes(header: dict[str, Any], messages: Sequence[dict[str, Any]], path: str) -> list[int]:
    """The note positions of a request-view snapshot: the header's ``notes`` list, or (a snapshot written
    before headers listed them) the messages that look like notes."""
    if header.get("view") != "request":
        return []
    if "notes" not in header:
        return note_indices(messages)
    notes = header["notes"]
    count = len(messages)
    if not isinstance(notes, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count
                                              for i in notes):
        raise MalformedInputError(path, 1, f"header 'notes' must list message positions 0..{count - 1}")
    return sorted(set(notes))
