"""Checkpoints: the projection state at a seq, so opening a long session replays only the tail.

A checkpoint is a cache. Open = newest valid checkpoint + the records after it; a missing, stale,
truncated, corrupt, foreign or too-new checkpoint is ignored (full replay) and never changes the result.
Deleting one is always safe.

Layers, so any backend can store the same payload (each module imports only those listed before it;
this package re-exports their names):

* the payload (pure): in ``payload.py``, :func:`snapshot` serialises a :class:`Projection` (one
  ``orjson.dumps`` call; :func:`dump_in_steps` does the same for a :meth:`Projection.capture` in steps between
  which the event loop runs), :func:`encode` frames it with a header and a CRC, :func:`decode` verifies and
  parses it, :func:`mismatch` and :func:`restore` decide whether it fits this session and rebuild the state;
  ``front.py`` takes and restores the front section (below); ``sections.py`` puts a message section's
  messages in the pager's cache;
* where it is stored (I/O, ``store.py``): a :class:`CheckpointStore` (``load``/``save``/``discard`` of payload
  bytes); :class:`FileCheckpointStore` keeps ``<session>/checkpoint.json`` (temp file 0600, fsync, rename,
  fsync folder). Another backend exposes its own store as ``log.checkpoint_store``;
* the log folded into a state outside the open's own replay (``replay.py``): :func:`seed_state`, where a
  replay starts (seeded from the ``expired`` record when the oldest segments expired), and the folds that
  complete a lazily opened checkpoint (:func:`replay_from_base`, :func:`replay_sync`);
* when (``policy.py``: :class:`Checkpointer`, used by the manager): every ``checkpoint_every`` events and on
  close.

Payload layout (bytes)::

    {"checkpoint":3,"format":1,"schema":[...],"session_id":"…","seq":N,"position":P,
     "first_crc":"…","last_crc":"…","tokenizer":"…"|null,"front_bytes":F,"state_bytes":L,
     "base":null|{"seq":B,"position":Q,"last_crc":"…"}}\\n                     <- header line
    <F bytes: the front section JSON, or null>\\n
    xxxxxxxx\\n                                          <- CRC-32 of the header line and the front section
    <L bytes: the state JSON, Projection.to_state(refs=True)>\\n
    xxxxxxxx\\n                                          <- CRC-32 of the state section
    <M bytes: the message section JSON>\\n               (layout 5, ``"messages_bytes":M`` in the header)
    xxxxxxxx\\n                                          <- CRC-32 of the message section

Layout 4: beside a file log the state's ``messages`` are refs into the log (``position << 20 | index``,
pages.py), not message contents; layouts 2 and 3 (contents) are still read (docs/format.md, "Checkpoints").
Layout 5 adds the message section: while the whole history is in the pager's cache, the messages the refs name,
in one array (``payload.dump_messages``), which loading the history parses in one call into the cache
(``sections.py``) instead of reading the log; a damaged one is reported and the log read instead.

The front section (:func:`front_of`) is what the first request view of a long session needs: the session
facts, every system/developer message, the first turns, each pinned message with the turns around it, and the
newest messages up to twice the largest budget seen, each with its index, key and token count (if known).
Opening a file checkpoint reads and verifies the header and the front only; the state section is read, verified
and parsed when something needs the whole history (:class:`~context_persistent.model.projection.LazyList`), from the file
descriptor opened at open (a newer checkpoint renamed over it later does not change what it reads). If the
state section then fails verification, the history is rebuilt from the log instead (it is the source of truth).
A PostgreSQL checkpoint (the same payload in one ``bytea``) opens the same way: its header and front section are
read as ``substring`` calls on the row, the state section later, with a check that the row still holds the payload
whose front was read (``pg/log.py``: ``PostgresCheckpointStore.open_front``, ``PostgresStateSection``).

A *based* checkpoint (``base`` not null) is what a store writes while its history is still lazy: a new header
and front section, and the state section of the checkpoint it was opened from, not loaded: by reference
(``state_in``: the section stays in that file, kept as ``checkpoint.base`` by a hard link, so a periodic
checkpoint costs the front section only) or, where the file system cannot link, copied byte for byte after the
front: that section is at ``base``, and loading the rest replays the log from ``base.position`` up to
``position``. So a periodic checkpoint never has to load a lazily opened history (seconds at a million
messages). The log between is bounded (``BASE_MAX_FACTOR``), and ``base`` is anchored like ``seq`` (its
record's seq and CRC at its position). Layout 2 (no ``base``) is still read.

Identity: ``session_id``, the log ``format``, the projection layout (``schema``: its slot names) and
``first_crc``, the checksum of the log's first record (``session_started``, unique by its timestamp), which
rejects a checkpoint of an older incarnation of the same session id. ``last_crc`` is the checksum of the
record at ``seq``; a backend that can look it up (``log.record_before(position)``) proves the log still holds
that exact record at that position. A log shorter than the checkpoint is detected after the tail read.

Cost: a checkpoint is O(state). In the caller's turn only the capture (shallow copies of three lists) and
the front section; the state is serialised in steps of ``DUMP_STEP`` items with the event loop free between
them, and framing, CRC and the file write + fsync run in a worker thread while appends continue. With
``checkpoint_every = K`` that is O(state / K) amortised per append.
"""

from __future__ import annotations

from .payload import (CHECKPOINT_VERSION, DUMP_STEP, READABLE_VERSIONS, SCHEMA, Checkpoint, CheckpointError, decode,
                      dump_in_steps, encode, encode_front, mismatch, restore, snapshot)
from .front import FRONT_EXTRA_TURNS, FRONT_MAX_SPAN, FRONT_RECENT_FACTOR, SystemIndex, front_of, restore_front
from .store import CheckpointStore, FileCheckpointStore, checkpoint_store_for, first_record_crc, read_front, read_state
from .replay import replay_from_base, replay_sync, seed_state
from .policy import BASE_MAX_FACTOR, CLOSE_MIN_BYTES, CLOSE_MIN_EVENTS, Checkpointer

__all__ = [
    "BASE_MAX_FACTOR", "CHECKPOINT_VERSION", "CLOSE_MIN_BYTES", "CLOSE_MIN_EVENTS", "Checkpoint", "CheckpointError",
    "CheckpointStore", "Checkpointer", "DUMP_STEP", "FRONT_EXTRA_TURNS", "FRONT_MAX_SPAN", "FRONT_RECENT_FACTOR",
    "FileCheckpointStore", "READABLE_VERSIONS", "SCHEMA", "SystemIndex", "checkpoint_store_for", "decode",
    "dump_in_steps", "encode", "encode_front", "first_record_crc", "front_of", "mismatch", "read_front",
    "read_state", "replay_from_base", "replay_sync", "restore", "restore_front", "seed_state", "snapshot",
]
