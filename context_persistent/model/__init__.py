"""The model of a session: events, their encoding, and the views folded from them (pure).

What it holds: ``events`` (the event types and message validation), ``codec`` (records: framing, CRC, the
chain), ``projection`` (the fold: ``Projection.apply(record)``), ``views``, ``replay`` and ``resume`` (the
resume rule's comparisons), ``grouping`` (tool calls and their results as atomic groups), ``tokens`` and
``budget`` (counting and the token budget), ``compaction/`` (the request view's strategies),
``secret_scan`` (the opt-in scanner) and ``retention`` (policies and the plan of what expires).

May import: ``context_persistent.errors`` and the standard library (plus orjson and tiktoken). No file or
database I/O, no asyncio, nothing from the layers above (storage, operations, transfer, store,
integrations, cli). Checked by import-linter (``.importlinter``).
"""
