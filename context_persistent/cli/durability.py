"""``verify`` and ``repair``: check a session's log byte by byte, and rebuild it without its bad bytes.

verify never takes the lock (it works while an agent writes, on the log as it was when it started) and
exits 0 when everything is clean, 1 with a report otherwise. repair takes the writer lock (it refuses while
a store has the session open), keeps every valid record, moves every bad byte to a quarantine file in the
session folder and rebuilds the log atomically. See docs/operations.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

import orjson

from ..model import json_lossless
from ..errors import FOREIGN_LOG_ADVICE, ContextPersistentError, SessionLockedError
from ..storage.paths import session_dir
from . import EXIT_OK, EXIT_PROBLEM, UsageError, require_storage, storage_of
from .transfer import Progress

if TYPE_CHECKING:  # (imported where verify and repair run: every other command starts without them)
    from ..operations.repair import Report, RepairResult
    from ..operations.semantic import SemanticRepair


def _directory(args: argparse.Namespace) -> Any:
    if getattr(args, "dsn", None):
        raise UsageError(f"{args.command} works on file sessions; the PostgreSQL backend verifies every "
                         "record as it reads it")
    return session_dir(require_storage(args), args.session)


def _print_json(value: dict[str, Any]) -> None:
    sys.stdout.write(json_lossless.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def format_report(r: Report) -> str:
    lines = [f"session {r.session_id}: {r.path}",
             f"  {r.records} records, seq {r.first_seq}..{r.last_seq}, {r.size} bytes"]
    if r.segments:
        zst = sum(1 for name in r.segments if name.endswith(".zst"))
        lines.append(f"  {len(r.segments)} sealed segments ({zst} compressed) before the active one; each checked "
                     "against the SHA-256 recorded when it was sealed")
    if r.expired:
        e = r.expired
        lines.append(f"  note: seqs 1..{e['last_seq']} expired by retention (the `expired` record at seq "
                     f"{e['expired_seq']}); the chain is checked from there and the history folded from that record")
    if r.writer_pid:
        lines.append(f"  note: a writer (pid {r.writer_pid}) has the session open; an incomplete last record "
                     "may be a write in progress")
    for p in r.problems:
        lines.append(f"  PROBLEM {p.describe()}")
    for g in r.gaps:
        span = f"seq {g.after_seq} -> {g.next_seq} ({g.next_seq - g.after_seq - 1} missing)"
        if g.corrupt and not g.explained:
            continue  # the corrupt record(s) reported above are where these seqs were
        if g.explained:
            lines.append(f"  note: gap {span}, left by an earlier repair (recorded in the log)")
        else:
            lines.append(f"  PROBLEM gap {span}: records are missing and no repair recorded it")
    cp = r.checkpoint
    if cp["status"] == "missing":
        lines.append("  checkpoint: none (open replays the whole log)")
    elif cp["status"] == "valid":
        lines.append(f"  checkpoint: valid at seq {cp['seq']} ({cp['behind']} events behind the head)")
        if str(cp.get("messages", "")).startswith("damaged"):
            lines.append(f"  PROBLEM checkpoint's message section {cp['messages']} (harmless: open reads the "
                         "messages from the log instead; the next close or repair replaces it)")
    else:
        lines.append(f"  PROBLEM checkpoint ignored by open: {cp['reason']} (harmless: open replays the log; "
                     "repair removes it)")
    for name in r.side_files:
        lines.append(f"  side file: {name}")
    for f in r.semantic:  # tool-call pairing and order of the history (semantic.py)
        lines.append(f"  {'PROBLEM' if f.problem else 'note:'} {f.describe()}")
    lines.append("verdict: clean" if r.ok else f"verdict: problems found; {next_step(r)}")
    return "\n".join(lines)


def next_step(r: Report) -> str:
    """What fixes what verify found: plain ``repair`` for damaged bytes, ``repair --semantic`` for tool calls
    that do not pair up, neither for another session's log (a copied or renamed folder)."""
    if any(p.kind == "session" for p in r.problems):
        return FOREIGN_LOG_ADVICE
    damaged = bool(r.problems) or any(not g.explained and not g.corrupt for g in r.gaps) \
        or r.checkpoint["status"] not in ("missing", "valid") or not r.checkpoint.get("ok", True)
    semantic = any(f.problem for f in r.semantic)
    sid = r.session_id
    if damaged and semantic:
        return (f"`context-persistent repair {sid}` keeps every valid record and quarantines the rest; then "
                f"`context-persistent repair --semantic {sid}` records what answers the tool calls")
    if semantic:
        return (f"the log's bytes are sound; `context-persistent repair --semantic {sid}` records placeholder "
                "results for the unanswered tool calls and hides orphan results (as events; nothing is rewritten)")
    return f"`context-persistent repair {sid}` keeps every valid record and quarantines the rest"


