"""A session's messages as the viewer shows them: a page of a view, the request view set against the full
history (what compaction kept, dropped, masked, truncated or summarised), and the tokens over the session.

Pages are read by position in the history (the projection's packed refs, keys and token counts: only the
page's messages are read from the log), so a million-message session shows its first or last page as fast
as a short one. The conversation and reasoning views are the full history's page filtered as
``views.py`` filters it; the page says how many of its messages the view leaves out.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from ..model.projection import make_key, split_key
from ..model.views import REASONING_ROLES, text_only
from .shaping import message_entry, tool_call_ids, tool_result_ids

VIEWS = ("full", "conversation", "reasoning", "request")
#: The most messages one page may hold, and the points of the token chart.
PAGE_MAX, CHART_POINTS = 1000, 600
#: A history no longer than this has its uncounted messages counted for the chart without being asked.
COUNT_WITHOUT_ASKING = 20_000
#: A changed message of the request view is matched with its original when the gap holding it is this small.
MATCH_GAP = 64


def _check_page(start: int | None, limit: int, total: int) -> tuple[int, int]:
    if not 1 <= limit <= PAGE_MAX:
        raise ValueError(f"limit must be between 1 and {PAGE_MAX}, got {limit}")
    if start is None:
        start = max(0, total - limit)
    if start < 0:
        raise ValueError(f"start must be a message position >= 0, got {start}")
    return start, min(total, start + limit)


def messages_page(store: Any, view: str, start: int | None, limit: int) -> dict[str, Any]:
    """Messages ``start``..``start+limit`` of the full history (the last page when ``start`` is None), as
    ``view`` (full, conversation or reasoning) shows them."""
    if view not in VIEWS[:3]:
        raise ValueError(f"view must be one of full, conversation, reasoning (request has its own page), got {view!r}")
    state = store._state
    total = len(state.messages)
    start, end = _check_page(start, limit, total)
    messages = state.messages[start:end] if end > start else []
    keys = state.keys[start:end]
    tokens = list(state.tokens[start:end])
    pinned = state.pinned
    items = []
    for offset, m in enumerate(messages):
        role = m.get("role")
        if view == "reasoning" and role not in REASONING_ROLES:
            continue
        if view == "conversation":
            if role not in ("user", "assistant"):
                continue
            m = text_only(m)
            if m is None:
                continue
        key = keys[offset]
        items.append({"index": start + offset, "seq": split_key(key)[0], "key": key, "pinned": key in pinned,
                      "tokens": tokens[offset], **message_entry(m)})
    return {"view": view, "total": total, "start": start, "end": end, "head_seq": store.head_seq,
            "left_out": (end - start) - len(items), "items": items}


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(b.get("text", b.get("content", ""))) for b in content if isinstance(b, dict))[:2000]
    return ""


def _kind(message: Any) -> str:
    """What a request-view message that is not one of the history's unchanged is."""
    text = _text(message)
    if text.startswith("[context-persistent: summary of"):
        return "summary"
    if text.startswith("[context-persistent:"):
        return "note"
    if "[tool output masked by context-persistent" in text:
        return "masked"
    if "[... truncated by context-persistent" in text:
        return "truncated"
    if "[no result recorded for tool" in text:
        return "placeholder"
    return "changed"


def _same_slot(a: Any, b: Any) -> bool:
    return (isinstance(a, dict) and isinstance(b, dict) and a.get("role") == b.get("role")
            and tool_result_ids(a) == tool_result_ids(b) and tool_call_ids(a) == tool_call_ids(b))


def _view_stats(store: Any) -> dict[str, Any] | None:
    cached = store._view_cache
    if not cached:
        return None
    view = cached[3].view if cached[3] is not None else cached[4]
    return dict(getattr(view, "stats", None) or {}) or None


