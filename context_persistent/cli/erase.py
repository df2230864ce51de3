"""``erase``: remove a message's bytes from a closed session (taking its writer lock) and write a receipt.

``verify SESSION --receipt FILE`` (durability.py) checks the receipt later. See docs/operations.md, "Erasure".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from ..errors import ContextPersistentError, SessionLockedError, SessionNotFoundError
from ..storage.paths import FILE_MODE, session_dir
from ..storage.segments import has_log
from . import backend_of, require_storage
from .common import _parser, _run, _seq
from .output import print_json


class _Locked(ContextPersistentError):
    """The session is held by a writer: what a command-line user can do about it."""


def write_receipt(path: str, receipt: dict[str, Any]) -> None:
    """Write the receipt to ``path`` (0600) via a temp file and a rename; ``-`` is stdout."""
    data = orjson.dumps(receipt, option=orjson.OPT_INDENT_2) + b"\n"
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)


def format_receipt(r: dict[str, Any]) -> str:
    m = r["message"]
    lines = [f"erased from session {r['session_id']}: the {m['role']} message at seq {m['seq']} (index "
             f"{m['index']}), {m['bytes']} bytes, {m.get('hmac') or m.get('sha256')}"]
    for rec in r["records"]:
        where = f"byte offset {rec['offset']}" if "offset" in rec else f"row seq {rec['row']}"
        lines.append(f"  log: seq {rec['seq']} ({rec['type']}, {where}) replaced by a tombstone")
    for cp in r["checkpoints"]:
        lines.append(f"  checkpoint {cp['where']}: deleted (the next close writes a new one)")
    for sf in r["side_files"]:
        lines.append(f"  side file {sf['where']}: {sf['copies']} cop{'y' if sf['copies'] == 1 else 'ies'} removed")
    for ex in r["exports"]:
        lines.append(f"  compaction export {ex['where']}: {ex['lines']} line(s) removed")
    for t in r.get("trash", []):
        seqs = ", ".join(f"seq {x['seq']} ({x['type']})" for x in t["records"])
        lines.append(f"  trash entry {t['entry']}, expired segment {t['where']}: {seqs} replaced by a tombstone")
    for name in r.get("removed_temp_files", []):
        lines.append(f"  leftover {name}: removed")
    if r.get("vacuum"):
        lines.append(f"  {r['vacuum']['command']}: run on {', '.join(r['vacuum']['tables'])}")
    lines.append(f"  snapshots: {r['snapshots']}")
    for n in r.get("not_covered", []):
        lines.append(f"  not covered: {n['what']}: {n['why']}")
    return "\n".join(lines)


async def _erase(args: argparse.Namespace) -> int:
    from ..store.manager import PersistentContextManager

    backend: dict[str, Any] = dict(backend_of(args))
    storage = require_storage(args)
    if not backend and not has_log(session_dir(storage, args.session)):
        raise SessionNotFoundError(f"session {args.session!r} not found in {storage}")
    if backend:  # (a writer open would create a missing session)
        probe = await PersistentContextManager.open(storage_path=storage, session_id=args.session, readonly=True,
                                                    **backend)
        await probe.close()
    try:
        store = await PersistentContextManager.open(storage_path=storage, session_id=args.session,
                                                    recognise_replay=False, **backend)
    except SessionLockedError as e:
        holder = f"pid {e.pid}" if e.pid else "another process"
        raise _Locked(f"session {e.session_id!r} is open for writing by {holder}: erase needs the session to itself. "
                      "Stop that agent (or let it close the session) and run erase again; a running agent can "
                      "erase through the API (PersistentContextManager.erase)") from None
    vacuum: bool | str = {None: False, "plain": True, "full": "full"}[args.vacuum]  # type: ignore[assignment]
    try:
        if args.message_index is not None:
            receipt = await store.erase(args.message_index, reason=args.reason, vacuum=vacuum)
        else:
            receipt = await store.erase(seq=args.seq, index=args.index, reason=args.reason, vacuum=vacuum)
    finally:
        await store.close()
    if args.receipt:
        write_receipt(args.receipt, receipt)
    if args.json:
        if args.receipt != "-":
            print_json(receipt)
    elif args.receipt != "-":
        print(format_receipt(receipt))
        if args.receipt:
            print(f"receipt written to {args.receipt}; `context-persistent verify {args.session} --receipt "
                  f"{args.receipt}` checks it")
        else:
            print("receipt (keep it; `context-persistent verify SESSION --receipt FILE` checks it):")
            print(orjson.dumps(receipt, option=orjson.OPT_INDENT_2).decode())
    return 0


def _index(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a message position (an integer), got {text!r}") from None


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, common, "erase",
                "remove a message's bytes from a session (log, checkpoint, side files, compaction exports, "
                "expired segments in the trash, PostgreSQL rows), leaving a tombstone; prints or writes a receipt. "
                "Takes the writer lock",
                "  context-persistent erase my-session --seq 42 --receipt erased-42.json\n"
                "  context-persistent erase my-session --message-index -1 --reason 'user request'\n"
                "  context-persistent verify my-session --receipt erased-42.json\n"
                "exit codes: 0 erased, 1 refused (session locked or not found), 2 usage error (no such message)\n")
    p.add_argument("session", metavar="SESSION", help="session id")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--seq", type=_seq, help="the seq of the record holding the message (message_added, or "
                       "messages_replaced with --index)")
    which.add_argument("--message-index", type=_index, metavar="I",
                       help="the message's position in the history (as `show` numbers them; negative from the end)")
    p.add_argument("--index", type=int, default=0, metavar="I",
                   help="with --seq: the message's position in a messages_replaced record (default 0)")
    p.add_argument("--reason", default="", help="why (stored in the tombstone and the receipt)")
    p.add_argument("--receipt", metavar="FILE", help="write the receipt (JSON) to FILE ('-': stdout only)")
    p.add_argument("--vacuum", nargs="?", const="plain", choices=("plain", "full"), default=None,
                   help="PostgreSQL (--dsn): then VACUUM the events and checkpoints tables, removing the old row "
                   "versions that still hold the message ('full': VACUUM FULL, which rewrites the tables and locks "
                   "them meanwhile)")
    p.set_defaults(func=_run(_erase))
