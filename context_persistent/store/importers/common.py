"""What every agent-session importer shares: reading JSONL with file and line in every error, the result of a
parse (messages with their provenance), and the check that tool calls and results are paired."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import MalformedInputError


@dataclass
class Parsed:
    """One agent session read from a file: messages for the store, and what was left out (counted, never silent)."""

    format: str
    path: str
    agent_session_id: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Line (row) of the source each message came from, and the source's own timestamp if it has one.
    lines: list[int] = field(default_factory=list)
    stamps: list[str | None] = field(default_factory=list)
    #: Records not carried over, by kind ("summary", "turn_context", ...): listed in the session's provenance.
    ignored: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, message: dict[str, Any], line: int, stamp: Any = None) -> None:
        self.messages.append(message)
        self.lines.append(line)
        self.stamps.append(stamp if isinstance(stamp, str) else None)

    def ignore(self, kind: str) -> None:
        self.ignored[kind] = self.ignored.get(kind, 0) + 1


def jsonl_records(data: bytes, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line; MalformedInputError names the file and line of a bad
    one (not JSON, not an object, not UTF-8, or the last line cut short)."""
    lines = data.split(b"\n")
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            raise MalformedInputError(name, i, "is not UTF-8") from None
        except json.JSONDecodeError as e:
            cut = i == len(lines) and not data.endswith(b"\n")
            raise MalformedInputError(name, i, "is truncated (the file ends inside this line)" if cut
                                      else f"is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise MalformedInputError(name, i, f"is a JSON {type(obj).__name__}, not an object")
        yield i, obj


def need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], name: str, line: int, what: str) -> Any:
    """``obj[key]``, which must be of ``kind``; else MalformedInputError saying what the line lacks."""
    value = obj.get(key)
    if not isinstance(value, kind):
        want = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
        got = "missing" if key not in obj else f"a {type(value).__name__}"
        raise MalformedInputError(name, line, f"{what}: '{key}' must be a {want}, it is {got}")
    return value


def text_of(blocks: Any, kinds: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """The text of a content that is a string or a list of typed blocks."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list):
        return "\n".join(b["text"] for b in blocks
                         if isinstance(b, dict) and b.get("type") in kinds and isinstance(b.get("text"), str))
    return "" if blocks is None else json.dumps(blocks, ensure_ascii=False)


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """An OpenAI-style tool call (the store's views and compaction pair calls and results by this id)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def pairing(messages: list[dict[str, Any]]) -> dict[str, int]:
    """How many tool calls have no result after them (``unanswered``: an interrupted turn) and how many results
    have no call before them (``orphaned``)."""
    open_calls: set[str] = set()
    answered: set[str] = set()
    orphaned = 0
    for m in messages:
        for c in m.get("tool_calls") or ():
            open_calls.add(c["id"])
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if cid in open_calls:
                answered.add(cid)
            else:
                orphaned += 1
    return {"unanswered": len(open_calls - answered), "orphaned": orphaned}


def display(path: Path) -> str:
    return str(path)
