"""Claude Code sessions: ``~/.claude/projects/<project>/<session id>.jsonl``, one JSON object a line.

A line of ``type`` ``user`` or ``assistant`` holds an Anthropic Messages API message under ``message``;
Claude Code writes one assistant response as several lines (one content block each, the same
``message.id``): consecutive ones are joined into one message. ``tool_use`` blocks become ``tool_calls``,
``tool_result`` blocks ``tool`` messages with the ``tool_call_id``, ``thinking`` blocks ``reasoning_content``.
Other lines (``summary``, ``system``, ``file-history-snapshot``, sub-agent ``isSidechain`` lines, ...) are not
messages of the conversation: they are counted in the session's provenance.
"""

from __future__ import annotations

from typing import Any

from .common import Parsed, jsonl_records, need, text_of, tool_call

FORMAT = "claude-code"


def _user(p: Parsed, content: Any, line: int, stamp: Any, where: dict[str, Any]) -> None:
    if isinstance(content, str):
        p.add({"role": "user", "content": content, "imported": where}, line, stamp)
        return
    rest = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            result = block.get("content")
            message = {"role": "tool", "tool_call_id": block.get("tool_use_id"),
                       "content": result if isinstance(result, str) else text_of(result), "imported": where}
            if block.get("is_error"):
                message["is_error"] = True
            p.add(message, line, stamp)
        else:
            rest.append(block)
    if rest:
        only_text = all(isinstance(b, dict) and b.get("type") == "text" for b in rest)
        p.add({"role": "user", "content": text_of(rest) if only_text else rest, "imported": where}, line, stamp)


def _assistant(p: Parsed, msg: dict[str, Any], content: Any, line: int, stamp: Any,
               where: dict[str, Any]) -> None:
    last = p.messages[-1] if p.messages else None
    mid = msg.get("id")
    if (last is not None and last["role"] == "assistant" and mid is not None
            and last["imported"].get("message_id") == mid):
        target = last  # (the same response, continued on this line)
        target["imported"]["lines"].append(line)
    else:
        target = {"role": "assistant", "content": None, "imported": {**where, "lines": [line], "message_id": mid}}
        if isinstance(msg.get("model"), str):
            target["model"] = msg["model"]
        p.add(target, line, stamp)
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            target["content"] = (target["content"] + "\n" if target["content"] else "") + block.get("text", "")
        elif kind == "tool_use":
            target.setdefault("tool_calls", []).append(tool_call(block.get("id"), block.get("name"),
                                                                 block.get("input", {})))
        elif kind in ("thinking", "redacted_thinking"):
            if block.get("thinking"):
                target["reasoning_content"] = target.get("reasoning_content", "") + block["thinking"]
        else:
            target.setdefault("blocks", []).append(block)  # (an image, a server tool block: kept as it was)


def parse(data: bytes, name: str) -> Parsed:
    """The conversation of one Claude Code session file."""
    p = Parsed(FORMAT, name, None)
    for line, rec in jsonl_records(data, name):
        kind = rec.get("type")
        if kind not in ("user", "assistant"):
            p.ignore(str(kind))
            continue
        if rec.get("isSidechain"):
            p.ignore("sidechain")
            continue
        if p.agent_session_id is None and isinstance(rec.get("sessionId"), str):
            p.agent_session_id = rec["sessionId"]
        msg = need(rec, "message", dict, name, line, f"a {kind} line")
        content = msg.get("content")
        if not isinstance(content, (str, list)):
            need(msg, "content", (str, list), name, line, f"the {kind} line's message")
        where = {"line": line, "uuid": rec.get("uuid")}
        if kind == "user":
            _user(p, content, line, rec.get("timestamp"), where)
        else:
            _assistant(p, msg, content, line, rec.get("timestamp"), where)
    return p
