"""Transfer: a session written out and read back in other shapes.

What it holds: ``snapshot`` (export of any view at any seq as JSONL/JSON/Markdown, fork at a seq, time travel)
and ``snapshot_codec`` (the snapshot formats: headers, checksums, reading a file). Importing a file as a
new session opens a store, so it sits with the store (``store/importing.py``, ``context_persistent.import_``).

May import: ``operations``, ``storage``, ``model`` and ``errors``. Never ``store``, ``integrations`` or
``cli``: the store's ``export``/``fork``/``open_at`` call into this package, not the other way round.
Checked by import-linter (``.importlinter``).
"""
