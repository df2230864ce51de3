"""Read views projected from the full history (pure).

- Conversation view: the thread a person reads. User messages and assistant *text* only. Tool calls
  (OpenAI ``tool_calls``), tool results (``role: "tool"``/``"function"``), Anthropic ``tool_use`` and
  ``tool_result`` blocks, and thinking blocks are left out; a message left with no text is dropped.
  System and developer messages are not part of the conversation.
- Reasoning view: the conversation plus the tool traces, whole: every user, assistant, tool and function
  message, unchanged. Only system and developer messages are left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_TOOL_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "server_tool_use",
                          "web_search_tool_result"})
REASONING_ROLES = frozenset({"user", "assistant", "tool", "function"})


def text_only(message: dict[str, Any]) -> dict[str, Any] | None:
    content = message.get("content")
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "function_call")}
    if isinstance(content, list):
        kept = [b for b in content if not (isinstance(b, dict) and b.get("type") in _TOOL_BLOCKS)]
        if not kept:
            return None
        out["content"] = kept
    elif content is None or content == "":
        return None
    return out


def conversation_view(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    result = []
    for m in messages:
        if m.get("role") in ("user", "assistant"):
            kept = text_only(m)
            if kept is not None:
                result.append(kept)
    return result


def reasoning_view(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") in REASONING_ROLES]
