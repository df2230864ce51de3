"""Reading commands: ``ls``, ``show``, ``stats``, ``tail``. They open sessions read-only (no lock), so they
work while an agent is writing; what they show is the log as it was when they opened it (``tail -f`` then
follows what is appended)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from . import UsageError, backend_of, require_storage, storage_info, storage_of

VIEWS = ("full", "conversation", "reasoning", "request")
_ROLE_COLOURS = {"system": "35", "developer": "35", "user": "32", "assistant": "36", "tool": "33",
                 "function": "33"}


# -- output helpers (shared with transfer.py) -------------------------------------------------------
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
    sys.stdout.buffer.write(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n")
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
            elif b.get("type") == "text":
                parts.append(str(b.get("text", "")))
            elif b.get("type") in ("tool_use", "tool_call"):  # Anthropic's block, Amplifier's ToolCallBlock
                shown_calls.add(b.get("id"))
                parts.append(f"→ {b.get('name')}({orjson.dumps(b.get('input')).decode()})  [{b.get('id')}]")
            elif b.get("type") == "tool_result":
                inner = b.get("content", b.get("output"))
                if isinstance(inner, list):
                    inner = " ".join(str(x.get("text", x)) if isinstance(x, dict) else str(x) for x in inner)
                elif not isinstance(inner, str):
                    inner = orjson.dumps(inner).decode()
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
            args = orjson.dumps(args).decode()
        parts.append(f"→ {name}({args})  [{call.get('id')}]")
    if m.get("tool_call_id"):
        parts[0:0] = [f"← [{m['tool_call_id']}]"]
    text = "\n".join(p for p in parts if p)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit} more characters{hint})"
    return text


async def _open(args: argparse.Namespace, session: str) -> Any:
    from ..store.manager import PersistentContextManager

    return await PersistentContextManager.open(storage_path=require_storage(args), session_id=session,
                                               readonly=True, **backend_of(args))


# -- ls ---------------------------------------------------------------------------------------------
def _last_ts(log_path: Path) -> str | None:
    """The timestamp of the last complete record (read from the file's end; no full scan)."""
    from ..model import codec
    from ..storage.log import data_end

    try:
        with open(log_path, "rb") as f:
            size = data_end(f.fileno())
            back = min(size, 1 << 16)
            f.seek(size - back)
            chunk = f.read(back)
    except OSError:
        return None
    for line in reversed(chunk.split(b"\n")[1:-1] if back < size else chunk.split(b"\n")):
        try:
            return str(codec.decode(line)["ts"])
        except (ValueError, KeyError):
            continue
    if size == 0:  # an active segment just started: the last record ends the last sealed segment
        from ..storage.segments import LogReader

        try:
            with LogReader(log_path.parent) as reader:
                return str(codec.decode(reader.line_ending_at(reader.base))["ts"]) if reader.base else None
        except (OSError, ValueError, KeyError):
            return None
    return None


def _log_bytes(log: Any) -> int | None:
    """A file log's size: its sealed segments (uncompressed) and its active segment; None for a database."""
    size = getattr(log, "size", None)
    return None if size is None else int(size) + int(getattr(log, "base", 0))


def _iso(value: Any) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else (str(value) if value else None)


async def _ls(args: argparse.Namespace) -> int:
    from ..storage.paths import LOG_NAME

    rows: list[dict[str, Any]] = []
    problem = False
    ids: list[tuple[str, Path | None]]
    updated: dict[str, Any] = {}
    if backend_of(args):
        from ..storage import pg

        listed = await pg.list_sessions(args.dsn, backend_of(args).get("pg_schema"))
        ids = [(r["session_id"], None) for r in listed]
        updated = {r["session_id"]: r.get("updated_at") for r in listed}
    else:
        root = Path(require_storage(args))
        from ..storage.segments import has_log

        ids = sorted((d.name, d / LOG_NAME) for d in root.iterdir()
                     if not d.name.startswith(".") and has_log(d))
    for sid, log_path in ids:
        row: dict[str, Any] = {"session_id": sid}
        try:
            async with await _open(args, sid) as store:  # no token counting here: ls stays fast
                row.update(messages=len(store._state.messages), events=store.head_seq,
                           bytes=_log_bytes(store._log),
                           last_activity=_last_ts(log_path) if log_path else _iso(updated.get(sid)))
        except Exception as e:  # one unreadable session must not hide the others
            problem = True
            row["error"] = str(e)
        rows.append(row)
    where, source = _where(args)
    if args.json:
        print_json({"storage": where, "storage_source": source, "sessions": rows})
    elif not rows:
        print(f"no sessions in {where} (from {source})")
    else:
        print(f"storage {where} (from {source})")
        print(table(["SESSION", "MESSAGES", "EVENTS", "SIZE", "LAST ACTIVITY"],
                    [[r["session_id"], r.get("messages", "-"), r.get("events", "-"), human_size(r.get("bytes")),
                      short_time(r.get("last_activity")) if "error" not in r else "error: " + r["error"]]
                     for r in rows], right=(1, 2, 3)))
    return 1 if problem else 0


def _where(args: argparse.Namespace) -> tuple[str, str]:
    """What the command reads and where that setting came from (a redacted DSN and schema with --dsn)."""
    backend = backend_of(args)
    if backend:
        from ..storage.pg import redact_dsn, resolve_schema

        return f"{redact_dsn(args.dsn)} schema {resolve_schema(backend.get('pg_schema'))}", "--dsn"
    return storage_info(args)


# -- where ------------------------------------------------------------------------------------------
async def _where_cmd(args: argparse.Namespace) -> int:
    from ..storage.segments import has_log

    where, source = _where(args)
    info: dict[str, Any] = {"storage": where, "source": source,
                            "backend": "postgres" if backend_of(args) else "file"}
    if not backend_of(args):
        root = Path(where)
        info["exists"] = root.is_dir()
        info["sessions"] = sum(1 for d in root.iterdir() if not d.name.startswith(".")
                               and has_log(d)) if root.is_dir() else 0
    if args.json:
        print_json(info)
        return 0
    print(f"{where}")
    print(f"  from:     {source}")
    if "exists" in info:
        state = (f"{info['sessions']} session(s)" if info["exists"]
                 else "does not exist yet (the first session written creates it)")
        print(f"  contents: {state}")
    return 0


# -- show -------------------------------------------------------------------------------------------
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


# -- stats ------------------------------------------------------------------------------------------
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


# -- tail -------------------------------------------------------------------------------------------
def _summary(rec: dict[str, Any], on: bool, width: int = 100) -> str:
    data = rec.get("data") or {}
    kind = rec["type"]
    if kind == "message_added":
        m = data.get("message", {})
        return role_label(str(m.get("role")), on) + " " + message_text(m, width).replace("\n", " ⏎ ")
    if kind == "messages_replaced":
        why = data.get("reason")
        return f"{len(data.get('messages', []))} messages" + (f"; reason: {why}" if why else "")
    if kind == "system_prompt_set":
        prompts = [m for m in data.get("messages", []) if isinstance(m, dict)]
        text = " | ".join(message_text(m, width).replace("\n", " ⏎ ") for m in prompts)
        return f"system prompt ({data.get('source')}): {text}"[:width + 30]
    if kind == "replay_recognised":
        keys = data.get("keys")
        if not isinstance(keys, list):
            return f"{data.get('count')} replayed messages (audit only)"
        seqs = ", ".join(str(k >> 20) if isinstance(k, int) else "?" for k in keys)
        return f"{len(keys)} replayed messages folded out of the views (seq {seqs})"[:width + 30]
    if kind == "transcript_ignored":
        return f"set_messages of {data.get('count')} messages ignored ({data.get('kind')}): {data.get('reason')}"
    if kind == "erased":
        gone = ", ".join(f"index {e.get('index')} ({e.get('sha256', '')[:19]}…)" for e in data.get("erased", []))
        return f"tombstone of a {data.get('of')} record: erased {gone}" + (
            f"; reason: {data['reason']}" if data.get("reason") else "")
    if kind in ("pinned", "unpinned", "redacted"):
        return f"message of seq {data.get('seq')} (index {data.get('index')})"
    if kind == "session_started":
        extra = []
        if data.get("parent"):
            extra.append(f"fork of {data['parent'].get('session_id')} at seq {data['parent'].get('seq')}")
        if data.get("imported"):
            extra.append(f"imported {data['imported'].get('source')} ({data['imported'].get('messages')} messages)")
        return f"{data.get('program')} format {data.get('format')}, tokenizer {data.get('tokenizer')}" + (
            "; " + "; ".join(extra) if extra else "")
    return orjson.dumps(data).decode()[:width]


def _print_record(rec: dict[str, Any], as_json: bool, on: bool) -> None:
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(rec) + b"\n")
    else:
        sys.stdout.write(f"{rec['seq']:>6}  {short_time(rec.get('ts'))}  {rec['type']:<18} {_summary(rec, on)}\n")
    sys.stdout.flush()


