"""Erasing a message from everything the store wrote, and checking an erasure receipt: the store's side (which
message, waiting for pending writes, rebuilding the history from the new log); erasure.py rewrites the files
and rows."""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .appends import Appends
from .edits import HistoryEdits
from ..storage.log import FileEventLog
from ..model.projection import MAX_BATCH, make_key, split_key
from .session import Session
from .writer import Writer

if TYPE_CHECKING:
    from .manager import PersistentContextManager

logger = logging.getLogger("context_persistent")


class Eraser:
    """``erase`` and ``verify_erasure`` for one session.

    ``forget()`` drops what was derived from the history (token counts' search hint, the cached request
    view); ``store`` is handed to erasure.py, which reads the log and checkpoints through it.
    """

    def __init__(self, session: Session, writer: Writer, appends: Appends, edits: HistoryEdits,
                 forget: Callable[[], None], store: PersistentContextManager) -> None:
        self._s = session
        self._writer = writer
        self._appends = appends
        self._edits = edits
        self._forget = forget
        self._store = store

    def _target(self, message_index: int | None, seq: int | None, index: int) -> tuple[int, int]:
        if (message_index is None) == (seq is None):
            raise ValueError("give exactly one of message_index (position in get_messages()) or seq")
        if message_index is not None:
            return split_key(self._edits.resolve_key(message_index, None))
        head = self._s.state.head_seq
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= head:
            raise ValueError(f"seq must be an int from 1 to {head}, got {seq!r}")
        return seq, index

    async def erase(self, message_index: int | None, seq: int | None, index: int, reason: str,
                    vacuum: bool | str = False) -> dict[str, Any]:
        if not isinstance(reason, str):
            raise ValueError(f"reason must be a string, got {type(reason).__name__}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_BATCH:
            raise ValueError(f"index must be an int from 0 to {MAX_BATCH - 1}, got {index!r}")
        if vacuum not in (False, True, "full"):
            raise ValueError(f"vacuum must be False, True or \"full\", got {vacuum!r}")
        s = self._s
        if vacuum and isinstance(s.log, FileEventLog):
            raise ValueError("vacuum applies to the PostgreSQL backend only (a file log keeps no old row versions)")
        s.check_writable()
        self._appends.end_replay()
        await self._writer.drain()  # (batch mode: what is queued goes first)
        # An export_on_compact of this process writes its snapshot under the same lock: it finishes before the
        # copies are searched, or starts after the erase (and then never sees the message).
        async with s.rewriting, self._writer.exclusive():
            s.check_writable()
            return await self._erase_held(message_index, seq, index, reason, vacuum)

    async def _erase_held(self, message_index: int | None, seq: int | None, index: int, reason: str,
                          vacuum: bool | str) -> dict[str, Any]:
        from ..operations import erasure

        s = self._s
        seq, index = self._target(message_index, seq, index)
        checkpoints = s.checkpoints
        if checkpoints._task is not None:  # a checkpoint being written would bring the message back
            await asyncio.shield(checkpoints._task)
        s.full()  # nothing may be read from the old checkpoint after it is deleted
        if s.indexer is not None:  # (the search index's thread must not index the old log after it is emptied)
            await s.indexer.wait(s.session_id)
        before, head = array("q", s.state.keys), s.state.head_seq
        if isinstance(s.log, FileEventLog):
            from ..operations.search.erasing import erasing

            # the search index: the message's documents removed before the log changes, the rest moved in
            # line with the new log after it (search/erasing.py)
            async with erasing(s.storage_path, s.session_id, make_key(seq, index), head) as ix:
                receipt = erasure.erase_file(self._store, seq, index, reason, ix.moved)
                ix.committed = True
                await self._reload()
                ix.keys = (before, s.state.keys)
        else:
            from ..operations.search.erasing import erasing_pg

            pg: Any = s.log
            async with erasing_pg(pg.dsn, pg.schema, s.session_id, make_key(seq, index), head) as ix:
                receipt = await erasure.erase_postgres(self._store, seq, index, reason, vacuum, ix.moved)
                ix.committed = True
                await self._reload()
                ix.keys = (before, s.state.keys)
        receipt["index"] = ix.entry
        logger.info("session %s: erased the message at seq %d index %d (%d record(s))", s.session_id, seq, index,
                    len(receipt["records"]))
        return receipt

    async def _reload(self) -> None:
        """The history as the new log tells it, from the start (an erase is rare; the next close checkpoints
        it)."""
        s = self._s
        checkpoints = s.checkpoints
        s.rewrites += 1  # (readers iterating over the old positions re-resolve: Session.iter_messages)
        if checkpoints._lazy_file is not None:
            checkpoints._lazy_file.close()
            checkpoints._lazy_file = None
        checkpoints._lazy_source = None
        checkpoints.seq = checkpoints.position = checkpoints.loaded_seq = checkpoints.counted = 0
        if s.pager is not None:
            s.pager.clear()  # (records were rewritten in place: nothing cached from them may be served)
        s.state = await checkpoints._replay(s.log, checkpoints.fresh(s.log), 0, None)
        s.epoch += 1
        s.handed_out = []  # (what get_messages handed out may hold the erased bytes: not kept by the store)
        self._forget()

    async def verify(self, receipt: dict[str, Any]) -> list[str]:
        from ..operations import erasure

        s = self._s
        s.check_open()
        erasure.check_receipt_shape(receipt)
        if receipt.get("session_id") != s.session_id:
            raise ValueError(f"the receipt is for session {receipt.get('session_id')!r}, not {s.session_id!r}")
        from ..operations.search.erasing import check_file_index, check_pg_index

        key = receipt["message"].get("key")
        if isinstance(s.log, FileEventLog):
            return erasure.check_receipt(s.log.directory, receipt) + (
                await check_file_index(s.storage_path, s.session_id, key) if isinstance(key, int) else [])
        return await erasure.check_receipt_postgres(s.log, receipt) + (
            await check_pg_index(getattr(s.log, "dsn"), getattr(s.log, "schema"), s.session_id, key) if isinstance(key, int) else [])
