"""The store: ``PersistentContextManager`` (``manager``), a facade over its parts.

What it holds: ``manager`` (the public methods, each delegating to one part), its parts ``appends``,
``system_prompt``, ``edits``, ``erase``, ``request_views``, ``ledger``, ``lifecycle``, ``writer``,
``session`` (what the parts share) and ``config`` (the configuration's keys and rules), and ``importing``
(``import_`` and ``export_session``: the operations that open a store themselves).

May import: ``transfer``, ``operations``, ``storage``, ``model`` and ``errors``. Never ``integrations`` or
``cli``. Checked by import-linter (``.importlinter``).
"""
