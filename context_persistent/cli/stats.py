"""``stats``: facts about a session (events, bytes, tokens per view, tokenizer, the request view at a budget,
the last compaction recorded in the log)."""

from __future__ import annotations

import argparse
from typing import Any

from . import backend_of
from .common import _open
from .output import human_size, print_json, short_time, table

async def _last_compaction(store: Any) -> dict[str, Any] | None:
    """The newest compaction audit record in the log, if any (found without loading views again), in the
    shape of ``stats()["last_compaction"]``: ``at_seq`` (the head it was made at), ``ts``, then its fields."""
    kinds = [k for k in store.stats()["events"] if "compact" in k]
    if not kinds:
        return None
    from ..storage.backends import open_log

    last = None
    log = await open_log(store.storage_path, store.session_id, store.config, readonly=True)
    try:
        last = _newest_backwards(log, kinds)
        if last is None:  # (no file log, none found, or a line that does not decode: the forward read says why)
            async for batch in log.read_batches():
                for rec in batch:
                    if rec["type"] in kinds:
                        last = rec
    finally:
        await log.close()
    if last is None:
        return None
    data = last["data"] if isinstance(last.get("data"), dict) else {}
    return {"at_seq": last["seq"] - 1, "ts": last["ts"], "seq": last["seq"], **data}


def _newest_backwards(log: Any, kinds: list[str]) -> dict[str, Any] | None:
    """The newest record of a type in ``kinds``, read from the end of a file log backwards (the one a
    session's stats look for is usually among its last records); None when the log is not a file log,
    holds none, or a line on the way fails to decode (the caller then reads forwards, which reports it)."""
    from ..model import codec
    from ..storage.log import FileEventLog

    if not isinstance(log, FileEventLog) or not isinstance(log.position, int):
        return None
    wanted = [f'"type":"{k}"'.encode() for k in kinds]
    with log.reader() as reader:
        position = log.position
        while position > 0:
            line = reader.line_ending_at(position)
            if not line.endswith(b"\n"):
                return None
            position -= len(line)
            if any(w in line for w in wanted):  # (a cheap filter; the record is decoded and checked below)
                try:
                    rec = codec.decode(line)
                except (codec.RecordError, ValueError):
                    return None
                if rec.get("type") in kinds:
                    return rec
    return None


def _describe_compaction(d: dict[str, Any]) -> str:
    text = f"seq {d['seq']} at {short_time(d['ts'])}" if "seq" in d else f"at seq {d.get('at_seq')}"
    if "before_tokens" in d:
        at_least = "at least " if d.get("before_tokens_exact") is False else ""  # a windowed rebuild
        text += (f": {d.get('strategy_used')}, {at_least}{d['before_tokens']:,} -> {d.get('after_tokens', 0):,} tokens "
                 f"at a {d.get('budget', 0):,}-token budget ({d.get('budget_source')}); "
                 f"{d.get('outputs_masked', 0)} masked, {d.get('groups_dropped', 0)} groups dropped, "
                 f"{d.get('truncated', 0)} truncated")
    return text


async def _stats(args: argparse.Namespace) -> int:
    from ..transfer.snapshot import history_messages
    from ..model.views import REASONING_ROLES, text_only

    async with await _open(args, args.session) as store:
        count = store._counter.count_message
        # The history's total is kept with its checkpoint (no message read); the conversation and reasoning
        # views are counted only when asked: that tokenises the whole history.
        views = {"full": await store.get_token_count()}
        if args.tokens:
            views.update(conversation=0, reasoning=0)
            # Each message's count is kept with the history (packed; the checkpoint records them): a message
            # is tokenised here only when it was not counted yet, or when the conversation view changes it.
            known = store._full().tokens.copy()  # (taken with iter_messages' snapshot: the same messages)
            i = 0
            async for m in history_messages(store):  # one pass, a message at a time: the history is never held
                role = m.get("role")
                cached = known[i] if i < len(known) else None
                i += 1
                n = (cached if cached is not None else count(m)) if role in REASONING_ROLES else 0
                views["reasoning"] += n
                if role in ("user", "assistant"):
                    kept = text_only(m)
                    if kept is not None:
                        views["conversation"] += n if kept == m else count(kept)
        budget, source = store.resolve_budget(args.budget)
        request = await store.get_messages_for_request(token_budget=args.budget)
        views["request"] = sum(count(m) for m in request)
        recorded = await _last_compaction(store)
        session = dict(store._state.session)
        st = store.stats()  # after the request view: its last_compaction is that view's, if it compacted
    if st["bytes"] is None and backend_of(args):  # PostgreSQL: the bytes of the session's records
        from ..storage.pg import session_bytes

        st["bytes"] = await session_bytes(args.dsn, backend_of(args).get("pg_schema"), args.session)
    # Everything store.stats() returns, as it returns it, then what only the command line adds.
    out = {**st, "tokens_per_view": views, "request_messages": len(request), "budget": budget,
           "budget_source": source, "recorded_compaction": recorded,
           "parent": session.get("parent"), "imported": session.get("imported")}
    if args.json:
        print_json(out)
        return 0
    rows = [["session", st["session_id"]], ["log", st["path"]], ["events", f"{st['head_seq']} (" + ", ".join(
        f"{k} {v}" for k, v in sorted(st["events"].items())) + ")"],
            ["bytes", f"{st['bytes']} ({human_size(st['bytes'])})"], ["messages", st["messages"]],
            ["pinned", st["pinned"]],
            ["tokenizer", st["tokenizer"] + ("" if st["tokenizer_exact"] else " (estimate)")]]
    rows += [[f"tokens: {k}", v] for k, v in views.items()]
    if not args.tokens:
        rows.append(["tokens: other views", "not counted (--tokens counts the conversation and reasoning views)"])
    made = st["last_compaction"]
    rows.append(["request view", f"{len(request)} messages at a {budget}-token budget ({source})"
                 + ("" if made is None else f"; compacted: {made.get('strategy_used')}, "
                    f"{made.get('before_tokens', 0):,} -> {made.get('after_tokens', 0):,} tokens")])
    rows.append(["last compaction", "none recorded" if recorded is None else _describe_compaction(recorded)])
    src, last = st["sources"], st["last_usage"]  # where the numbers come from (docs/tokens.md)
    rows.append(["token sources", f"counts {src['tokens']}; budget {src['budget']}"])
    if last is not None:
        rows.append(["last usage", f"{last.get('input_tokens')} in / {last.get('output_tokens')} out "
                     f"({last.get('provider')}, {last.get('model')}): reported by the provider"])
    if session.get("parent"):
        rows.append(["forked from", f"{session['parent'].get('session_id')} at seq {session['parent'].get('seq')}"])
    if session.get("imported"):
        imp = session["imported"]
        rows.append(["imported from", f"{imp.get('source')} {imp.get('path')}"])
    print(table(["", ""], rows).split("\n", 1)[1])
    return 0
