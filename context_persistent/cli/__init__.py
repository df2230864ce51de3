"""The ``context-persistent`` command line: a thin layer over the public API.

Each command group lives in its own module with a ``register(subparsers, common)`` function; this module
only assembles them, sets the exit codes (0 ok, 1 problem found, 2 usage error) and turns errors into one
clear line (a traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import ContextPersistentError

#: Command modules, in the order their commands appear in ``--help``.
COMMAND_MODULES = ("inspect", "transfer", "durability", "demo", "db")

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

EPILOG = """examples:
  context-persistent ls                        sessions with message counts, size and last activity
  context-persistent show my-session --view conversation
  context-persistent tail my-session -f        watch a running agent from another terminal
  context-persistent export my-session backup.jsonl
  context-persistent import transcript.jsonl migrated-session
  context-persistent fork my-session try-2 --at 40
  context-persistent verify my-session         check every record; exit 1 with a report if anything is wrong
  context-persistent demo                      run the crash-and-resume demo in a temporary folder
  context-persistent --help                    this help; every command has its own --help with examples

storage: --storage PATH on every command, else $CONTEXT_PERSISTENT_DIR, else ./.amplifier/context
"""


class UsageError(Exception):
    """Bad command-line usage (exit code 2)."""


def common_parser() -> argparse.ArgumentParser:
    """Options every command takes (added to each subparser so they may follow the command name)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--storage", metavar="PATH", default=None,
                   help="storage folder (default: $CONTEXT_PERSISTENT_DIR or ./.amplifier/context)")
    p.add_argument("--dsn", metavar="URL", default=None,
                   help="use the PostgreSQL backend at this postgresql:// URL instead of --storage "
                        "(docs/postgres.md; $CONTEXT_PERSISTENT_DSN is the default for `db` commands)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def storage_of(args: argparse.Namespace) -> str:
    from ..mount import storage_from

    return str(storage_from({"storage_path": args.storage}))


def backend_of(args: argparse.Namespace) -> dict[str, str]:
    """Config selecting the backend: ``{"backend": "postgres", "dsn": ...}`` with ``--dsn``, else ``{}``.

    Pass it to ``PersistentContextManager.open(storage_path=storage_of(args), **backend_of(args))``.
    """
    dsn = getattr(args, "dsn", None)
    return {"backend": "postgres", "dsn": dsn} if dsn else {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # exit code 2 with one line, as argparse does, but our format
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="context-persistent", description=__doc__.splitlines()[0] if __doc__ else None,
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        print(f"context-persistent {args.command}: {e}", file=sys.stderr)
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


def run() -> None:
    sys.exit(main())