def format_repair(r: RepairResult) -> str:
    if not r.changed and any(p.kind == "segment" for p in r.unfixable):
        lines = [f"session {r.session_id}: not repaired: a sealed segment is damaged (nothing was changed)"]
    elif not r.changed:
        lines = [f"session {r.session_id}: the log needs no repair ({r.kept} valid records)"]
        if r.checkpoint_removed:
            lines.append("  removed a checkpoint open would ignore (a cache; the next close writes a new one)")
    else:
        lines = [f"repaired session {r.session_id}: {r.path}",
                 f"  kept {r.kept} valid records byte for byte"]
        for p in r.quarantined:
            lines.append(f"  quarantined {p.describe()}")
        if r.quarantine_file:
            lines.append(f"  quarantined bytes saved in {r.quarantine_file}")
        for g in r.gaps:
            lines.append(f"  seq gap {g.after_seq} -> {g.next_seq} left in place (seqs are never renumbered)")
        if r.audit_seq:
            lines.append(f"  recorded the repair as event seq {r.audit_seq} (log_repaired)")
        if r.checkpoint_removed:
            lines.append("  removed the checkpoint (a cache; the next open replays the log)")
        lines.append(f"  rebuilt the log atomically: {r.old_size} -> {r.new_size} bytes")
    for p in r.unfixable:
        why = ("repair never rewrites a sealed segment: restore it from a backup" if p.kind == "segment"
               else FOREIGN_LOG_ADVICE if p.kind == "session"
               else "its checksum is valid: repair never removes a valid record")
        lines.append(f"  NOT FIXED {p.describe()} ({why})")
    return "\n".join(lines)


def _run(args: argparse.Namespace, name: str, work: Any, describe: Any, quiet: bool = False) -> Any:
    """Run verify or repair with a progress bar (on a terminal), print the result (unless ``quiet``), return it."""
    bar = Progress(f"{name} {args.session}")
    try:
        result = work(_directory(args), args.session, progress=bar)
    finally:
        bar.close()
    if quiet:
        return result
    if args.json:
        _print_json(result.to_dict())
    else:
        print(describe(result))
    return result


def run_verify(args: argparse.Namespace) -> int:
    from ..operations.repair import verify

    receipt = _load_receipt(args.receipt) if getattr(args, "receipt", None) else None
    if receipt is not None and getattr(args, "dsn", None):
        return _verify_receipt_pg(args, receipt)
    report = _run(args, "verify", verify, format_report, quiet=receipt is not None and args.json)
    if receipt is None:
        return EXIT_OK if report.ok else EXIT_PROBLEM
    from ..operations.erasure import check_receipt

    if receipt.get("session_id") != args.session:
        raise UsageError(f"the receipt is for session {receipt.get('session_id')!r}, not {args.session!r}")
    problems = check_receipt(_directory(args), receipt)
    return _receipt_result(args, receipt, problems, report.to_dict(), report.ok)


def _load_receipt(path: str) -> dict[str, Any]:
    from ..operations.erasure import check_receipt_shape

    try:
        with open(path, "rb") as f:
            receipt = json_lossless.loads(f.read())
    except OSError as e:
        raise UsageError(f"cannot read the receipt {path}: {e.strerror}") from None
    except orjson.JSONDecodeError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    try:
        check_receipt_shape(receipt)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    return receipt  # type: ignore[no-any-return]


def _receipt_result(args: argparse.Namespace, receipt: dict[str, Any], problems: list[str],
                    report: dict[str, Any] | None, log_ok: bool) -> int:
    m = receipt["message"]
    shown = {k: v for k, v in m.items() if k != "hmac_key"}  # (the key lets its holder test guesses)
    if args.json:
        _print_json({**(report or {}), "receipt": {"message": shown, "ok": not problems, "problems": problems,
                                                   "not_covered": receipt.get("not_covered", [])}})
    else:
        for p in problems:
            print(f"  PROBLEM receipt: {p}")
        if not problems:
            trashed = sum(len(t.get("records", [])) for t in receipt.get("trash", []))
            print(f"receipt: the erased bytes ({m['bytes']} bytes, {m.get('hmac') or m.get('sha256')}) are nowhere "
                  f"in the session, and the log holds {len(receipt.get('records', []))} tombstone(s) in their place"
                  + (f", its expired segments in the trash {trashed}" if trashed else ""))
            for n in receipt.get("not_covered", []):
                print(f"  not covered: {n['what']}: {n['why']}")
        else:
            print("receipt: NOT confirmed")
    return EXIT_OK if log_ok and not problems else EXIT_PROBLEM


