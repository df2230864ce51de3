"""``retention plan|apply`` and ``trash list|restore|purge``: retention policies and the trash (docs/operations.md,
"Retention"). With ``--dsn`` they work on a PostgreSQL store; otherwise on the storage folder.
"""

from __future__ import annotations

import argparse
import math
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import backend_of, require_storage
from .output import print_json

if TYPE_CHECKING:  # (imported where a retention command runs: every other command starts without it)
    from ..model.retention import RetentionPolicy

EXAMPLES = """examples:
  context-persistent retention plan --max-age-days 90            what would expire, and why (changes nothing)
  context-persistent retention apply --max-age-days 90 --grace-days 30
  context-persistent retention apply --max-sessions 500 --max-bytes 20000000000
  context-persistent retention plan --max-segments 20           sealed segments of kept sessions beyond 20
  context-persistent retention apply --follow-amplifier          sessions `amplifier session delete` removed
  context-persistent trash list                                   entries in the trash, with their purge dates
  context-persistent trash restore my-session                     back to a live session, intact
  context-persistent trash purge                                  delete entries whose grace period is over
  context-persistent trash purge 'my-session~3' --force           delete one entry now
exit codes: 0 done, 1 problem (an entry refused, a session locked), 2 usage error
"""


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    from ..model.retention import POLICY_KEYS, RetentionPolicy

    config = {k: getattr(args, k) for k in POLICY_KEYS if getattr(args, k, None) is not None}
    if getattr(args, "follow_amplifier", None) is not None:
        if _pg(args):
            raise ValueError("--follow-amplifier applies to a storage folder only (the file backend), not --dsn")
        config["follow_host"] = True
    policy = RetentionPolicy.from_config(config)
    if not policy.limits():
        raise ValueError("give at least one limit: --follow-amplifier, --max-age-days, --max-sessions, --max-bytes "
                         "or --max-segments")
    return policy


def _host_home(args: argparse.Namespace) -> Path | None:
    home = getattr(args, "follow_amplifier", None)
    return Path(home).expanduser() if home else None


def _pg(args: argparse.Namespace) -> dict[str, Any]:
    return backend_of(args)


def _print_plan(p: dict[str, Any]) -> list[str]:
    lines = []
    for e in p["expire"]:
        lines.append(f"  expire {e['session_id']}  ({e['bytes']} bytes; {e['rule']}: {e['reason']})")
    for e in p["live"]:
        lines.append(f"  live   {e['session_id']}  (selected by {e['rule']}, but a writer holds it: kept)")
    lines.append(f"{len(p['expire'])} session(s) to expire ({p['bytes_expiring']} bytes), {len(p['live'])} live, "
                 f"{len(p['kept'])} kept")
    for e in p.get("segments", []):
        lines.append(f"  segment {e['session_id']}/{e['segment']}  (seqs {e['first_seq']}..{e['last_seq']}, "
                     f"{e['bytes']} bytes; {e['rule']}: {e['reason']})")
    for e in p.get("segments_live", []):
        lines.append(f"  segment {e['session_id']}/{e['segment']}  (selected by {e['rule']}, but a writer holds the "
                     "session: kept)")
    if p.get("segments") or p.get("segments_live"):
        lines.append(f"{len(p['segments'])} sealed segment(s) of kept sessions to expire, "
                     f"{len(p['segments_live'])} of live ones kept")
    return lines


async def _plan(args: argparse.Namespace) -> dict[str, Any]:
    policy = _policy(args)
    backend = _pg(args)
    if backend:
        from ..storage.pg.retention import plan_pg

        return (await plan_pg(backend["dsn"], backend.get("pg_schema"), policy)).as_dict()
    from ..operations.trash import plan_file

    return (await plan_file(require_storage(args), policy, host_home=_host_home(args))).as_dict()


def run_plan(args: argparse.Namespace) -> int:
    p = asyncio.run(_plan(args))
    if args.json:
        print_json(p)
    else:
        print("\n".join(["retention plan (nothing changed):"] + _print_plan(p)))
    return 0


