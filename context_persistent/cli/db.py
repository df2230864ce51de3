"""``context-persistent db``: set up and inspect the PostgreSQL backend (see docs/postgres.md).

``db init`` creates the schema (tables, layout version) if it is missing; a store also creates it on first
use, so ``init`` is for operators who grant the program no CREATE right. ``db status`` shows the server,
the layout version, counts, and which sessions a writer holds right now (and who).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

EXAMPLES = """examples:
  context-persistent db init --dsn postgresql://agent@db.internal:5432/agents
  CONTEXT_PERSISTENT_DSN=postgresql://agent@db.internal/agents context-persistent db status --json
  context-persistent db status --pg-schema team_a          a schema other than context_persistent
"""


def _print(args: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, default=str, indent=2))
    else:
        print("\n".join(lines))


def run_init(args: argparse.Namespace) -> int:
    from ..storage.pg import init_schema

    info = asyncio.run(init_schema(args.dsn, args.pg_schema))
    verb = "created" if info["created"] else "already present"
    _print(args, info, [f"schema {info['schema']} (layout version {info['version']}) {verb} at {info['dsn']}"])
    return 0


def run_status(args: argparse.Namespace) -> int:
    from ..storage.pg import status

    info = asyncio.run(status(args.dsn, args.pg_schema))
    if info["version"] is None:
        _print(args, info, [f"server: PostgreSQL {info['server_version']} at {info['dsn']}",
                            f"schema {info['schema']}: not created yet (run `context-persistent db init`)"])
        return 1
    lines = [
        f"server:      PostgreSQL {info['server_version']} at {info['dsn']}",
        f"schema:      {info['schema']} (layout version {info['version']}; this program writes "
        f"{info['program_version']})",
        f"sessions:    {info['sessions']}",
        f"events:      {info['events']}",
        f"checkpoints: {info['checkpoints']}",
        f"writers:     {len(info['writers'])} session(s) held right now",
    ]
    for w in info["writers"]:
        lines.append(f"  {w['session_id']}  seq {w['last_seq']}  backend pid {w['pid']}  "
                     f"{w['application_name'] or ''}  {w['client_addr'] or 'local socket'}".rstrip())
    _print(args, info, lines)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("db", help="set up and inspect the PostgreSQL backend", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    db = p.add_subparsers(dest="db_command", metavar="DB_COMMAND", parser_class=type(p))
    for name, func, text in (("init", run_init, "create the schema if it is missing"),
                             ("status", run_status, "server, layout version, counts, current writers")):
        q = db.add_parser(name, parents=[common], help=text, description=text, epilog=EXAMPLES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: p.print_help() or 2)
