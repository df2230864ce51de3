"""Masking and importance tests on single messages, for ``smart`` (pure)."""

from __future__ import annotations

from typing import Any

from ..grouping import result_block_id, result_key
from ._base import Message

_ERROR_WORDS = ("error", "traceback", "exception", "failed")
_DECISION_WORDS = ("decid", "decision", "conclu", "plan", "agreed", "we will", "i will")


def mask_text(tokens: int, name: str, call_id: str) -> str:
    """The placeholder that replaces a masked tool output."""
    return (
        f"[tool output masked by context-persistent: {tokens:,} tokens from tool '{name}' ({call_id}); "
        "full text in the event log]"
    )


def head_text(message: Message, limit: int = 1000) -> str:
    """The first ``limit`` characters of a message's text (cheap: never joins a huge content)."""
    content = message.get("content")
    if isinstance(content, str):
        return content[:limit]
    parts: list[str] = []
    for block in content if isinstance(content, list) else ():
        if isinstance(block, dict):
            inner = block.get("text", block.get("content", block.get("output")))
            if isinstance(inner, str):
                parts.append(inner[:limit])
    return " ".join(parts)[:limit]


def is_error(message: Message) -> bool:
    """A tool result flagged ``is_error`` or whose opening text reports an error."""
    content = message.get("content")
    blocks = content if isinstance(content, list) else ()
    if any(isinstance(b, dict) and b.get("is_error") for b in blocks):
        return True
    if result_key(message) is None and not any(result_block_id(b) is not None for b in blocks):
        return False
    head = head_text(message, 300).lower()
    return any(w in head for w in _ERROR_WORDS)


def masked_copy(message: Message, tokens: int, names: dict[str, str]) -> Message | None:
    """A copy of a tool-result message with its outputs replaced by placeholders (None if not one)."""
    key = result_key(message)
    if key is not None:
        call_id = key.removeprefix("function:")
        return {**message, "content": mask_text(tokens, names.get(key, str(message.get("name") or "?")), call_id)}
    content = message.get("content")
    if not isinstance(content, list) or not any(result_block_id(b) is not None for b in content):
        return None
    sizes = [len(head_text({"content": [b]}, 10**9)) for b in content]
    total = max(sum(sizes), 1)
    new: list[Any] = []
    for block, size in zip(content, sizes):
        block_id = result_block_id(block)
        if block_id is None:
            new.append(block)
            continue
        field = "output" if "output" in block and "content" not in block else "content"
        est = max(1, round(tokens * size / total))
        new.append({**block, field: mask_text(est, names.get(block_id, "?"), block_id)})
    return {**message, "content": new}


def is_decision(message: Message) -> bool:
    """An assistant message whose opening text states a decision, plan or conclusion."""
    return message.get("role") == "assistant" and any(w in head_text(message).lower() for w in _DECISION_WORDS)
