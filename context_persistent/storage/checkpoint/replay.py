"""The log folded into a checkpoint's projection outside the open's own replay: the state a replay starts
from (:func:`seed_state`: empty, or seeded from the ``expired`` record when the oldest segments expired), and
the synchronous folds that complete a lazily opened checkpoint (:class:`~.policy.Checkpointer`): its state
section brought from its base up to its seq (:func:`replay_from_base`), or, when that section cannot be used,
the log replayed up to the checkpoint's seq (:func:`replay_sync`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from ...model.projection import Projection
from .payload import Checkpoint, CheckpointError


def seed_state(log: Any, pager: Any) -> Projection:
    """The state a replay from ``log``'s first record starts from (:meth:`~.policy.Checkpointer.fresh`). The ``expired``
    record must be where the boundary says, with the range and crc it records: LogCorruptedError if not."""
    manifest = getattr(log, "manifest", None)
    boundary = manifest.boundary if manifest is not None else None
    if boundary is None:
        return Projection(pager)
    from ...model import codec
    from ...errors import LogCorruptedError
    from ...model.events import expired_of

    with log.reader() as reader:
        found = reader.find_seq(boundary.expired_seq)
        if found is None:
            raise LogCorruptedError(str(reader.directory), 0, boundary.start, f"the log holds no record seq "
                                    f"{boundary.expired_seq}, the expired record the segment manifest names")
        position, line = found
        try:
            rec = codec.decode(line)
        except codec.RecordError as e:
            path, offset = reader.where(position)
            raise LogCorruptedError(str(path), 0, offset, f"the expired record the segment manifest names does not "
                                    f"decode ({e})") from None
        data = expired_of(rec)  # (an expired record, or its erasure tombstone)
        if (data is None
                or data.get("last_seq") != boundary.last_seq or data.get("boundary_crc") != boundary.last_crc):
            path, offset = reader.where(position)
            raise LogCorruptedError(str(path), 0, offset, f"the record here (seq {rec['seq']}, {rec['type']}) is not "
                                    f"the expired record the segment manifest names (seq {boundary.expired_seq}, "
                                    f"up to seq {boundary.last_seq}, crc {boundary.last_crc})")
    return Projection.seeded(data, pager, position)


def replay_from_base(log: Any, state: Projection, cp: Checkpoint) -> None:
    """Bring a based checkpoint's state section (at ``cp.base``) to ``cp.seq`` with the log between."""
    assert cp.base is not None and isinstance(cp.position, int)
    start = cp.base["position"]
    for rec, end in log._records(start):  # (global positions, across sealed segments)
        if end > cp.position:
            break
        if rec["seq"] <= state.head_seq or rec["seq"] > cp.seq:
            raise CheckpointError(f"the log between the state section (seq {state.head_seq}) and the front "
                                  f"(seq {cp.seq}) holds seq {rec['seq']}")
        state.apply(rec, start, end - start)
        start = end
    if state.head_seq != cp.seq:
        raise CheckpointError(f"the log from the state section's seq {cp.base['seq']} reaches seq "
                              f"{state.head_seq}, the checkpoint is at seq {cp.seq}")


def replay_sync(log: Any, cp: Checkpoint, pager: Any) -> Projection:
    """The log folded up to ``cp``'s record (records verified as they are read)."""
    state = seed_state(log, pager)
    if not hasattr(log, "_records"):  # (PostgreSQL: its records read and verified by a reader of its own)
        # (its own event loop on a thread of its own: the caller's loop is waiting here, and the pager's
        # thread must stay free to serve reads the fold makes)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _replay_copy(log, state, cp.seq)).result()
        if state.head_seq != cp.seq:
            raise CheckpointError(f"the log replayed to seq {state.head_seq}, the checkpoint is at seq {cp.seq}")
        return state
    start = log.manifest.start if getattr(log, "manifest", None) is not None else 0
    for rec, end in log._records(start):  # (global positions, across sealed segments)
        if rec["seq"] > cp.seq or end > cp.position:
            break
        state.apply(rec, start, end - start)
        start = end
    if state.head_seq != cp.seq:
        raise CheckpointError(f"the log replayed to seq {state.head_seq}, the checkpoint is at seq {cp.seq}")
    return state


async def _replay_copy(log: Any, state: Projection, upto: int) -> None:
    """Fold ``log``'s records up to seq ``upto`` into ``state``, read through a readonly copy of ``log``
    opened here."""
    reader = await type(log).open(log.dsn, log.session_id, schema=log.schema, readonly=True, create=False,
                                  timeout=log.timeout)
    try:
        async for batch in reader.read_batches(0, None):
            for rec, size in zip(batch, reader.batch_sizes):
                if rec["seq"] > upto:
                    return
                state.apply(rec, rec["seq"], size)
    finally:
        await reader.close()


__all__ = ["replay_from_base", "replay_sync", "seed_state"]