async def request_compare(store: Any, budget: int | None) -> dict[str, Any]:
    """The request view at ``budget`` (the store's configured budget when None), each message with the
    history position it comes from (``source``) and what it is (``kind``: kept, note, summary, masked,
    truncated, placeholder, changed), and the history positions it keeps, changes and leaves out."""
    from ..transfer.snapshot import request_sources

    used, budget_source = store.resolve_budget(budget)
    messages = await store.get_messages_for_request(token_budget=budget)
    sources = await request_sources(store, messages)
    state = store._state
    total = len(state.messages)
    kept = [s for s in sources if s is not None]
    count = store._counter.count_message
    out: list[dict[str, Any]] = []
    changed: dict[int, int] = {}
    prev = -1
    for pos, (m, src) in enumerate(zip(messages, sources)):
        entry: dict[str, Any] = {"pos": pos, "source": src, "tokens": count(m), **message_entry(m)}
        if src is not None:
            entry.update(kind="kept", seq=split_key(state.keys[src])[0])
            prev = src
        else:
            entry["kind"] = _kind(m)
            if entry["kind"] not in ("note", "summary"):
                nxt = next((s for s in sources[pos + 1:] if s is not None), total)
                if nxt - prev - 1 <= MATCH_GAP:  # (a masked result sits right after its kept call)
                    for i in range(prev + 1, nxt):
                        if i not in changed and _same_slot(state.messages[i], m):
                            changed[i] = pos
                            entry.update(source=i, seq=split_key(state.keys[i])[0])
                            prev = i
                            break
        out.append(entry)
    window = store._views.window
    summarised = any(e["kind"] == "summary" for e in out)
    return {"budget": used, "budget_source": budget_source, "history_messages": total,
            "head_seq": store.head_seq, "messages": out, "kept": kept,
            "changed": {str(k): v for k, v in changed.items()}, "summarised": summarised,
            "tokens": sum(e["tokens"] for e in out), "stats": _view_stats(store),
            "window": None if window is None else {"start": window.start, "omitted": window.omitted}}


async def token_series(store: Any, *, budget: int | None, count_missing: bool, marks: list[dict[str, Any]],
                       usage: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The tokens of the history per message (summed over runs of messages when there are more than the
    chart's points) and cumulative, the budget, the compactions recorded in the log (``marks``: the
    notable events, timeline.py) placed at the history position of their seq, and the provider's reports
    (``usage``, usage.py) each placed (``at``) after the last message of the request it answers."""
    state = store._state
    total = len(state.messages)
    missing = state.tokens.count(None) if total else 0
    if missing and (count_missing or total <= COUNT_WITHOUT_ASKING):
        await store.get_token_count()  # (counts the missing ones off the event loop, a run at a time)
        state = store._state
        missing = state.tokens.count(None)
    tokens, keys = state.tokens, state.keys
    step = max(1, math.ceil(total / CHART_POINTS))
    points, running = [], 0
    for start in range(0, total, step):
        chunk = tokens[start:start + step]
        known = [t for t in chunk if t is not None]
        running += sum(known)
        points.append({"start": start, "end": min(total, start + step), "tokens": sum(known),
                       "cumulative": running, "uncounted": len(chunk) - len(known),
                       "seq": split_key(keys[min(total, start + step) - 1])[0]})
    compactions = [m for m in marks if m.get("type") == "compacted" and m["seq"] <= store.head_seq]
    _place(compactions, keys)
    reports = None
    if usage is not None:
        reports = [dict(u, at=_position(keys, u.get("request_seq") or u["seq"])) for u in usage
                   if u["seq"] <= store.head_seq]
    recorded = recorded_budget(marks)
    used, source = store.resolve_budget(budget if budget is not None else recorded)
    return {"messages": total, "per_point": step, "points": points, "total": running, "uncounted": missing,
            "budget": used, "budget_source": "recorded" if budget is None and recorded else source,
            "tokenizer": store.tokenizer, "head_seq": store.head_seq,
            "compactions": [{"seq": c["seq"], "ts": c.get("ts"), "at": c["at"], "data": c.get("data")}
                            for c in compactions],
            "usage": reports}


def _position(keys: Any, seq: int) -> int:
    """How many messages of the history were added at or before ``seq`` (keys are sorted)."""
    return bisect.bisect_left(keys, make_key(seq + 1))


def recorded_budget(marks: list[dict[str, Any]]) -> int | None:
    """The budget of the newest compaction recorded in the log (what the agent asked for), if any."""
    for m in reversed(marks):
        data = m.get("data")
        if m.get("type") == "compacted" and isinstance(data, dict):
            value = data.get("budget")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _place(events: list[dict[str, Any]], keys: Any) -> None:
    """Set each event's ``at``: the history position of the first message added after it (one pass over
    the keys; events sorted by seq)."""
    pending = sorted(events, key=lambda e: e["seq"])
    j = 0
    limit = make_key(pending[0]["seq"] + 1) if pending else 0
    for i, key in enumerate(keys if pending else ()):
        while j < len(pending) and key >= limit:
            pending[j]["at"] = i
            j += 1
            if j < len(pending):
                limit = make_key(pending[j]["seq"] + 1)
        if j == len(pending):
            break
    for e in pending[j:]:
        e["at"] = len(keys)