def _verify_receipt_pg(args: argparse.Namespace, receipt: dict[str, Any]) -> int:
    from ..store.manager import PersistentContextManager
    from . import backend_of

    async def check() -> list[str]:
        store = await PersistentContextManager.open(storage_path=storage_of(args), session_id=args.session,
                                                    readonly=True, **backend_of(args))
        try:
            return await store.verify_erasure(receipt)
        finally:
            await store.close()

    return _receipt_result(args, receipt, asyncio.run(check()), None, True)


def format_semantic(r: SemanticRepair) -> str:
    if not r.changed and not r.left:
        return f"session {r.session_id}: tool calls and results are paired; nothing to record"
    lines = [f"session {r.session_id}: recorded semantic fixes as events (no record was edited)"]
    for p in r.placeholders:
        lines.append(f"  placeholder result for {', '.join(_ids(p['message']))} added as seq {p['seq']}")
    for d in r.redacted:
        lines.append(f"  orphaned result {', '.join(d['call_ids'])} (seq {d['seq']}) hidden by a redaction")
    for f in r.left:
        lines.append(f"  NOT FIXED {f.describe()} (the message holds other content; request views leave the "
                     "orphaned blocks out)")
    if r.audit_seq:
        lines.append(f"  recorded what was done as event seq {r.audit_seq} (semantic_repaired)")
    return "\n".join(lines)


def _ids(message: dict[str, Any]) -> list[str]:
    from ..operations.semantic import _answered_ids

    return _answered_ids(message)


def _hint_semantic(args: argparse.Namespace) -> None:
    """After a plain repair: if the history's tool calls still do not pair up (which only ``--semantic`` fixes),
    say so, rather than leave "needs no repair" as the last word."""
    from ..operations.repair import verify

    report = verify(session_dir(require_storage(args), args.session), args.session)
    unpaired = [f for f in report.semantic if f.problem]
    if unpaired:
        print(f"  the history's tool calls do not pair up ({len(unpaired)} finding"
              f"{'s' if len(unpaired) > 1 else ''}: {unpaired[0].describe()}); "
              f"`context-persistent repair --semantic {args.session}` records the fixes as events")


def run_repair(args: argparse.Namespace) -> int:
    from ..operations.repair import repair
    from ..store.semantic_repair import repair_semantic

    try:
        result = _run(args, "repair", repair, format_repair, quiet=getattr(args, "semantic", False))
    except SessionLockedError as e:
        holder = f"pid {e.pid}" if e.pid else "another process"
        raise _Locked(
            f"session {e.session_id!r} is open for writing by {holder}: repair needs the session to itself. "
            f"Stop that agent (or let it close the session), then run `context-persistent repair {e.session_id}` "
            f"again; `context-persistent verify {e.session_id}` works meanwhile") from None
    if not getattr(args, "semantic", False):
        if not result.unfixable and not args.json and not getattr(args, "quiet", False):
            _hint_semantic(args)
        return EXIT_PROBLEM if result.unfixable else EXIT_OK
    # --semantic: one report (one JSON object) for both steps; the semantic step runs on a readable log only
    fixed = None if result.unfixable else asyncio.run(repair_semantic(storage_of(args), args.session))
    if args.json:
        _print_json({**result.to_dict(), "semantic": fixed.to_dict() if fixed is not None else None})
    else:
        print(format_repair(result))
        if fixed is not None:
            print(format_semantic(fixed))
    return EXIT_PROBLEM if result.unfixable else EXIT_OK


