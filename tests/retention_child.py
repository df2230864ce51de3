"""Helper process for the retention crash tests (run as a script, never imported by pytest).

``python tests/retention_child.py STORAGE OP POINT N``: run OP (``apply``: max_sessions 1; ``restore ENTRY``
is given as ``restore:ENTRY``; ``purge``: force every entry) on the storage folder, SIGKILLing itself at POINT
the Nth time it is reached:

- ``before-move``: a folder rename of the trash module is about to happen (the ledger record is written);
- ``after-move``: that rename happened, before anything else;
- ``mid-delete``: a purge is deleting an entry's files (one file gone);
- ``in-transaction`` (``apply-pg``): a move's ledger row is written, its transaction not yet committed;
- ``none``: run to the end.

``apply-pg`` applies the same policy to a PostgreSQL schema (STORAGE is ``pg:DSN:SCHEMA``).

It prints ``START`` before the operation and ``DONE`` after it. A test also kills it at random moments.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from context_persistent.operations import trash
from context_persistent.model.retention import RetentionPolicy


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(storage: str, op: str, point: str, nth: int) -> None:
    seen = {"n": 0}

    def reached() -> bool:
        seen["n"] += 1
        return seen["n"] == nth

    real_rename = trash._rename

    def rename(src: Path, dst: Path) -> None:
        if point == "before-move" and reached():
            _die()
        real_rename(src, dst)
        if point == "after-move" and reached():
            _die()

    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kw: Any) -> None:
        if point == "mid-delete" and reached():
            victim = next(p for p in Path(path).rglob("*") if p.is_file())
            victim.unlink()
            _die()
        real_rmtree(path, *args, **kw)

    trash._rename = rename  # type: ignore[assignment]
    trash.shutil.rmtree = rmtree  # type: ignore[assignment]
    _say("START")
    if op == "apply":
        asyncio.run(trash.apply_file(storage, RetentionPolicy(max_sessions=1)))
    elif op.startswith("restore:"):
        asyncio.run(trash.restore(storage, op.split(":", 1)[1]))
    elif op == "purge":
        asyncio.run(trash.purge(storage, force=True))
    elif op == "apply-pg":  # STORAGE is pg:DSN:SCHEMA; one transaction per session, killed at random by the test
        from context_persistent.storage.pg.retention import apply_pg

        from context_persistent.storage.pg import retention as pg_retention

        real_append = pg_retention._Store.append

        async def append(self: Any, kind: str, data: dict[str, Any]) -> dict[str, Any]:
            out = await real_append(self, kind, data)
            if point == "in-transaction" and reached():  # the ledger row written, its transaction not committed
                _die()
            return out

        pg_retention._Store.append = append  # type: ignore[method-assign]
        dsn, schema = storage[3:].rsplit(":", 1)
        asyncio.run(apply_pg(dsn, schema, RetentionPolicy(max_sessions=1)))
    else:
        raise SystemExit(f"unknown op {op}")
    _say("DONE")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
