"""What the viewer's API sends for records and messages: the stored JSON, clipped to a size a page can show,
with redacted messages left out (pure: no I/O).

Clipping keeps the JSON's shape: a string longer than ``limit`` becomes ``{"$clipped": its first limit
characters, "more": how many were left out}`` and a list longer than ``items`` ends with ``{"$more_items":
n}``; the page shows what was left out and a link to the whole record. Nothing here makes HTML: the page
puts every value into the document as text (docs/viewer.md, "Hostile content").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


from ..model import events as ev
from ..model.projection import make_key

#: Characters of one string, and items of one list, sent in a page (the whole record is a click away).
STRING_LIMIT = 4000
ITEM_LIMIT = 200
#: Record types that hold messages in ``data.messages`` (each message's key is ``seq << 20 | index``).
LIST_TYPES = frozenset({ev.MESSAGES_REPLACED, ev.SYSTEM_PROMPT_SET})


def clip(value: Any, limit: int = STRING_LIMIT, items: int = ITEM_LIMIT) -> Any:
    """``value`` with long strings and lists cut (see the module's docstring); a new object."""
    t = type(value)
    if t is str:
        return value if len(value) <= limit else {"$clipped": value[:limit], "more": len(value) - limit}
    if t is list:
        out = [clip(v, limit, items) for v in value[:items]]
        if len(value) > items:
            out.append({"$more_items": len(value) - items})
        return out
    if t is dict:
        return {str(k)[:limit]: clip(v, limit, items) for k, v in value.items()}
    return value


Hidden = Callable[[int, Any], bool]


def message_slots(rec: dict[str, Any]) -> list[tuple[int, Any]]:
    """``(index, message)`` of each message a record holds (an erased slot is None)."""
    data = rec.get("data")
    if not isinstance(data, dict):
        return []
    if rec.get("type") == ev.MESSAGE_ADDED:
        return [(0, data.get("message"))]
    if rec.get("type") in LIST_TYPES or (rec.get("type") == ev.ERASED and data.get("of") in LIST_TYPES):
        messages = data.get("messages")
        return list(enumerate(messages)) if isinstance(messages, list) else []
    return []


def shape_record(rec: dict[str, Any], hidden: Hidden | None = None, limit: int = STRING_LIMIT) -> dict[str, Any]:
    """A record as a page shows it: ``seq``, ``ts``, ``type``, its ``data`` clipped, and for a record that holds
    messages, ``messages``: ``{"index", "key", "message"}`` each, or ``{"index", "key", "redacted": true}``
    for one that a redaction hides (its text never leaves the server)."""
    seq = rec.get("seq")
    out: dict[str, Any] = {"seq": seq, "ts": rec.get("ts"), "type": rec.get("type")}
    slots = message_slots(rec)
    data = rec.get("data")
    if slots and isinstance(data, dict):
        shown = []
        for i, m in slots:
            key = make_key(int(seq or 0), i)
            if m is None:
                shown.append({"index": i, "key": key, "erased": True})
            elif hidden is not None and hidden(key, m):
                shown.append({"index": i, "key": key, "redacted": True})
            else:
                shown.append({"index": i, "key": key, **message_entry(m, limit)})
        out["messages"] = shown
        data = {k: v for k, v in data.items() if k not in ("message", "messages")}
    out["data"] = clip(data, limit)
    return out


def message_entry(message: Any, limit: int = STRING_LIMIT) -> dict[str, Any]:
    """``{"message": clipped, "calls": [ids], "answers": [ids]}``: the message and the tool calls it makes and
    answers, so the page pairs calls with results without knowing the formats (grouping.py's)."""
    out: dict[str, Any] = {"message": clip(message, limit)}
    calls, answers = tool_call_ids(message), tool_result_ids(message)
    if calls:
        out["calls"] = calls
    if answers:
        out["answers"] = answers
    return out


def tool_call_ids(message: Any) -> list[str]:
    """The ids of the tool calls an assistant message makes, in every format grouping.py reads."""
    if not isinstance(message, dict):
        return []
    ids = []
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict) and call.get("id") is not None:
            ids.append(str(call["id"]))
    content = message.get("content")
    if isinstance(content, list):
        for b in content:
            if isinstance(b, dict) and b.get("type") in ("tool_use", "tool_call") and b.get("id") is not None:
                ids.append(str(b["id"]))
    return list(dict.fromkeys(ids))


def tool_result_ids(message: Any) -> list[str]:
    """The ids of the tool calls a message answers (a ``tool`` message, or ``tool_result`` blocks)."""
    if not isinstance(message, dict):
        return []
    ids = []
    if message.get("tool_call_id") is not None:
        ids.append(str(message["tool_call_id"]))
    content = message.get("content")
    if isinstance(content, list):
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                got = b.get("tool_use_id", b.get("tool_call_id"))
                if got is not None:
                    ids.append(str(got))
    return ids
