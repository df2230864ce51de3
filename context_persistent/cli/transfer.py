"""Moving sessions: ``export`` (a snapshot file), ``import`` (a new session from a snapshot, an Amplifier CLI
transcript or a reference-module context-messages file), ``fork`` (a new session branched at a seq).
The source session is opened read-only: these work while an agent is writing it."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from . import UsageError, backend_of, storage_of
from .common import _open, _parser, _positive, _run, _seq
from .output import human_size, print_json

FORMATS = ("jsonl", "json", "markdown")
VIEWS = ("full", "conversation", "reasoning", "request")
SOURCES = ("auto", "snapshot", "transcript", "reference")


class Progress:
    """A one-line progress bar on stderr: only on a terminal, and only once the work has run for ``delay`` s."""

    def __init__(self, label: str, stream: TextIO | None = None, delay: float = 0.5) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.delay = delay
        self._last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 0.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {frac:4.0%} {human_size(done)} of {human_size(total)}")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()


def _format_of(path: str, given: str | None) -> str:
    from ..transfer.snapshot_codec import format_for_path

    return given or format_for_path(path)


# -- export -----------------------------------------------------------------------------------------
async def _export(args: argparse.Namespace) -> int:
    to_stdout = args.path == "-"
    if to_stdout and args.json:
        raise UsageError("--json cannot be combined with PATH '-': the snapshot itself goes to stdout")
    fmt = _format_of("" if to_stdout else args.path, args.format)
    view = args.view or ("request" if args.budget is not None else "full")
    progress = Progress(f"exporting {args.session}")
    with tempfile.TemporaryDirectory(prefix="context-persistent-export-") as tmp:
        target = Path(tmp) / f"snapshot.{fmt}" if to_stdout else Path(args.path)
        try:
            async with await _open(args, args.session) as store:
                header = await store.export(target, format=fmt, view=view, at_seq=args.at,
                                            token_budget=args.budget, progress=progress)
        finally:
            progress.close()
        size = target.stat().st_size
        if to_stdout:
            with open(target, "rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer)
            sys.stdout.flush()
    if args.json:
        print_json({"path": str(Path(args.path).resolve()), "bytes": size, "header": header})
        return 0
    out = sys.stderr if to_stdout else sys.stdout  # with '-' stdout holds the snapshot: the summary goes aside
    lo, hi = header["seq_range"]
    where = "stdout" if to_stdout else args.path
    print(f"exported {header['messages']} messages of session {args.session} (view {view}, events {lo}–{hi}, "
          f"{fmt}) to {where} ({human_size(size)}, {header['body_sha256'][:19]}…)", file=out)
    if header.get("notes"):
        print(f"note: {len(header['notes'])} of these messages are notes written in place of left-out messages "
              "(listed in the header's \"notes\"); this view is for a provider, not for moving a session", file=out)
    if fmt == "markdown":
        print("note: Markdown is for reading; it cannot be imported (use jsonl or json to move a session)", file=out)
    return 0


# -- import -----------------------------------------------------------------------------------------
async def _import(args: argparse.Namespace) -> int:
    from ..store.importing import import_

    if args.agent is not None:  # another agent's session files (cli/agent_import.py)
        from .agent_import import run_import

        return await run_import(args)
    if len(args.session) != 1:
        raise UsageError("import takes PATH and SESSION (the new session's id); with --from AGENT, PATH... "
                         "[--session-id ID]")
    args.session = args.session[0]

    system = args.system
    if system is not None and system.startswith("@"):
        system = Path(system[1:]).read_text(encoding="utf-8")
    progress = Progress(f"importing {Path(args.path).name}")
    try:
        result = await import_(args.path, session_id=args.session, storage_path=storage_of(args),
                               source=args.source, system_message=system, progress=progress,
                               request_notes=args.request_notes, **backend_of(args),
                               **({"secret_scanner": args.secret_scanner} if args.secret_scanner else {}))
    finally:
        progress.close()
    if args.json:
        print_json(result)
    else:
        print(f"imported {result['messages']} messages ({result['source']}) from {args.path} into new session "
              f"{args.session} ({result['head_seq']} events, {result['pinned']} pinned) at {result['path']}")
    return 0


# -- fork -------------------------------------------------------------------------------------------
async def _fork(args: argparse.Namespace) -> int:
    async with await _open(args, args.session) as store:
        result = await store.fork(args.new_session, at_seq=args.at)
    if args.json:
        print_json(result)
    else:
        print(f"forked {args.session} at seq {result['seq']} into new session {args.new_session}: "
              f"{result['messages']} messages, {result['pinned']} pinned ({result['path']})")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, common, "export", "write a snapshot of a session (a view, now or as of any event) to a file",
                "  context-persistent export my-session backup.jsonl\n"
                "  context-persistent export my-session chat.md --view conversation     # for people; one-way\n"
                "  context-persistent export my-session at-42.json --at 42\n"
                "  context-persistent export my-session request.jsonl --view request --budget 8000\n"
                "  context-persistent export my-session - --format json | jq '.messages | length'\n")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("path", metavar="PATH", help="file to write (replaced atomically); - writes to stdout")
    p.add_argument("--format", choices=FORMATS, help="jsonl, json or markdown (default: from PATH's extension, "
                   ".md → markdown, .json → json, else jsonl)")
    p.add_argument("--view", choices=VIEWS, help="full (default), conversation, reasoning or request")
    p.add_argument("--at", type=_seq, metavar="SEQ", help="time travel: the state right after event SEQ")
    p.add_argument("--budget", type=_positive, metavar="N", help="token budget for the request view")
    p.set_defaults(func=_run(_export))

    p = _parser(sub, common, "import", "create a NEW session from a snapshot, an Amplifier CLI transcript.jsonl "
                "or a reference-module context-messages.jsonl",
                "  context-persistent import backup.jsonl restored-session\n"
                "  context-persistent import ~/.amplifier/projects/P/sessions/S/context-messages.jsonl S\n"
                "  context-persistent import transcript.jsonl S --source transcript --system @system-prompt.md\n"
                "  context-persistent import --from claude-code ~/.claude/projects/P/*.jsonl\n"
                "  context-persistent import --from codex rollout.jsonl.zst --session-id fix-login\n")
    from .agent_import import AGENTS

    p.add_argument("path", metavar="PATH")
    p.add_argument("session", metavar="SESSION", nargs="*",
                   help="id of the new session (must not exist); with --from: more files, one session each")
    p.add_argument("--from", dest="agent", choices=AGENTS, default=None,
                   help="PATH... are another agent's session files: claude-code, codex (.jsonl or .jsonl.zst) or "
                        "pi; each becomes a session <agent>:<its id> (docs/importing.md)")
    p.add_argument("--session-id", default=None, metavar="ID", help="with --from and one file: the session's id")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="what PATH is (default auto: see docs/snapshots.md for the rules)")
    p.add_argument("--system", metavar="TEXT|@FILE",
                   help="prepend a system message (a CLI transcript has none); @FILE reads it from a file")
    p.add_argument("--request-notes", choices=("refuse", "drop", "keep"), default="refuse",
                   help="a request-view snapshot holds notes written in place of left-out messages: refuse the "
                        "import (default), drop the notes, or keep them as user messages")
    p.add_argument("--secret-scanner", choices=("builtin",), default=None,
                   help="redact secrets (cloud keys, private keys, tokens) in the messages before they are written "
                        "(docs/operations.md, \"Secrets\")")
    p.set_defaults(func=_run(_import))

    p = _parser(sub, common, "fork", "branch a session: a NEW session with its history and pins as of a seq",
                "  context-persistent fork my-session my-session-try2\n"
                "  context-persistent fork my-session before-refactor --at 120\n")
    p.add_argument("session", metavar="SESSION")
    p.add_argument("new_session", metavar="NEW_SESSION", help="id of the new session (must not exist)")
    p.add_argument("--at", type=_seq, metavar="SEQ", help="branch right after event SEQ (default: the head)")
    p.set_defaults(func=_run(_fork))

