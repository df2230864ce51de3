"""How the commands print (shared by every command module): colour on a terminal only, role labels, sizes
and times for people, plain-text tables, JSON on stdout, and a readable rendering of one message."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from ..model import json_lossless

_ROLE_COLOURS = {"system": "35", "developer": "35", "user": "32", "assistant": "36", "tool": "33",
                 "function": "33"}


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def paint(text: str, code: str, on: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if on else text


def role_label(role: str, on: bool, width: int = 9) -> str:
    return paint(f"{role:<{width}}", _ROLE_COLOURS.get(role, "0"), on)


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def short_time(ts: str | None) -> str:
    return ts[:19].replace("T", " ") + "Z" if ts else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def print_json(value: Any) -> None:
    sys.stdout.buffer.write(json_lossless.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n")
    sys.stdout.flush()


def message_text(m: dict[str, Any], limit: int | None, hint: str = "") -> str:
    """A readable rendering of one message: text, then tool calls and results, one per line."""
    parts: list[str] = []
    shown_calls: set[Any] = set()
    content = m.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for b in content:
            if not isinstance(b, dict):
                parts.append(str(b))
            elif b.get("type") in ("text", "output_text", "input_text"):  # (the last two: OpenAI Responses items)
                parts.append(str(b.get("text", "")))
            elif b.get("type") == "refusal":
                parts.append(f"(refusal) {b.get('refusal', '')}")
            elif b.get("type") in ("tool_use", "tool_call"):  # Anthropic's block, Amplifier's ToolCallBlock
                shown_calls.add(b.get("id"))
                parts.append(f"→ {b.get('name')}({json_lossless.dumps(b.get('input')).decode()})  [{b.get('id')}]")
            elif b.get("type") == "tool_result":
                inner = b.get("content", b.get("output"))
                if isinstance(inner, list):
                    inner = " ".join(str(x.get("text", x)) if isinstance(x, dict) else str(x) for x in inner)
                elif not isinstance(inner, str):
                    inner = json_lossless.dumps(inner).decode()
                parts.append(f"← [{b.get('tool_use_id', b.get('tool_call_id'))}] {inner}")
            elif b.get("type") in ("thinking", "redacted_thinking"):
                parts.append(f"(thinking) {b.get('thinking', '')}")
            else:
                parts.append(f"[{b.get('type')}]")
    for call in m.get("tool_calls") or ():
        if not isinstance(call, dict) or (call.get("id") in shown_calls and call.get("id") is not None):
            continue  # (Amplifier stores each call twice: a tool_call block and a tool_calls entry)
        fn = call.get("function")
        if isinstance(fn, dict):  # OpenAI: {"id", "type", "function": {"name", "arguments"}}
            name, args = fn.get("name"), fn.get("arguments")
        else:  # Amplifier's own form: {"id", "tool", "arguments"}
            name, args = call.get("tool", call.get("name")), call.get("arguments", call.get("input"))
        if not isinstance(args, str):
            args = json_lossless.dumps(args).decode()
        parts.append(f"→ {name}({args})  [{call.get('id')}]")
    if m.get("tool_call_id"):
        parts[0:0] = [f"← [{m['tool_call_id']}]"]
    text = "\n".join(p for p in parts if p)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit} more characters{hint})"
    return text