async def _tail(args: argparse.Namespace) -> int:
    from ..errors import SessionNotFoundError
    from ..storage.backends import open_log
    from ..store.manager import PersistentContextManager

    if args.lines < 0:
        raise UsageError("-n must be >= 0")
    if args.after is not None and args.after < 0:
        raise UsageError("--after must be >= 0")
    on = use_colour(sys.stdout)
    cfg = PersistentContextManager.check_config(backend_of(args))
    last = args.after or 0
    try:
        # Without -f a missing storage folder is an error; -f waits for the session (and so its folder).
        storage = storage_of(args) if args.follow else require_storage(args)
        log = await open_log(storage, args.session, cfg, readonly=True)
    except SessionNotFoundError:
        if not args.follow:
            raise
        log = None
        where, source = storage_info(args)
        print(f"waiting for session {args.session!r} to be created in {where} (from {source})…", file=sys.stderr)
    try:
        if log is not None:
            anchor_seq, position = _tail_anchor(log, args.after, args.lines)
            last = max(last, anchor_seq)
            if args.after is not None:  # every event after SEQ
                async for batch in log.read_batches(after_seq=anchor_seq, position=position):
                    for rec in batch:
                        if rec["seq"] > args.after:
                            _print_record(rec, args.json, on)
                            last = rec["seq"]
            else:  # the last N events
                recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=args.lines)
                async for batch in log.read_batches(after_seq=anchor_seq, position=position):
                    recent.extend(batch)
                    last = batch[-1]["seq"]
                for rec in recent:
                    _print_record(rec, args.json, on)
        if not args.follow:
            return 0
        if args.until_seq is not None and last >= args.until_seq:
            return 0
        await _follow(args, log, last, on, cfg)
    finally:
        if log is not None:
            await log.close()
    return 0


