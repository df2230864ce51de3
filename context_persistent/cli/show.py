"""``show``: print a session's messages, one view of them, now or as of any event (``--at``), streamed from
the history (the request view, bounded by its budget, as a list), as a table or as JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncGenerator
from typing import Any

from . import UsageError
from .common import _open
from .output import message_text, paint, role_label, use_colour

VIEWS = ("full", "conversation", "reasoning", "request")


async def _request_view(store: Any, budget: int | None) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The request view and its messages' seqs (snapshot.request_sources: read from the history messages the
    view can hold; the seq of a message is in its key)."""
    from ..model.projection import split_key
    from ..transfer.snapshot import request_sources

    messages = await store.get_messages_for_request(token_budget=budget)
    keys = store._state.keys
    return messages, [None if i is None else split_key(keys[i])[0] for i in await request_sources(store, messages)]


async def _streamed(store: Any, view: str) -> AsyncGenerator[tuple[dict[str, Any], int], None]:
    """(message, seq) for each message of ``view`` (full, conversation or reasoning), one at a time."""
    from ..model.projection import split_key
    from ..transfer.snapshot import history_messages
    from ..model.views import REASONING_ROLES, text_only

    keys = store._full().keys
    i = -1
    async for m in history_messages(store):
        i += 1
        if view == "reasoning" and m.get("role") not in REASONING_ROLES:
            continue
        if view == "conversation":
            if m.get("role") not in ("user", "assistant"):
                continue
            kept = text_only(m)
            if kept is None:
                continue
            m = kept
        yield m, split_key(keys[i])[0]


async def _show(args: argparse.Namespace) -> int:
    view = args.view or ("request" if args.budget is not None else "full")
    if args.budget is not None and view != "request":
        raise UsageError("--budget applies to --view request only")
    if args.last is not None and args.last < 0:
        raise UsageError(f"-n/--last must be >= 0, got {args.last}")
    async with await _open(args, args.session) as store:
        head = store.head_seq
        target = await store.at(args.at) if args.at is not None else store
        try:
            await _show_view(args, target, view, head)
        finally:
            if target is not store:
                await target.close()
    return 0


async def _show_view(args: argparse.Namespace, store: Any, view: str, head: int) -> None:
    """Print ``view`` of ``store``: the request view (bounded by its budget) as a list; the others streamed
    from the history (a first pass counts a filtered view; ``-n`` keeps only the last N)."""
    seq = store.head_seq
    pairs: Any
    if view == "request":
        messages, seqs = await _request_view(store, args.budget)
        total = len(messages)
        first = max(0, total - args.last) if args.last is not None else 0
        pairs = _listed(list(zip(messages, seqs))[first:])
    else:
        if view == "full":
            total = len(store._state.messages)  # (known without loading a lazily opened history)
        else:
            total = 0
            async for _ in _streamed(store, view):
                total += 1
        first = max(0, total - args.last) if args.last is not None else 0
        pairs = _skip(_streamed(store, view), first) if view != "full" or first == 0 else _last(store, total, first)
    fixed = {"session_id": args.session, "view": view, "at_seq": args.at, "seq": seq, "head_seq": head,
             "token_budget": args.budget, "total_messages": total, "first_index": first}
    if args.json:
        await _show_json(fixed, pairs)
        return
    on = use_colour(sys.stdout)
    at = f" as of seq {seq}" if args.at is not None else ""
    shown = f" (the last {total - first})" if first else ""
    print(paint(f"session {args.session} · view {view} · {total} messages{shown}{at} (log head seq {head})",
                "1", on))
    limit = None if args.full else 300
    width = max(3, len(str(seq)))
    print(paint(f"{'#':>5}  {'SEQ':>{width}}  {'ROLE':<9}  MESSAGE", "2", on))
    indent = " " * (5 + 2 + width + 2 + 9 + 2)
    i = first
    async for m, mseq in pairs:
        text = message_text(m, limit, "; --full shows all").rstrip().replace("\n", "\n" + indent)
        sys.stdout.write(f"{i:>5}  {'-' if mseq is None else mseq:>{width}}  {role_label(str(m.get('role')), on)}"
                         f"  {text}\n")
        i += 1
    sys.stdout.flush()


async def _show_json(fixed: dict[str, Any], pairs: Any) -> None:
    """The JSON of ``show``, written as it goes: the messages, then their seqs (kept as 8-byte integers)."""
    from array import array

    from ..transfer.snapshot_codec import JsonWriter

    writer = JsonWriter(fixed, "messages")
    seqs = array("q")
    out = sys.stdout.buffer
    async for m, mseq in pairs:
        out.write(writer.item(m))
        seqs.append(-1 if mseq is None else mseq)
    out.write(writer.end({"message_seqs": [None if x < 0 else x for x in seqs]}))
    out.flush()


async def _listed(items: list[Any]) -> AsyncGenerator[Any, None]:
    for item in items:
        yield item


async def _skip(items: AsyncGenerator[Any, None], n: int) -> AsyncGenerator[Any, None]:
    async for item in items:
        if n:
            n -= 1
            continue
        yield item


async def _last(store: Any, total: int, first: int) -> AsyncGenerator[tuple[dict[str, Any], int], None]:
    """The full view's messages from index ``first`` (a lazily opened store serves them from what it holds)."""
    from ..model.projection import split_key

    keys = store._state.keys
    for offset, m in enumerate(await store.get_messages(last=total - first)):
        yield m, split_key(keys[first + offset])[0]
