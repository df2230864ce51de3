"""``tail``: print the last events of a session (or every event after a seq), one line each; ``-f`` follows
what is appended, and waits for a session that does not exist yet."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from . import UsageError, backend_of, require_storage, storage_info, storage_of
from .output import message_text, role_label, short_time, use_colour

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
    if kind == "transcript_edited":
        return (f"an edited transcript of {data.get('count')} messages ignored and warned about: removes seqs "
                f"{data.get('removed_seqs')}, changes seqs {data.get('changed_seqs')}")
    if kind == "host_linked":
        return f"linked to the {data.get('host')} session folder {data.get('folder')}"
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