def _tail_anchor(log: Any, after: int | None, lines: int) -> tuple[int, int | None]:
    """``(seq, position)`` to read a file log on from (``read_batches``): right after record ``after``, or before
    its last ``lines`` records, found without reading what comes before (segments.py, ``LogReader.anchor_for``
    and ``anchor_before_last``); ``(0, None)``: read from the start. A database log reads after ``after`` by
    itself; its seqs have no gaps, so its last ``lines`` records follow seq ``last_seq - lines``."""
    from ..storage.log import FileEventLog

    if not isinstance(log, FileEventLog):
        if after is None and type(log).__name__ == "PostgresEventLog":
            return max(0, log.position - lines), None
        return after or 0, None
    with log.reader() as reader:
        found = reader.anchor_for(after) if after is not None else reader.anchor_before_last(lines, log.position)
    return found if found is not None else (0, None)


async def _follow(args: argparse.Namespace, log: Any, after: int, on: bool, cfg: dict[str, Any]) -> None:
    if log is not None:
        stream = log.follow(after)
    elif backend_of(args):
        stream = _created_then_followed(args, cfg, after)
    else:
        from ..storage.follow import follow_file
        from ..storage.paths import LOG_NAME, session_dir

        stream = follow_file(session_dir(storage_of(args), args.session) / LOG_NAME, after)
    try:
        async with asyncio.timeout(args.timeout), contextlib.aclosing(stream) as records:
            async for rec in records:
                _print_record(rec, args.json, on)
                if args.until_seq is not None and rec["seq"] >= args.until_seq:
                    return
    except TimeoutError:
        return  # --timeout elapsed: a normal end


