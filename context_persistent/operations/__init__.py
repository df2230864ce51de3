"""Operations on stored sessions, beside the store: they work on the files and rows of a session, not on
an open store's memory.

What it holds: ``erasure`` (rewriting records as tombstones, scrubbing every copy; its parts ``tombstones``,
``erasure_scrub``, ``erasure_receipt``), ``repair`` and ``semantic`` (quarantining damaged records; fixing
unanswered tool calls as events; repair's parts ``verify``, ``log_walk``, ``checkpoint_check``,
``repair_report``), ``trash`` and ``segment_expiry`` (retention's moves: sessions to the trash, expired
segments out of the log) and ``retention_on_open`` (applying a retention policy when a store opens).

May import: ``storage``, ``model`` and ``errors``. Never ``transfer``, ``store``, ``integrations`` or
``cli``: an operation that needs an open store takes one as an argument (typed by a ``Protocol`` or under
``TYPE_CHECKING``). Checked by import-linter (``.importlinter``).
"""
