"""Codex rollouts: ``~/.codex/sessions/YYYY/MM/DD/rollout-<time>-<id>.jsonl`` (or ``.jsonl.zst``).

Each line is ``{"timestamp", "type", "payload"}``. ``session_meta`` names the session (``payload.id``);
``response_item`` lines are the model's input and output items (the Responses API's): ``message`` items keep
their role and text, ``function_call``/``custom_tool_call``/``local_shell_call`` become ``tool_calls`` of an
assistant message, their ``*_output`` items ``tool`` messages with the ``tool_call_id``, and ``reasoning``
items ``reasoning_content`` (their readable summary: encrypted content cannot be carried over).
``event_msg`` lines repeat the same conversation for the UI, and ``turn_context``/``compacted`` lines are
settings and Codex's own compaction: all are counted in the provenance, not imported.
"""

from __future__ import annotations

import json
from typing import Any

from .common import Parsed, jsonl_records, need, text_of, tool_call

FORMAT = "codex"
_CALLS = {"function_call": "arguments", "custom_tool_call": "input", "local_shell_call": "action"}
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


def _item(p: Parsed, item: dict[str, Any], line: int, stamp: Any) -> None:
    kind = item.get("type")
    where = {"line": line}
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            p.ignore(f"message:{role}")
            return
        p.add({"role": role, "content": text_of(item.get("content")), "imported": where}, line, stamp)
    elif kind in _CALLS:
        call_id = item.get("call_id") or item.get("id")
        name = item.get("name") or ("shell" if kind == "local_shell_call" else kind)
        p.add({"role": "assistant", "content": None,
               "tool_calls": [tool_call(call_id, name, item.get(_CALLS[kind]))],
               "imported": {**where, "item": kind}}, line, stamp)
    elif kind in _OUTPUTS:
        output = item.get("output")
        if isinstance(output, dict):  # (an output with content items, or a structured result)
            output = output.get("content", json.dumps(output, ensure_ascii=False))
        p.add({"role": "tool", "tool_call_id": item.get("call_id"),
               "content": output if isinstance(output, str) else text_of(output),
               "imported": {**where, "item": kind}}, line, stamp)
    elif kind == "reasoning":
        summary = text_of(item.get("summary"), ("summary_text", "text"))
        p.add({"role": "assistant", "content": None, "reasoning_content": summary,
               "imported": {**where, "item": kind, "encrypted": "encrypted_content" in item}}, line, stamp)
    else:
        p.ignore(f"response_item:{kind}")


def parse(data: bytes, name: str) -> Parsed:
    """The conversation of one Codex rollout file (decompressed already if it was ``.zst``)."""
    p = Parsed(FORMAT, name, None)
    for line, rec in jsonl_records(data, name):
        kind = rec.get("type")
        if kind == "session_meta":
            payload = need(rec, "payload", dict, name, line, "a session_meta line")
            if isinstance(payload.get("id"), str) and p.agent_session_id is None:
                p.agent_session_id = payload["id"]
                p.meta = {k: payload[k] for k in ("cwd", "cli_version", "originator", "model_provider")
                          if k in payload}
        elif kind == "response_item":
            _item(p, need(rec, "payload", dict, name, line, "a response_item line"), line, rec.get("timestamp"))
        else:
            p.ignore(str(kind))
    return p
