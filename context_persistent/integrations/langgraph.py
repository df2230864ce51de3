"""A LangGraph checkpoint saver on the event log: :class:`PersistentCheckpointSaver`.

LangGraph (``pip install 'context-persistent[langgraph]'``) persists a graph through a checkpointer, a
``BaseCheckpointSaver``: after every super-step it stores a checkpoint (the channels' values and versions)
and, as tasks finish, their pending writes. This saver keeps each LangGraph thread in a session of the store,
``<storage_path>/<session id>/events.jsonl``:

- every ``put`` is one ``graph_checkpoint`` event: the checkpoint (without its values), its metadata, its
  parent, and the values of the channels whose version changed (as the Postgres saver stores blobs: a channel
  that did not change is not stored again);
- every ``put_writes`` is one ``graph_writes`` event (the writes already stored for a task are not repeated);
- the graph's messages (the ``messages`` channel of a ``MessagesState`` graph, any channel named by
  ``messages_channel``) are also appended to the session's history as chat messages, so that
  ``context-persistent show THREAD``, ``stats`` and ``export`` show the conversation;
- ``delete_thread`` removes the thread's session folder; ``copy_thread`` copies its events into a new thread.

Values are serialised by the saver's ``serde`` (LangGraph's ``JsonPlusSerializer`` by default) and kept as
base64 in the JSON records. Each call returns once its event is durable (the store's ``fsync`` policy). A
thread's checkpoints are read once, when the thread is first used, and kept in memory from then on, like
``InMemorySaver``'s. One process at a time may write a thread (a second gets ``SessionLockedError``).
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    from langchain_core.messages import BaseMessage, convert_to_openai_messages
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import (WRITES_IDX_MAP, BaseCheckpointSaver, ChannelVersions, Checkpoint,
                                           CheckpointMetadata, CheckpointTuple, get_checkpoint_id,
                                           get_checkpoint_metadata, writes_sort_key)
    from langgraph.checkpoint.serde.base import SerializerProtocol
except ImportError as e:  # pragma: no cover - exercised by a test in a process without LangGraph
    raise ImportError("context_persistent.integrations.langgraph needs LangGraph: "
                      "pip install 'context-persistent[langgraph]'") from e

from ..errors import InvalidRecordError
from ..model import events as ev
from ..storage.lockfile import FileLock
from ..storage.paths import LOCK_NAME, MAX_SESSION_ID, fsync_dir, validate_session_id
from ..store.host_events import read_host_events, record_host_event
from ..store.manager import PersistentContextManager
from ._loop import LoopThread

__all__ = ["PersistentCheckpointSaver", "session_id_for", "thread_id_of"]

#: Session ids of threads whose id is not a valid session id: this prefix, then the id's UTF-8 in base32.
PREFIX = "lg="

Typed = tuple[str, bytes]
_MISSING = object()


def session_id_for(thread_id: Any) -> str:
    """The store session that holds a LangGraph thread: the thread id itself when it is a valid session id
    (letters, digits and ``_ . : @ + = -``, at most 128 characters), else ``lg=`` and its base32."""
    tid = str(thread_id)
    if not tid.startswith(PREFIX):
        try:
            return validate_session_id(tid)
        except ValueError:
            pass
    sid = PREFIX + base64.b32encode(tid.encode("utf-8")).decode("ascii").rstrip("=")
    if len(sid) > MAX_SESSION_ID:
        raise ValueError(f"thread_id {tid[:40]!r}... is too long: its session id would have {len(sid)} "
                         f"characters; at most {MAX_SESSION_ID} are allowed (a thread id of up to 76 bytes)")
    return sid


def thread_id_of(session_id: str) -> str:
    """The thread id a session holds (the inverse of :func:`session_id_for`)."""
    if not session_id.startswith(PREFIX):
        return session_id
    body = session_id[len(PREFIX):]
    return base64.b32decode(body + "=" * (-len(body) % 8)).decode("utf-8")


def _enc(typed: Typed) -> list[str]:
    return [typed[0], base64.b64encode(typed[1]).decode("ascii")]


def _dec(value: Any) -> Typed:
    return (value[0], base64.b64decode(value[1], validate=True))


def _is_list(blob: Any) -> bool:
    """Whether a stored blob is a list value (a tuple of serialised items), not one serialised value."""
    return isinstance(blob, tuple) and (not blob or isinstance(blob[0], tuple))


class _Thread:
    """What the saver knows of one thread: its open store and its checkpoints and writes (serialised)."""

    def __init__(self, thread_id: str, store: PersistentContextManager) -> None:
        self.thread_id = thread_id
        self.store = store
        #: ns -> checkpoint id -> (checkpoint without values, metadata, parent id)
        self.checkpoints: dict[str, dict[str, tuple[Typed, Typed, str | None]]] = {}
        #: (ns, channel, version) -> value; a list value as the tuple of its items, each serialised
        self.blobs: dict[tuple[str, str, Any], Typed | tuple[Typed, ...]] = {}
        #: (ns, channel) -> the channel's last stored list value, and its version
        self.lists: dict[tuple[str, str], tuple[Typed, ...]] = {}
        self.list_versions: dict[tuple[str, str], Any] = {}
        #: (ns, checkpoint id) -> (task id, idx) -> (task id, channel, value, task path)
        self.writes: dict[tuple[str, str], dict[tuple[str, int], tuple[str, str, Typed, str]]] = {}
        #: The ids of the graph messages mirrored into the history, in order.
        self.mirrored: list[str] = []

    def apply(self, kind: str, data: dict[str, Any]) -> None:
        """Fold one event into the thread (the same for an event just written and one read on open)."""
        ns = data["ns"]
        if kind == ev.GRAPH_CHECKPOINT:
            for blob in data["blobs"]:
                if blob[0] == "v":
                    _, channel, version, typ, b64 = blob
                    self.blobs[(ns, channel, version)] = _dec([typ, b64])
                    continue
                _, channel, version, base, keep, tail = blob  # "l": a list, as its base's first `keep` + tail
                head = self.blobs[(ns, channel, base)] if base is not None else ()
                if not _is_list(head) or len(head) < keep:
                    raise ValueError(f"list blob {channel!r} {version!r}: its base {base!r} is not a list of "
                                     f"at least {keep} items")
                items: tuple[Typed, ...] = head[:keep] + tuple(_dec(e) for e in tail)  # type: ignore[operator,assignment]
                self.blobs[(ns, channel, version)] = items
                self.lists[(ns, channel)] = items
                self.list_versions[(ns, channel)] = version
            self.checkpoints.setdefault(ns, {})[data["id"]] = (
                _dec(data["checkpoint"]), _dec(data["metadata"]), data["parent"])
        else:
            stored = self.writes.setdefault((ns, data["checkpoint_id"]), {})
            for idx, channel, typ, b64 in data["writes"]:
                stored[(data["task_id"], idx)] = (data["task_id"], channel, _dec([typ, b64]), data["task_path"])

    def list_blob(self, ns: str, channel: str, version: Any, items: tuple[Typed, ...]) -> list[Any]:
        """The stored form of a list value: the items after the channel's last stored list, when it is a prefix
        of this one (a growing message list is stored by what it gained, not whole again)."""
        last = self.lists.get((ns, channel))
        base_version = self.list_versions.get((ns, channel))
        if last is not None and len(items) >= len(last) and items[:len(last)] == last:
            keep = len(last)
        else:
            base_version, keep = None, 0
        return ["l", channel, version, base_version, keep, [_enc(e) for e in items[keep:]]]


class PersistentCheckpointSaver(BaseCheckpointSaver[int]):
    """A LangGraph checkpointer whose threads are sessions in ``storage_path`` (sync and async methods).

    ``PersistentCheckpointSaver(storage_path, *, serde=None, messages_channel="messages", **config)``:
    ``config`` takes the store's configuration keys (docs/configuration.md), for example ``fsync="batch"``;
    ``messages_channel=None`` mirrors no messages. Close it with ``close()`` (or ``with`` / ``async with``),
    which releases every thread it opened.
    """

    def __init__(self, storage_path: str | os.PathLike[str], *, serde: SerializerProtocol | None = None,
                 messages_channel: str | None = "messages", **config: Any) -> None:
        super().__init__(serde=serde)
        if config.get("backend", "file") != "file":
            raise ValueError("the LangGraph saver keeps threads in files: backend must be 'file' "
                             f"(got {config['backend']!r})")
        if config.get("recognise_replay", False) is not False:
            raise ValueError("recognise_replay is not available for the LangGraph saver: the mirrored messages "
                             "are always stored as the graph made them")
        config["recognise_replay"] = False
        PersistentContextManager.check_config(dict(config))
        if messages_channel is not None and not isinstance(messages_channel, str):
            raise ValueError(f"messages_channel must be a channel name or None, got {messages_channel!r}")
        self.storage_path = Path(storage_path).expanduser()
        self.messages_channel = messages_channel
        self._config = config
        self._threads: dict[str, _Thread] = {}
        self._loop = LoopThread(f"context-persistent LangGraph saver {self.storage_path}")

    # -- threads ----------------------------------------------------------------------------------------
    def _exists(self, thread_id: str) -> bool:
        return (self.storage_path / session_id_for(thread_id)).is_dir()

    async def _thread(self, thread_id: Any, create: bool = True) -> _Thread | None:
        tid = str(thread_id)
        t = self._threads.get(tid)
        if t is not None:
            return t
        if not create and not self._exists(tid):
            return None
        store = await PersistentContextManager.open(storage_path=self.storage_path,
                                                    session_id=session_id_for(tid), **self._config)
        try:
            t = _Thread(tid, store)
            async for rec in read_host_events(store):
                try:
                    t.apply(rec["type"], rec["data"])
                except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as e:
                    raise InvalidRecordError(rec["seq"], rec["type"], f"not a LangGraph record: {e!r}") from None
            if self.messages_channel is not None:
                t.mirrored = [str((m.get("langgraph") or {}).get("id"))
                              for m in await store.get_messages() if isinstance(m.get("langgraph"), dict)]
        except BaseException:
            await store.close()
            raise
        self._threads[tid] = t
        return t

    def _thread_ids(self) -> list[str]:
        """Every thread in the storage folder (the sessions in it), oldest folder name first."""
        if not self.storage_path.is_dir():
            return []
        found = {thread_id_of(p.name) for p in self.storage_path.iterdir()
                 if p.is_dir() and not p.name.startswith(".")}
        return sorted(found | set(self._threads))

    # -- reading ----------------------------------------------------------------------------------------
    def _tuple(self, t: _Thread, ns: str, cid: str, config: RunnableConfig | None = None) -> CheckpointTuple:
        checkpoint_b, metadata_b, parent = t.checkpoints[ns][cid]
        checkpoint: Checkpoint = self.serde.loads_typed(checkpoint_b)
        values: dict[str, Any] = {}
        for channel, version in checkpoint["channel_versions"].items():
            blob = t.blobs.get((ns, channel, version))
            if blob is None:
                continue
            if _is_list(blob):  # (a list, item by item)
                values[channel] = [self.serde.loads_typed(item) for item in blob]  # type: ignore[arg-type]
            elif blob[0] != "empty":
                values[channel] = self.serde.loads_typed(blob)  # type: ignore[arg-type]
        stored = t.writes.get((ns, cid), {})
        ordered = sorted(stored.items(), key=lambda kv: writes_sort_key(kv[1][3], *kv[0]))
        base = {"thread_id": t.thread_id, "checkpoint_ns": ns}
        return CheckpointTuple(
            config=config or {"configurable": {**base, "checkpoint_id": cid}},
            checkpoint={**checkpoint, "channel_values": values},
            metadata=self.serde.loads_typed(metadata_b),
            parent_config={"configurable": {**base, "checkpoint_id": parent}} if parent else None,
            pending_writes=[(task, channel, self.serde.loads_typed(v)) for task, channel, v, _ in
                            (w for _, w in ordered)],
        )

    async def _get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        t = await self._thread(config["configurable"]["thread_id"], create=False)
        if t is None:
            return None
        ns = config["configurable"].get("checkpoint_ns", "")
        checkpoints = t.checkpoints.get(ns, {})
        cid = get_checkpoint_id(config)
        if cid:
            return self._tuple(t, ns, cid, config) if cid in checkpoints else None
        if not checkpoints:
            return None
        return self._tuple(t, ns, max(checkpoints))

    async def _list(self, config: RunnableConfig | None, filter: dict[str, Any] | None,
                    before: RunnableConfig | None, limit: int | None) -> list[CheckpointTuple]:
        thread_ids = [str(config["configurable"]["thread_id"])] if config else self._thread_ids()
        want_ns = config["configurable"].get("checkpoint_ns") if config else None
        want_id = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        out: list[CheckpointTuple] = []
        for tid in thread_ids:
            t = await self._thread(tid, create=False)
            if t is None:
                continue
            for ns, checkpoints in t.checkpoints.items():
                if want_ns is not None and ns != want_ns:
                    continue
                for cid in sorted(checkpoints, reverse=True):
                    if (want_id and cid != want_id) or (before_id and cid >= before_id):
                        continue
                    if filter:
                        metadata = self.serde.loads_typed(checkpoints[cid][1])
                        if not all(metadata.get(k) == v for k, v in filter.items()):
                            continue
                    if limit is not None and len(out) >= limit:
                        return out
                    out.append(self._tuple(t, ns, cid))
        return out

    # -- writing ----------------------------------------------------------------------------------------
    async def _put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        conf = config["configurable"]
        t = await self._thread(conf["thread_id"])
        assert t is not None
        ns = conf.get("checkpoint_ns", "")
        c = dict(checkpoint)
        values: dict[str, Any] = c.pop("channel_values")  # type: ignore[assignment]
        blobs = []
        for k, v in new_versions.items():
            value = values.get(k, _MISSING)
            if type(value) is list:
                blobs.append(t.list_blob(ns, k, v, tuple(self.serde.dumps_typed(x) for x in value)))
            else:
                typed = ("empty", b"") if value is _MISSING else self.serde.dumps_typed(value)
                blobs.append(["v", k, v, *_enc(typed)])
        data = {"ns": ns, "id": checkpoint["id"], "parent": conf.get("checkpoint_id"),
                "checkpoint": _enc(self.serde.dumps_typed(c)),
                "metadata": _enc(self.serde.dumps_typed(get_checkpoint_metadata(config, metadata))),
                "blobs": blobs}
        await record_host_event(t.store, ev.GRAPH_CHECKPOINT, data)
        t.apply(ev.GRAPH_CHECKPOINT, data)
        if ns == "" and self.messages_channel in new_versions and self.messages_channel in values:
            await self._mirror(t, values[self.messages_channel])
        return {"configurable": {"thread_id": t.thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    async def _mirror(self, t: _Thread, messages: Any) -> None:
        """Bring the session's history in line with the graph's messages: append the new ones, or, when the
        graph's list is not an extension of what was mirrored (a fork, a removal), replace the history."""
        if not isinstance(messages, list) or not all(isinstance(m, BaseMessage) for m in messages):
            return
        ids = [m.id or f"#{i}" for i, m in enumerate(messages)]
        old = t.mirrored
        appended = len(ids) >= len(old) and ids[:len(old)] == old
        new = messages[len(old):] if appended else messages
        if appended and not new:
            return
        converted = convert_to_openai_messages(new)
        for m, d in zip(new, converted):
            d["langgraph"] = {"id": m.id or ids[messages.index(m)], "type": m.type}
        if appended:
            await t.store.add_messages(converted)
        else:
            await t.store.replace_messages(converted)
        t.mirrored = ids

    async def _put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str) -> None:
        conf = config["configurable"]
        t = await self._thread(conf["thread_id"])
        assert t is not None
        ns = conf.get("checkpoint_ns", "")
        cid = conf["checkpoint_id"]
        stored = t.writes.get((ns, cid), {})
        rows = []
        for i, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, i)
            if idx >= 0 and (task_id, idx) in stored:
                continue  # (a task's regular writes are stored once; its special ones are replaced)
            rows.append([idx, channel, *_enc(self.serde.dumps_typed(value))])
        if not rows:
            return
        data = {"ns": ns, "checkpoint_id": cid, "task_id": task_id, "task_path": task_path, "writes": rows}
        await record_host_event(t.store, ev.GRAPH_WRITES, data)
        t.apply(ev.GRAPH_WRITES, data)

    async def _delete_thread(self, thread_id: str) -> None:
        tid = str(thread_id)
        t = self._threads.pop(tid, None)
        if t is not None:
            await t.store.close()
        sid = session_id_for(tid)
        folder = self.storage_path / sid
        if not folder.is_dir():
            return
        lock = FileLock(folder / LOCK_NAME, sid)  # (no other process has the thread open)
        try:
            doomed = self.storage_path / f".deleting-{sid}-{os.getpid()}"
            os.rename(folder, doomed)  # atomic: the thread is there whole or gone
            fsync_dir(self.storage_path)
        finally:
            lock.release()
        from ..operations.search.indexer import forget_removed

        await forget_removed(self.storage_path, sid)  # (its text leaves the storage's search index too)
        shutil.rmtree(doomed)

    async def _copy_thread(self, source: str, target: str) -> None:
        src = await self._thread(source, create=False)
        if src is None:
            return
        dst = await self._thread(target)
        assert dst is not None
        async for rec in read_host_events(src.store):
            await record_host_event(dst.store, rec["type"], rec["data"])
            dst.apply(rec["type"], rec["data"])
        if self.messages_channel is not None and not dst.mirrored:
            messages = await src.store.get_messages()
            if messages:
                await dst.store.add_messages(messages)
                dst.mirrored = list(src.mirrored)

    async def _close_all(self) -> None:
        threads, self._threads = list(self._threads.values()), {}
        errors = []
        for t in threads:
            try:
                await t.store.close()
            except Exception as e:  # (close every thread; report the first failure)
                errors.append(e)
        if errors:
            raise errors[0]

    # -- the BaseCheckpointSaver interface: async ---------------------------------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (``checkpoint_id``), else the thread's newest in its namespace."""
        return await self._loop.call(lambda: self._get_tuple(config))

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first: of a thread (and namespace) or of every thread, filtered by metadata."""
        for item in await self._loop.call(lambda: self._list(config, filter, before, limit)):
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        """Store a checkpoint (one durable event); returns the config that names it."""
        return await self._loop.call(lambda: self._put(config, checkpoint, metadata, new_versions))

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        """Store a task's pending writes for the checkpoint ``config`` names (one durable event)."""
        await self._loop.call(lambda: self._put_writes(config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete the thread: its session folder is removed (after taking its writer lock)."""
        await self._loop.call(lambda: self._delete_thread(thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of a thread into another (appended to what the target holds)."""
        await self._loop.call(lambda: self._copy_thread(source_thread_id, target_thread_id))

    # -- sync ---------------------------------------------------------------------------------------------
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._loop.call_sync(lambda: self._get_tuple(config))

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        return iter(self._loop.call_sync(lambda: self._list(config, filter, before, limit)))

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        return self._loop.call_sync(lambda: self._put(config, checkpoint, metadata, new_versions))

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        self._loop.call_sync(lambda: self._put_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._loop.call_sync(lambda: self._delete_thread(thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._loop.call_sync(lambda: self._copy_thread(source_thread_id, target_thread_id))

    # -- lifetime -----------------------------------------------------------------------------------------
    async def run(self, thread_id: Any, fn: Any) -> Any:
        """``await fn(store)`` with the thread's store on the saver's thread (its views, ``stats()``, ``export``)."""
        async def job() -> Any:
            t = await self._thread(thread_id)
            assert t is not None
            return await fn(t.store)

        return await self._loop.call(job)

    def close(self) -> None:
        """Flush and release every thread the saver opened, and stop its thread (idempotent)."""
        self._loop.close(self._close_all)

    async def aclose(self) -> None:
        import asyncio

        await asyncio.to_thread(self.close)

    def __enter__(self) -> "PersistentCheckpointSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "PersistentCheckpointSaver":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<PersistentCheckpointSaver storage={str(self.storage_path)!r}>"