async def _created_then_followed(args: argparse.Namespace, cfg: dict[str, Any], after: int
                                 ) -> AsyncGenerator[dict[str, Any], None]:
    """A database session that does not exist yet: open it once it does (polled), then follow it."""
    from ..errors import SessionNotFoundError
    from ..storage.backends import open_log

    while True:
        try:
            log = await open_log(storage_of(args), args.session, cfg, readonly=True)
            break
        except SessionNotFoundError:
            await asyncio.sleep(0.25)
    records = log.follow(after)
    try:
        async for rec in records:
            yield rec
    finally:
        aclose = getattr(records, "aclose", None)
        if aclose is not None:
            await aclose()
        await log.close()


# -- registration -----------------------------------------------------------------------------------
def _run(coro_fn: Any) -> Any:
    return lambda args: asyncio.run(coro_fn(args))


def _whole_number(what: str) -> Any:
    """An argparse type: an integer >= 1, with ``what`` named in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected {what} (an integer >= 1), got {text!r}")
        return value

    return parse


_seq = _whole_number("an event seq")
_positive = _whole_number("a positive integer")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _parser(sub: Any, common: argparse.ArgumentParser, name: str, help_: str, examples: str) -> Any:
    return sub.add_parser(name, parents=[common], help=help_, description=help_,
                          epilog="examples:\n" + examples, formatter_class=argparse.RawDescriptionHelpFormatter)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, common, "ls", "list sessions: messages, events, size on disk, last activity",
                "  context-persistent ls\n  context-persistent ls --storage ~/.amplifier/context --json\n")
    p.set_defaults(func=_run(_ls))

    p = _parser(sub, common, "where", "the storage folder (or PostgreSQL schema) in use and where that setting "
                "came from: --storage, $CONTEXT_PERSISTENT_DIR or the default",
                "  context-persistent where\n  context-persistent --storage /srv/agents where --json\n")
    p.set_defaults(func=_run(_where_cmd))

    p = _parser(sub, common, "show", "print a session's messages (a view, now or as of any event)",
                "  context-persistent show my-session\n"
                "  context-persistent show my-session --view conversation\n"
                "  context-persistent show my-session -n 20             # the last 20 messages\n"
                "  context-persistent show my-session --at 42            # as it was right after event 42\n"
                "  context-persistent show my-session --budget 8000      # the request view at 8000 tokens\n"
                "  context-persistent show my-session --json | jq '.messages | length'\n")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("--view", choices=VIEWS, default=None,
                   help="full (default), conversation, reasoning, or request (the provider view)")
    p.add_argument("--at", type=_seq, metavar="SEQ", help="time travel: the state right after event SEQ")
    p.add_argument("--budget", type=_positive, metavar="N", help="token budget for the request view")
    p.add_argument("-n", "--last", type=int, metavar="N", help="only the last N messages of the view")
    p.add_argument("--full", action="store_true", help="do not shorten long messages")
    p.set_defaults(func=_run(_show))

    p = _parser(sub, common, "stats", "facts about a session: events, bytes, tokens per view, tokenizer, "
                "last compaction", "  context-persistent stats my-session\n"
                "  context-persistent stats my-session --budget 8000 --json\n"
                "  context-persistent stats my-session --tokens\n")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("--budget", type=_positive, metavar="N", help="token budget for the request view")
    p.add_argument("--tokens", action="store_true",
                   help="also count the conversation and reasoning views' tokens (reads the whole history)")
    p.set_defaults(func=_run(_stats))

    p = _parser(sub, common, "tail", "print the last events of a session; -f follows new ones live",
                "  context-persistent tail my-session\n"
                "  context-persistent tail my-session -n 50\n"
                "  context-persistent tail my-session -f                 # until Ctrl-C\n"
                "  context-persistent tail my-session -f --after 0 --until-seq 500 --json\n"
                "  context-persistent tail my-session -f --timeout 60\n")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                   help="how many of the last events to print first (default 10; 0 = none)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing events as they are appended")
    p.add_argument("--after", type=int, metavar="SEQ", help="start after this seq instead of the last N events")
    p.add_argument("--until-seq", type=_seq, metavar="SEQ", help="with -f: stop once this seq was printed")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="with -f: stop after this long")
    p.set_defaults(func=_run(_tail))
