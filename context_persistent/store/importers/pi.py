"""pi sessions (pi-coding-agent): ``~/.pi/agent/sessions/--<path>--/<time>_<id>.jsonl``.

The first line is the header (``type: session``, ``id``, ``version``). Version 1 files list the entries in
order; from version 2 on, entries form a tree by ``id``/``parentId`` (a branch made with ``/tree`` stays in the
file): the conversation imported is the active branch, from the last entry back to the root, as pi shows it on
resume. ``message`` entries map by their message's role: ``user``; ``assistant`` (``text``, ``thinking`` as
``reasoning_content``, ``toolCall`` blocks as ``tool_calls``); ``toolResult`` as a ``tool`` message with the
``tool_call_id``; ``bashExecution`` (a command the user ran) and ``custom`` (an extension's message) as user
messages. Model and thinking-level changes, compactions, branch summaries and labels are counted, not imported
(the full history is there; pi's compaction summary would repeat it).
"""

from __future__ import annotations

from typing import Any

from ...errors import MalformedInputError
from .common import Parsed, jsonl_records, need, text_of, tool_call

FORMAT = "pi"


def _message(p: Parsed, msg: dict[str, Any], line: int, stamp: Any, name: str) -> None:
    role = msg.get("role")
    where = {"line": line}
    content = msg.get("content")
    m: dict[str, Any]
    if role == "user" or role == "custom":
        only_text = isinstance(content, str) or all(isinstance(b, dict) and b.get("type") == "text"
                                                    for b in content or [])
        m = {"role": "user", "content": text_of(content) if only_text else content,
                             "imported": where}
        if role == "custom":
            m["imported"] = {**where, "custom_type": msg.get("customType")}
        p.add(m, line, stamp)
    elif role == "assistant":
        m = {"role": "assistant", "content": None, "imported": where}
        for block in content if isinstance(content, list) else [{"type": "text", "text": content or ""}]:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                m["content"] = (m["content"] + "\n" if m["content"] else "") + block.get("text", "")
            elif kind == "thinking":
                m["reasoning_content"] = m.get("reasoning_content", "") + (block.get("thinking") or "")
            elif kind == "toolCall":
                m.setdefault("tool_calls", []).append(tool_call(block.get("id"), block.get("name"),
                                                                block.get("arguments", {})))
            else:
                m.setdefault("blocks", []).append(block)
        for key in ("provider", "model", "usage", "stopReason"):
            if key in msg:
                m.setdefault("pi", {})[key] = msg[key]
        p.add(m, line, stamp)
    elif role == "toolResult":
        m = {"role": "tool", "tool_call_id": msg.get("toolCallId"), "content": text_of(content),
             "name": msg.get("toolName"), "imported": where}
        if msg.get("isError"):
            m["is_error"] = True
        p.add(m, line, stamp)
    elif role == "bashExecution":
        p.add({"role": "user", "content": f"$ {msg.get('command', '')}\n{msg.get('output', '')}",
               "imported": {**where, "bash": {"exitCode": msg.get("exitCode")}}}, line, stamp)
    else:
        raise MalformedInputError(name, line, f"a message entry with unknown role {role!r}; known: user, "
                                  "assistant, toolResult, bashExecution, custom")


def parse(data: bytes, name: str) -> Parsed:
    """The active branch of one pi session file."""
    p = Parsed(FORMAT, name, None)
    records = list(jsonl_records(data, name))
    if not records or records[0][1].get("type") != "session":
        raise MalformedInputError(name, records[0][0] if records else None,
                                  "is not a pi session: its first line must be the header {\"type\": \"session\"}")
    header = records[0][1]
    p.agent_session_id = header.get("id") if isinstance(header.get("id"), str) else None
    version = header.get("version", 1)
    p.meta = {"version": version, **{k: header[k] for k in ("cwd", "provider", "modelId") if k in header}}
    entries = records[1:]
    if version != 1:
        by_id: dict[str, tuple[int, dict[str, Any]]] = {}
        for line, rec in entries:
            by_id[need(rec, "id", str, name, line, f"a version {version} entry")] = (line, rec)
        path: list[tuple[int, dict[str, Any]]] = []
        at = entries[-1][1].get("id") if entries else None
        while at is not None:
            if at not in by_id:
                raise MalformedInputError(name, path[-1][0], f"its parentId {at!r} names no entry of the file")
            path.append(by_id[at])
            at = by_id[at][1].get("parentId")
            if len(path) > len(entries):
                raise MalformedInputError(name, path[-1][0], "the parentId links form a cycle")
        path.reverse()
        on_path = {line for line, _ in path}
        for line, _ in entries:
            if line not in on_path:
                p.ignore("other_branch")
        entries = path
    for line, rec in entries:
        if rec.get("type") != "message":
            p.ignore(str(rec.get("type")))
            continue
        _message(p, need(rec, "message", dict, name, line, "a message entry"), line, rec.get("timestamp"), name)
    return p
