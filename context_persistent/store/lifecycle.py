"""Opening and closing a store: the log opened and replayed (from a checkpoint when there is one), a torn
tail recovered, the session started; at close the pending writes flushed, a checkpoint handed off, the lock
released."""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable

from ..model import codec
from ..model import events as ev
from .appends import Appends
from ..errors import InvalidRecordError
from ..storage.log import FileEventLog
from .session import EVENT_RECOVERED, PROGRAM, Session
from .writer import Writer

logger = logging.getLogger("context_persistent")


class Lifecycle:
    """Loads and closes one session."""

    def __init__(self, session: Session, writer: Writer, appends: Appends,
                 after_load: Callable[[], Awaitable[None]] | None = None) -> None:
        self._s = session
        self._writer = writer
        self._appends = appends
        #: What the other parts rebuild from the log once it is loaded (the usage meter's reports).
        self._after_load_hook = after_load

    async def load(self) -> None:
        """Replay the log (from the newest usable checkpoint), then recover and start the session."""
        s = self._s
        # Replay allocates millions of objects that all stay alive: the cyclic GC would scan them again and
        # again for nothing (about 40% of a 1M-event open). Records are acyclic, so pause it while we fold.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            # Compare with the *requested* tokenizer: asking the counter for its name would load the encoding
            # (~0.1-0.3 s) on every open; the ledger checks the loaded one on first use.
            s.state = await s.checkpoints.load(s.log, lambda: s.counter.requested)
        except InvalidRecordError as e:
            e.path = str(s.log.path)
            raise
        finally:
            if gc_was_enabled:
                gc.enable()
        total = s.checkpoints.loaded_total
        if total is not None:  # (every message had a count at the checkpoint: stats() need not read them)
            s.token_total_hint = (s.epoch, total[0], s.state.tokens, total[1])
        await self._after_load()
        if self._after_load_hook is not None:
            await self._after_load_hook()

    async def _after_load(self) -> None:
        """Recover a torn tail, note what was loaded, start a new log with ``session_started``."""
        s = self._s
        state = s.state
        s.loaded_from_file = state.has_history
        if state.has_history and not s.readonly:
            self._appends.begin_resume(state)
        await self._recover_torn_tail()
        if state.head_seq == 0 and not s.readonly:
            await self._writer.commit(ev.SESSION_STARTED, {
                "format": codec.FORMAT_VERSION,
                "tokenizer": s.counter.requested,
                "program": PROGRAM,
                "session_id": s.session_id,
            })

    async def _recover_torn_tail(self) -> None:
        """Cut an incomplete last record (saved to a side file first); a read-only store leaves it to the writer."""
        s = self._s
        log = s.log
        if not isinstance(log, FileEventLog) or log.torn is None:  # only files can tear
            return
        torn = log.torn
        if s.readonly:
            logger.info("%s: ignoring an incomplete last record at byte %d (a writer may be appending)",
                        log.path, torn.offset)
            return
        log.cut_torn_tail()
        s.recovered = torn
        logger.warning("%s: cut a torn last record at line %d, byte offset %d (%d bytes; %s); the bytes were saved "
                       "to %s", log.path, torn.line, torn.offset, torn.length, torn.reason, torn.saved_to)
        await s.emit(EVENT_RECOVERED, {
            "path": str(log.path), "line": torn.line, "offset": torn.offset, "length": torn.length,
            "reason": torn.reason, "saved_to": torn.saved_to, "last_seq": s.state.head_seq,
        })

    async def close(self) -> None:
        """Flush pending writes, write a checkpoint if due and release the session's lock (idempotent)."""
        s = self._s
        if s.closed:
            return
        self._appends.end_replay()  # an unconfirmed replay stays as written: duplicates are better than loss
        await self._writer.close()
        s.closed = True
        s.handed_out = []
        try:
            await s.checkpoints.close(s.state, s.log, s.tokenizer_name)
            if s.indexer is not None:  # (the search index's thread: the session's pending catch-up, bounded)
                await (s.indexer.leave if s.index_left_to_readers else s.indexer.wait)(s.session_id)
        finally:
            await s.log.close()
            if s.pager is not None:
                s.pager.close()

