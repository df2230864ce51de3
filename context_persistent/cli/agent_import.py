"""``context-persistent import --from claude-code|codex|pi PATH... [--session-id ID]``: other agents' sessions,
each file a new session (store/importers). Called by ``import`` (cli/transfer.py) when ``--from`` is given."""

from __future__ import annotations

import argparse

from . import UsageError, backend_of, storage_of
from .inspect import print_json

#: The agents whose sessions ``--from`` reads (store/importers.FORMATS; named here so that ``--help`` does not
#: import the store).
AGENTS = ("claude-code", "codex", "pi")


async def run_import(args: argparse.Namespace) -> int:
    from ..store.importers import import_agent_sessions

    paths = [args.path, *args.session]
    if args.session_id is not None and len(paths) > 1:
        raise UsageError(f"--session-id names one session: give one file with it, not {len(paths)}")
    for option in ("system", "secret_scanner"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_', '-')} cannot be combined with --from")
    results = await import_agent_sessions(paths, source=args.agent, storage_path=storage_of(args),
                                          session_id=args.session_id, **backend_of(args))
    if args.json:
        print_json(results if len(results) > 1 else results[0])
        return 0
    for r in results:
        if r["already_imported"]:
            print(f"{r['from']} is already session {r['session_id']} (same bytes): nothing written")
            continue
        left = ", ".join(f"{n} {kind}" for kind, n in sorted(r["ignored"].items()))
        unpaired = [f"{r[k]} {k}" for k in ("unanswered", "orphaned") if r[k]]
        print(f"imported {r['messages']} messages ({args.agent} session {r['agent_session_id']}) from {r['from']} "
              f"into new session {r['session_id']}" + (f"; not carried over: {left}" if left else "")
              + (f"; tool calls/results without a partner: {', '.join(unpaired)}" if unpaired else ""))
    return 0