async def _apply(args: argparse.Namespace) -> dict[str, Any]:
    policy = _policy(args)
    backend = _pg(args)
    if backend:
        from ..storage.pg.retention import apply_pg

        return await apply_pg(backend["dsn"], backend.get("pg_schema"), policy)
    from ..operations.trash import apply_file

    return await apply_file(require_storage(args), policy, host_home=_host_home(args))


def run_apply(args: argparse.Namespace) -> int:
    report = asyncio.run(_apply(args))
    if args.json:
        print_json(report)
    else:
        lines = [f"finished an interrupted operation: {r['entry']}: {r['action']}" for r in report["reconciled"]]
        for t in report["trashed"]:
            lines.append(f"trashed {t['session_id']} -> {t['entry']} ({t['bytes']} bytes; {t['rule']}; purge after "
                         f"{t['purge_after']})")
        for s in report["skipped"]:
            lines.append(f"kept {s['session_id']} (selected by {s['rule']}): {s['why']}")
        for x in report.get("segments_expired", []):
            for name in x["segments"]:
                lines.append(f"expired {x['session_id']}/{name} -> {x['entry']}")
            lines.append(f"  seqs {x['first_seq']}..{x['last_seq']} of {x['session_id']} ({x['bytes']} bytes; {x['rule']}; "
                         f"purge after {x['purge_after']})")
        for k in report.get("segments_kept", []):
            lines.append(f"kept segment {k['session_id']}/{k['segment']} (selected by {k['rule']}): {k['why']}")
        lines.append(f"{len(report['trashed'])} session(s) moved to the trash, {len(report['skipped'])} skipped")
        if report.get("segments_expired") or report.get("segments_kept"):
            lines.append(f"{sum(len(x['segments']) for x in report['segments_expired'])} sealed segment(s) expired, "
                         f"{len(report['segments_kept'])} selected and kept")
        print("\n".join(lines))
    return 1 if report["skipped"] or report.get("segments_kept") else 0


async def _list(args: argparse.Namespace) -> list[dict[str, Any]]:
    backend = _pg(args)
    if backend:
        from ..storage.pg.retention import list_trash_pg

        return await list_trash_pg(backend["dsn"], backend.get("pg_schema"), all_entries=args.all)
    from ..operations.trash import list_trash

    return await list_trash(require_storage(args), all_entries=args.all)


def run_list(args: argparse.Namespace) -> int:
    rows = asyncio.run(_list(args))
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("the trash is empty")
        return 0
    for r in rows:
        what = (f"  segments of {r['session_id']}, seqs {r['first_seq']}..{r['last_seq']} (not restorable)"
                if r.get("kind") == "segments" else "")
        print(f"{r['entry']}  {r['state']}{what}  trashed {r['trashed_at']}  purge after {r['purge_after']}  "
              f"{r['bytes']} bytes  {r['rule']}: {r['reason']}")
    return 0


async def _restore(args: argparse.Namespace) -> dict[str, Any]:
    backend = _pg(args)
    if backend:
        from ..storage.pg.retention import restore_pg

        return await restore_pg(backend["dsn"], backend.get("pg_schema"), args.entry)
    from ..operations.trash import restore

    return await restore(require_storage(args), args.entry)


def run_restore(args: argparse.Namespace) -> int:
    data = asyncio.run(_restore(args))
    if args.json:
        print_json(data)
    else:
        print(f"restored {data['entry']} as session {data['session_id']}")
    return 0


async def _purge(args: argparse.Namespace) -> dict[str, Any]:
    backend = _pg(args)
    names = args.entries or None
    if backend:
        from ..storage.pg.retention import purge_pg

        return await purge_pg(backend["dsn"], backend.get("pg_schema"), names, force=args.force, reason=args.reason)
    from ..operations.trash import purge

    return await purge(require_storage(args), names, force=args.force, reason=args.reason)


