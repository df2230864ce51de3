"""Reading commands: ``ls``, ``where``, ``show``, ``stats``, ``tail``. They open sessions read-only (no lock), so
they work while an agent is writing; what they show is the log as it was when they opened it (``tail -f`` then
follows what is appended).

This module holds ``ls`` and ``where`` and registers the family; ``show``, ``stats`` and ``tail`` are in
show.py, stats.py and tail.py, the output helpers in output.py, the parser pieces in common.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import backend_of, require_storage, storage_info
from .common import _after_seq, _how_many, _open, _parser, _positive, _run, _seconds, _seq
from .output import human_size, print_json, short_time, table
from .show import VIEWS, _show
from .stats import _stats
from .tail import _tail


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


# -- registration -----------------------------------------------------------------------------------
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
    p.add_argument("-n", "--last", type=_how_many, metavar="N", help="only the last N messages of the view")
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
    p.add_argument("-n", "--lines", type=_how_many, default=10, metavar="N",
                   help="how many of the last events to print first (default 10; 0 = none)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing events as they are appended")
    p.add_argument("--after", type=_after_seq, metavar="SEQ", help="start after this seq instead of the last N events")
    p.add_argument("--until-seq", type=_seq, metavar="SEQ", help="with -f: stop once this seq was printed")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="with -f: stop after this long")
    p.set_defaults(func=_run(_tail))
