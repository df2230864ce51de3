"""Storage: where a session's records live and how they are read back. I/O only; it decides no policy.

What it holds: ``eventlog`` (the contract every backend meets), ``log`` (``FileEventLog``: lock, append,
fsync, scan, torn-tail cut, roll), ``segments`` and ``segment_store`` (sealed segments and the writer's steps
on them), ``records`` (scanning a log file: where its data ends), ``running_hash``, ``follow`` (watching a log
grow), ``pages`` (messages read back by their ref), ``paths`` (folders, modes, session ids), ``trash_folder``
(where the trash keeps a session), ``backends`` (which log a configuration selects), ``checkpoint/``
(checkpoint payloads, where they are stored, when they are written) and ``pg/`` (the PostgreSQL backend).

May import: ``model`` and ``errors``. Never ``operations``, ``transfer``, ``store``, ``integrations`` or
``cli``; a storage module that needs something above gets it passed in. Checked by import-linter
(``.importlinter``).
"""