def run_purge(args: argparse.Namespace) -> int:
    report = asyncio.run(_purge(args))
    if args.json:
        print_json(report)
    else:
        lines = [f"purged {p['entry']} ({p['bytes']} bytes{', forced' if p['forced'] else ''})"
                 for p in report["purged"]]
        lines += [f"kept {r['entry']}: {r['why']}; purge after {r['purge_after']}" for r in report["refused"]]
        lines.append(f"{len(report['purged'])} entr{'y' if len(report['purged']) == 1 else 'ies'} purged")
        print("\n".join(lines))
    return 1 if report["refused"] and args.entries else 0


def _days(text: str) -> float:
    from ..model.retention import MAX_DAYS

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_DAYS:  # (nan fails too)
        raise argparse.ArgumentTypeError(f"expected a number of days from 0 to {MAX_DAYS:,}, got {text!r}")
    return value


def _count(text: str) -> int:
    from ..model.retention import MAX_COUNT

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to {MAX_COUNT:,}, got {text!r}")
    return value


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("retention", parents=[common],
                       help="apply a retention policy: expired sessions go to the trash, recorded",
                       description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    rs = p.add_subparsers(dest="retention_command", metavar="RETENTION_COMMAND", parser_class=type(p))
    for name, func, text in (("plan", run_plan, "what a policy would expire and why (changes nothing)"),
                             ("apply", run_apply, "move the sessions a policy expires to the trash")):
        q = rs.add_parser(name, parents=[common], help=text, description=text, epilog=EXAMPLES, formatter_class=fmt)
        q.add_argument("--max-age-days", dest="max_age_days", type=_days, metavar="DAYS",
                       help="expire sessions whose last record is older than DAYS days")
        q.add_argument("--max-sessions", dest="max_sessions", type=_count, metavar="N",
                       help="keep the N most recently active sessions; expire the others")
        q.add_argument("--max-bytes", dest="max_bytes", type=_count, metavar="BYTES",
                       help="expire the least recently active sessions until the rest take at most BYTES")
        q.add_argument("--max-segments", dest="max_segments", type=_count, metavar="N",
                       help="of each kept session, keep the N newest sealed log segments (segmented logs only; "
                            "the active segment never expires)")
        q.add_argument("--follow-amplifier", dest="follow_amplifier", nargs="?", const="", metavar="HOME",
                       help="expire the sessions whose Amplifier CLI folder the CLI deleted (`amplifier session "
                            "delete`/`cleanup`; only sessions the CLI ran, linked when they were mounted); HOME: "
                            "look under HOME/.amplifier instead of the home recorded at the link")
        q.add_argument("--grace-days", dest="grace_days", type=_days, metavar="DAYS",
                       help="days an expired session stays in the trash before `trash purge` deletes it "
                            "(default 7)")
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: p.print_help() or 2)

    t = sub.add_parser("trash", parents=[common],
                       help="list, restore or purge the sessions retention moved to the trash",
                       description=__doc__, epilog=EXAMPLES, formatter_class=fmt)
    ts = t.add_subparsers(dest="trash_command", metavar="TRASH_COMMAND", parser_class=type(t))
    q = ts.add_parser("list", parents=[common], help="the entries in the trash", epilog=EXAMPLES, formatter_class=fmt)
    q.add_argument("--all", action="store_true", help="also restored, cancelled and purged entries (the ledger)")
    q.set_defaults(func=run_list)
    q = ts.add_parser("restore", parents=[common], help="move an entry back to a live session", epilog=EXAMPLES,
                      formatter_class=fmt)
    q.add_argument("entry", metavar="ENTRY", help="an entry name (SESSION~N) or a session id with one entry")
    q.set_defaults(func=run_restore)
    q = ts.add_parser("purge", parents=[common], help="delete entries for good (recorded in the ledger)",
                      epilog=EXAMPLES, formatter_class=fmt)
    q.add_argument("entries", metavar="ENTRY", nargs="*",
                   help="entries to purge (default: every entry whose grace period is over)")
    q.add_argument("--force", action="store_true", help="purge named entries even within their grace period")
    q.add_argument("--reason", default="", help="why (recorded in the ledger)")
    q.set_defaults(func=run_purge)
    t.set_defaults(func=lambda args: t.print_help() or 2)


__all__ = ["register"]
