"""The ``context-persistent`` command line: a thin layer over the public API.

Each command group lives in its own module with a ``register(subparsers, common)`` function; this module
only assembles them, sets the exit codes (0 ok, 1 problem found, 2 usage error) and turns errors into one
clear line (a traceback only with ``--debug``).

May import: every layer below (integrations, store, transfer, operations, storage, model, errors); nothing
imports the command line. Checked by import-linter (``.importlinter``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .. import __version__
from ..errors import ContextPersistentError, SessionNotFoundError

#: Command modules, in the order their commands appear in ``--help``.
COMMAND_MODULES = ("inspect", "search", "transfer", "durability", "erase", "retention", "usage", "demo", "db", "serve")

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

EPILOG = """examples:
  context-persistent ls                        sessions with message counts, size, first/last time and title
  context-persistent search 'connection pool'  where did I discuss it? (every session; exit 1: no match)
  context-persistent show my-session --around 42 -C 3    a hit in context
  context-persistent where                     the storage folder in use, and where that setting came from
  context-persistent show my-session --view conversation
  context-persistent show my-session -n 20     the last 20 messages, with the seq of each
  context-persistent tail my-session -f        watch a running agent from another terminal
  context-persistent export my-session backup.jsonl
  context-persistent export my-session - | jq .    a snapshot on stdout
  context-persistent import transcript.jsonl migrated-session
  context-persistent fork my-session try-2 --at 40
  context-persistent verify my-session         check every record; exit 1 with a report if anything is wrong
  context-persistent usage --by model          tokens and cost the providers reported, across the sessions
  context-persistent --storage /srv/agents ls  global options go before or after the command
  context-persistent demo                      run the crash-and-resume demo in a temporary folder
  context-persistent serve                     a read-only web viewer of the sessions (the [viewer] extra)
  context-persistent --help                    this help; every command has its own --help with examples

storage: --storage PATH, else $CONTEXT_PERSISTENT_DIR, else ~/.amplifier/context (`where` shows which)
"""

#: Commands whose output has no JSON form: ``--json`` is refused (exit 2) rather than ignored.
NO_JSON = frozenset({"demo", "serve"})


class UsageError(Exception):
    """Bad command-line usage (exit code 2)."""


class StorageNotFoundError(ContextPersistentError):
    """A reading command was pointed at a storage folder that does not exist (exit code 1)."""


def _add_common(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("--storage", metavar="PATH", default=default,
                   help="storage folder (default: $CONTEXT_PERSISTENT_DIR, else ~/.amplifier/context)")
    p.add_argument("--dsn", metavar="URL", default=default,
                   help="use the PostgreSQL backend at this postgresql:// URL instead of --storage "
                        "(docs/postgres.md; $CONTEXT_PERSISTENT_DSN is the default for `db` commands)")
    p.add_argument("--pg-schema", metavar="NAME", default=default,
                   help="with --dsn: the schema holding the tables (default: $CONTEXT_PERSISTENT_PG_SCHEMA, "
                        "else context_persistent)")
    p.add_argument("--json", action="store_true", default=default, help="machine-readable output")
    p.add_argument("--debug", action="store_true", default=default, help="show tracebacks on errors")


def common_parser() -> argparse.ArgumentParser:
    """Options every command takes, before or after the command name (``--storage X ls`` = ``ls --storage X``).

    Added to each subparser with SUPPRESS defaults, so that a value given before the command is kept."""
    p = argparse.ArgumentParser(add_help=False)
    _add_common(p, argparse.SUPPRESS)
    return p


def storage_info(args: argparse.Namespace) -> tuple[str, str]:
    """The storage folder and where the setting came from: ``--storage``, ``$CONTEXT_PERSISTENT_DIR`` or
    ``default``."""
    from ..integrations.amplifier import ENV_STORAGE, storage_source

    path, source = storage_source({"storage_path": getattr(args, "storage", None)})
    return str(path), {"config": "--storage", "environment": "$" + ENV_STORAGE}.get(source, source)


def storage_of(args: argparse.Namespace) -> str:
    return storage_info(args)[0]


def require_storage(args: argparse.Namespace) -> str:
    """The storage folder of a reading command; StorageNotFoundError if it does not exist (a typo in
    ``--storage`` must not look like an empty store). Not checked with ``--dsn`` (nothing on disk)."""
    path, source = storage_info(args)
    if getattr(args, "dsn", None) or Path(path).is_dir():
        return path
    if Path(path).exists():
        raise StorageNotFoundError(f"storage {path} (from {source}) is not a folder")
    raise StorageNotFoundError(f"storage folder {path} (from {source}) does not exist; give the folder your "
                               "agent writes to with --storage PATH or $CONTEXT_PERSISTENT_DIR "
                               "(`context-persistent where` shows what is in use)")


def backend_of(args: argparse.Namespace) -> dict[str, str]:
    """Config selecting the backend: ``{"backend": "postgres", "dsn": ..., "pg_schema": ...}`` with ``--dsn``,
    else ``{}``.

    Pass it to ``PersistentContextManager.open(storage_path=storage_of(args), **backend_of(args))``.
    """
    dsn = getattr(args, "dsn", None)
    if not dsn:
        if getattr(args, "pg_schema", None):
            raise UsageError("--pg-schema applies with --dsn only (the PostgreSQL backend)")
        return {}
    out = {"backend": "postgres", "dsn": dsn}
    if getattr(args, "pg_schema", None):
        out["pg_schema"] = args.pg_schema
    return out


class _Parser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # Descriptions come from docstrings: show their reStructuredText roles and ``literals`` as plain text.
        text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", super().format_help())
        return text.replace("``", "`")

    def error(self, message: str) -> NoReturn:  # exit code 2 with one line, as argparse does, but our format
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="context-persistent", description=__doc__.splitlines()[0] if __doc__ else None,
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(parser, None)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common = common_parser()
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if args.json and args.command in NO_JSON:
        print(f"context-persistent {args.command}: error: --json is not supported by {args.command} "
              "(its output is for people)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; stop quietly like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ContextPersistentError as e:  # first: MalformedInputError is also a ValueError, but a problem (1)
        if args.debug:
            raise
        hint = _did_you_mean(args) if isinstance(e, SessionNotFoundError) else ""
        print(f"context-persistent {args.command}: {e}{hint}", file=sys.stderr)
        return EXIT_PROBLEM
    except (UsageError, ValueError) as e:
        if args.debug:
            raise
        print(f"context-persistent {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ContextPersistentError, OSError) as e:
        if args.debug:
            raise
        print(f"context-persistent {args.command}: {e}", file=sys.stderr)
        return EXIT_PROBLEM


def _did_you_mean(args: argparse.Namespace) -> str:
    """For a session not found: the stored ids closest to the one given, and where to list them all."""
    import difflib

    wanted = getattr(args, "session", None)
    if not isinstance(wanted, str):
        return ""
    try:
        if backend_of(args):
            import asyncio

            from ..storage import pg

            listed = asyncio.run(pg.list_sessions(args.dsn, backend_of(args).get("pg_schema")))
            ids = [str(r["session_id"]) for r in listed]
        else:
            from ..storage.segments import has_log

            ids = [d.name for d in Path(storage_of(args)).iterdir() if not d.name.startswith(".") and has_log(d)]
    except (OSError, ContextPersistentError):
        return ""
    close = difflib.get_close_matches(wanted, ids, n=3, cutoff=0.6)
    listing = "`context-persistent ls` lists the sessions"
    return f"; did you mean {' or '.join(repr(c) for c in close)}? ({listing})" if close else f" ({listing})"


def run() -> None:
    sys.exit(main())

