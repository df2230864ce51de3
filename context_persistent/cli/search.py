"""``search`` (full-text search over every session), ``index rebuild|status`` (the search index), and what the
index brings to two commands of cli/inspect.py: ``ls`` reads the index (both backends), and ``show`` gains
``--around SEQ [-C N]`` (docs/search.md). ``register`` runs after inspect's and takes those two over (their
parsers are inspect's; the handlers here fall back to inspect's for everything else), so that inspect.py does
not depend on this module: the commands import one way."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from . import UsageError, backend_of, require_storage
from .output import human_size, paint, print_json, role_label, short_time, table, use_colour

EXIT_HITS, EXIT_NONE = 0, 1


def _where_index(args: argparse.Namespace) -> dict[str, Any]:
    """``storage`` and, with ``--dsn``, ``dsn`` and ``pg_schema``: the index the command reads."""
    backend = backend_of(args)
    if backend:
        return {"storage": None, "dsn": backend["dsn"], "pg_schema": backend.get("pg_schema")}
    return {"storage": require_storage(args)}


async def _search(args: argparse.Namespace) -> int:
    from ..operations.search import search

    target = _where_index(args)
    hits = await search(target.pop("storage"), args.query, session_id=args.session, role=args.role,
                        since=args.since, limit=args.limit, all_messages=args.all, exhaustive=args.exhaustive,
                        **({"window": args.window} if args.window else {}), **target)
    if args.json:
        print_json({"query": args.query, "hits": [{"session_id": h.session_id, "seq": h.seq, "index": h.index,
                                                    "role": h.role, "ts": h.ts, "snippet": h.snippet,
                                                    "score": h.score, "in_view": h.in_view} for h in hits],
                    "ranking": hits.ranking})
        return EXIT_HITS if hits else EXIT_NONE
    on = use_colour(sys.stdout)
    for h in hits:
        snippet = h.snippet.replace("[", "\x1b[1m").replace("]", "\x1b[0m") if on else h.snippet
        where = f"{h.session_id}  seq {h.seq}" + (f".{h.index}" if h.index else "")
        hidden = "" if h.in_view else paint("  (no longer in the views)", "2", on)
        print(f"{paint(where, '1', on)}  {role_label(h.role, on)} {short_time(h.ts)}{hidden}")
        print(f"    {snippet}")
    if not hits:
        print(f"no match for {args.query!r}", file=sys.stderr)
    elif not hits.ranking["all_ranked"]:
        print(f"ranked the newest {hits.ranking['ranked']:,} matching messages; older ones match too "
              "(--exhaustive ranks them all)", file=sys.stderr)
    return EXIT_HITS if hits else EXIT_NONE


async def ls_from_index(args: argparse.Namespace) -> int:
    """``ls``: the sessions as the search index lists them (caught up first), on either backend."""
    from ..operations.search import list_sessions
    from .inspect import _where

    target = _where_index(args)
    rows = await list_sessions(target.pop("storage"), **target)
    where, source = _where(args)
    if args.json:
        print_json({"storage": where, "storage_source": source, "sessions": [
            {**r, "last_activity": r.get("last_ts")} for r in rows]})
    elif not rows:
        print(f"no sessions in {where} (from {source})")
    else:
        print(f"storage {where} (from {source})")
        print(table(["SESSION", "MESSAGES", "EVENTS", "SIZE", "FIRST", "LAST ACTIVITY", "TITLE"],
                    [[r["session_id"], r.get("messages", "-"), r.get("events", "-"), human_size(r.get("bytes")),
                      short_time(r.get("first_ts")), short_time(r.get("last_ts")),
                      _cut(r.get("title") or "") if "error" not in r else "error: " + r["error"]]
                     for r in rows], right=(1, 2, 3)))
    return 1 if any("error" in r for r in rows) else 0


def _cut(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


async def _show_around(args: argparse.Namespace) -> None:
    from .common import _open

    async with await _open(args, args.session) as store:
        await show_around(args, store)


async def show_around(args: argparse.Namespace, store: Any) -> None:
    """``show SESSION --around SEQ [-C N]``: the N messages of the history before and after the message of
    event SEQ (the nearest one when SEQ added none), streamed like ``show``."""
    from ..model.projection import split_key
    from .output import message_text

    keys = store._full().keys
    seqs = [split_key(k)[0] for k in keys]
    if not seqs:
        raise UsageError(f"session {args.session} has no messages in its history")
    import bisect

    at = min(bisect.bisect_left(seqs, args.around), len(seqs) - 1)
    if at > 0 and seqs[at] != args.around and abs(seqs[at - 1] - args.around) <= abs(seqs[at] - args.around):
        at -= 1
    first, last = max(0, at - args.context), min(len(seqs), at + args.context + 1)
    picked = []
    i = 0
    async for m in store.iter_messages():  # (bounded memory: one message at a time, stopping after the last)
        if i >= first:
            picked.append((i, m, seqs[i]))
        i += 1
        if i >= last:
            break
    if args.json:
        print_json({"session_id": args.session, "around": args.around, "context": args.context,
                    "messages": [{"index": i, "seq": s, "message": m} for i, m, s in picked]})
        return
    on = use_colour(sys.stdout)
    width = max(3, len(str(seqs[last - 1])))
    for i, m, s in picked:
        mark = ">" if i == at else " "
        text = message_text(m, None if args.full else 600, "; --full shows all").rstrip()
        indent = " " * (2 + 5 + 2 + width + 2 + 9 + 2)
        line = (f"{mark} {i:>5}  {s:>{width}}  {role_label(str(m.get('role')), on)}  "
                f"{text.replace(chr(10), chr(10) + indent)}")
        print(line)


async def _index(args: argparse.Namespace) -> int:
    from ..operations.search import list_sessions, rebuild_index

    where = _where_index(args)
    storage = where.pop("storage")
    shown = await _index_name(storage, where)
    if args.action == "rebuild":
        started = time.perf_counter()
        outcomes = await rebuild_index(storage, **where)
        failed = [o for o in outcomes if o.skipped]
        took = time.perf_counter() - started
        if args.json:
            print_json({"sessions": len(outcomes), "documents": sum(o.added for o in outcomes), "seconds": took,
                        "failed": [{"session_id": o.session_id, "error": o.skipped} for o in failed]})
        else:
            print(f"rebuilt {shown}: {len(outcomes)} session(s), "
                  f"{sum(o.added for o in outcomes)} message(s) in {took:.1f} s")
            for o in failed:
                print(f"  NOT INDEXED {o.session_id}: {o.skipped}")
        return 1 if failed else 0
    rows = await list_sessions(storage, **where)
    info = {"index": shown, "bytes": await _index_bytes(storage, where),
            "sessions": len(rows), "messages": sum(r.get("messages", 0) for r in rows)}
    if args.json:
        print_json(info)
    else:
        print(f"{info['index']}: {info['sessions']} session(s), {info['messages']} message(s) in the views, "
              f"{human_size(info['bytes'])}")
    return 0


async def _index_name(storage: str | None, where: dict[str, Any]) -> str:
    if storage is not None:
        from ..operations.search.sqlite_index import index_path

        return str(index_path(storage))
    from ..storage.pg import redact_dsn, resolve_schema

    return f"{redact_dsn(where['dsn'])} schema {resolve_schema(where.get('pg_schema'))} (search_* tables)"


async def _index_bytes(storage: str | None, where: dict[str, Any]) -> int:
    if storage is not None:
        from ..operations.search.sqlite_index import index_path

        path = index_path(storage)
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    from ..operations.search.pg_index import PgIndex

    index = PgIndex(where["dsn"], where.get("pg_schema"))
    try:
        return await index.size_bytes()
    finally:
        await index.aclose()


def _run(coro_fn: Any) -> Any:
    return lambda args: asyncio.run(coro_fn(args))


def _limit(text: str) -> int:
    from ..operations.search.api import MAX_LIMIT

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a number of hits from 1 to {MAX_LIMIT}, got {text!r}")
    return value


def _window(text: str) -> int:
    from ..operations.search.api import MAX_WINDOW

    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_WINDOW:
        raise argparse.ArgumentTypeError(f"expected a number of matches from 1 to {MAX_WINDOW}, got {text!r}")
    return value


def _take_over(sub: Any) -> None:
    """``ls`` from the index (both backends); ``show --around``."""
    from .common import _whole_number

    ls = sub.choices["ls"]
    ls.set_defaults(func=lambda args: asyncio.run(ls_from_index(args)))
    show = sub.choices["show"]
    plain_show = show.get_default("func")
    show.add_argument("--around", type=_whole_number("an event seq"), metavar="SEQ",
                      help="the messages around the one event SEQ added (a search hit), -C before and after")
    show.add_argument("-C", "--context", type=int, default=5, metavar="N",
                      help="with --around: N messages before and after (default 5)")
    show.set_defaults(func=lambda args: plain_show(args) if args.around is None else asyncio.run(_show_around(args)))


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    from ..model.events import ROLES

    _take_over(sub)
    p = sub.add_parser("search", parents=[common], help="full-text search over every session (exit 1: no match)",
                       description="Search every session of the storage (docs/search.md, 'Query language': words, "
                       "\"phrases\", prefix*, AND/OR/NOT, NEAR(a b, N), tools:NAME). Exit 0 with hits, 1 with none.",
                       epilog="examples:\n"
                       "  context-persistent search 'connection pool'\n"
                       "  context-persistent search '\"connection refused\" AND postgres*' --since 7d\n"
                       "  context-persistent search 'tools:bash AND rm' --role assistant --limit 5 --json\n"
                       "  context-persistent search deploy --session my-session --all\n",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("query", metavar="QUERY")
    p.add_argument("--session", metavar="ID", help="only this session")
    p.add_argument("--role", choices=ROLES, help="only messages of this role")
    p.add_argument("--since", metavar="DATE", help="only messages from then on: 2025-01-31, 2025-01-31T09:30, 7d, "
                   "12h, 30m")
    p.add_argument("--limit", type=_limit, default=20, metavar="N", help="at most N hits (default 20)")
    p.add_argument("--all", action="store_true", help="also messages the views no longer show (cleared or "
                   "replaced) that the log still holds")
    p.add_argument("--window", type=_window, metavar="N", help="rank the newest N matching messages (default "
                   "10,000; at least --limit): docs/search.md, 'Ranking'")
    p.add_argument("--exhaustive", action="store_true", help="rank every matching message, not only the newest "
                   "--window (slower for a word in much of the storage)")
    p.set_defaults(func=_run(_search))

    p = sub.add_parser("index", parents=[common], help="the search index: rebuild it from the logs, or its status",
                       description="The search index (<storage>/.search/index.sqlite3, or with --dsn the schema's "
                       "search_* tables) is a projection of the logs: "
                       "`rebuild` makes it again from the logs alone; `status` catches it up and counts.",
                       epilog="examples:\n  context-persistent index rebuild\n  context-persistent index status --json\n",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("rebuild", "status"))
    p.set_defaults(func=_run(_index))