def run_migrate(args: argparse.Namespace) -> int:
    from ..storage.log import SEGMENT_BYTES
    from ..storage.segment_store import migrate

    directory = _directory(args)
    size = SEGMENT_BYTES if args.segment_bytes is None else args.segment_bytes
    try:
        result = migrate(directory, args.session, size, args.compress)
    except SessionLockedError as e:
        holder = f"pid {e.pid}" if e.pid else "another process"
        raise _Locked(f"session {e.session_id!r} is open for writing by {holder}: migrate needs the session to "
                      f"itself. Let that agent close the session, then run `context-persistent migrate "
                      f"{e.session_id}` again") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        _print_json(result)
        return EXIT_OK
    for line in result["recovered"]:  # type: ignore[attr-defined]
        print(f"  finished first: {line}")
    if result.get("already"):
        done = result["compressed"]
        print(f"session {args.session} is already segmented; "
              + (f"compressed {len(done)} sealed segment(s): {', '.join(done)}" if done  # type: ignore[arg-type]
                 else "nothing to do" + ("" if args.compress else " (--compress compresses its sealed segments)")))
        return EXIT_OK
    sealed = result["sealed"]
    print(f"migrated session {args.session}: {result['bytes']} bytes into {len(sealed)} sealed segment(s) "  # type: ignore[arg-type]
          f"({', '.join(sealed)}) and an empty active events.jsonl; byte positions are unchanged")  # type: ignore[arg-type]
    return EXIT_OK


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more bytes, got {value}")
    return value


class _Locked(ContextPersistentError):
    """The session is held by a writer: what a command-line user can do about it."""


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "verify", parents=[common], formatter_class=fmt,
        help="check every record of a session; exit 0 clean, 1 with a report",
        description="Check every record of a session's log (checksums, seq order, the chain binding each record "
                    "to its predecessor and session, torn tail, gaps), its checkpoint, and the history it holds "
                    "(tool calls paired with their results, in order). Never takes the lock: safe while an agent "
                    "writes.",
        epilog="examples:\n  context-persistent verify my-session\n  context-persistent verify my-session --json\n"
               "  context-persistent verify my-session --receipt erased-42.json\n"
               "exit codes: 0 clean, 1 problems found (report printed), 2 usage error\n",
    )
    p.add_argument("session", metavar="SESSION", help="session id")
    p.add_argument("--receipt", metavar="FILE",
                   help="also check an erasure receipt (from `erase`): the erased bytes must be nowhere in the "
                        "session folder and its expired segments in the trash (with --dsn: in the session's rows) "
                        "and the tombstones in place")
    p.set_defaults(func=run_verify)
    p = sub.add_parser(
        "repair", parents=[common], formatter_class=fmt,
        help="rebuild a session's log keeping every valid record, quarantining bad bytes",
        description="Rebuild a session's log atomically: every valid record is kept byte for byte, every bad "
                    "byte goes to events.jsonl.quarantine-* in the session folder, seq gaps are left and "
                    "recorded. Takes the writer lock: refuses while a store has the session open.",
        epilog="examples:\n  context-persistent repair my-session\n  context-persistent repair --semantic my-session\n"
               "  context-persistent verify my-session || context-persistent repair my-session\n"
               "exit codes: 0 repaired or nothing to do, 1 refused (session locked) or not everything fixable\n",
    )
    p.add_argument("session", metavar="SESSION", help="session id")
    p.add_argument("--semantic", action="store_true",
                   help="also record fixes for unpaired tool calls and results as events: a placeholder result "
                        "for each unanswered call, a redaction for each message of orphaned results")
    p.set_defaults(func=run_repair)
    p = sub.add_parser(
        "migrate", parents=[common], formatter_class=fmt,
        help="convert a single-file session log to sealed segments (optionally compressed)",
        description="Convert a session's single-file log (events.jsonl) into sealed segments listed in "
                    "segments.json, cut every --segment-bytes, and start an empty active segment; on a log that "
                    "has segments already, --compress compresses the sealed ones. Crash-safe: the old file stays "
                    "the log until the new files are written and verified. Takes the writer lock: refuses while a "
                    "store has the session open. Single-file logs keep working without it.",
        epilog="examples:\n  context-persistent migrate my-session\n"
               "  context-persistent migrate my-session --compress --segment-bytes 16777216\n"
               "exit codes: 0 migrated or nothing to do, 1 refused (session locked, not found, damaged log), "
               "2 usage error\n",
    )
    p.add_argument("session", metavar="SESSION", help="session id")
    p.add_argument("--segment-bytes", type=_byte_count, default=None, metavar="N",
                   help="cut a segment at the first record end after every N bytes (default 67108864, 64 MiB; "
                        "0: one segment)")
    p.add_argument("--compress", action="store_true", help="store the sealed segments as zstd frames (.jsonl.zst)")
    p.set_defaults(func=run_migrate)
