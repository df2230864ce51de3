"""Export: snapshot files of a session's views (I/O; formats in snapshot_codec).

``export(store, path, ...)`` writes one view of a session, at its head or as it was right after any ``at_seq``
(time travel, time_travel.py), to a file written atomically (atomic_files.py), streamed in two passes for the
views of the whole history. ``rewrite_audit_exports`` rewrites the store's own audit snapshots after a
redaction. New sessions (import, fork) are built in new_session.py.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ..model import json_lossless
from ..model import codec
from . import snapshot_codec as sc
from .atomic_files import Progress, _listed, write_atomic
from .new_session import PROGRAM, create_session, fork
from .time_travel import fingerprint, open_at, replay
from ..model.views import REASONING_ROLES, text_only

logger = logging.getLogger("context_persistent.transfer.snapshot")

if TYPE_CHECKING:
    from ..store.manager import PersistentContextManager


_AUDIT_EXPORT_RE = re.compile(r"compaction-([0-9]{10})\.jsonl")


async def rewrite_audit_exports(store: PersistentContextManager, since_seq: int) -> list[Path]:
    """Rewrite the store's own audit snapshots (``<session>/compaction-<seq>.jsonl``, written by
    ``export_on_compact``) made at ``since_seq`` or later, as of their seq: after a redaction, so that no
    export the store wrote keeps the redacted message. Returns the files rewritten; a failure is logged."""
    folder = store._log_dir()
    done: list[Path] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return done
    for name in names:
        m = _AUDIT_EXPORT_RE.fullmatch(name)
        if m is None or not since_seq <= int(m[1]) <= store.head_seq:
            continue
        path = folder / name
        try:
            await export(store, path, format="jsonl", view="reasoning", at_seq=int(m[1]))
            done.append(path)
        except Exception as e:  # (the redaction is durable; this is a copy)
            logger.warning("session %s: could not rewrite %s after a redaction (%s); it may still hold the "
                           "redacted message: delete it", store.session_id, path, e)
    return done


async def view_messages(store: PersistentContextManager, view: str, token_budget: int | None = None
                        ) -> list[dict[str, Any]]:
    """The messages of ``view`` (``full``, ``conversation``, ``reasoning`` or ``request``), as a copy."""
    sc.check_choice("view", view, sc.VIEWS)
    if view == "request":
        return await store.get_messages_for_request(token_budget=token_budget)
    if token_budget is not None:
        raise ValueError("token_budget applies only to view='request'")
    if view == "conversation":
        return await store.get_conversation_view()
    if view == "reasoning":
        return await store.get_reasoning_view()
    return await store.get_messages()


# -- export -----------------------------------------------------------------------------------------
async def export(store: PersistentContextManager, path: str | os.PathLike[str], *, format: str | None = None,
                 view: str = "full", at_seq: int | None = None, token_budget: int | None = None,
                 progress: Progress | None = None) -> dict[str, Any]:
    """Write a snapshot of ``view`` at the head (or right after ``at_seq``) to ``path``; returns its header.

    ``format`` None takes it from the file name (``.md``/``.markdown`` markdown, ``.json`` json, else jsonl).
    The file is replaced atomically: readers see the old file or the complete new one, never a part.
    """
    if format is None:
        format = sc.format_for_path(path)
    sc.check_choice("format", format, sc.FORMATS)
    sc.check_choice("view", view, sc.VIEWS)
    store._check_open()
    if at_seq is not None:
        past = await open_at(store, at_seq)
        try:
            return await export(past, path, format=format, view=view, token_budget=token_budget,
                                progress=progress)
        finally:
            await past.close()
    state = store._full() if view != "request" else store._state  # (the request view reads only what it holds)
    source: Any
    if view != "request":  # a view of the whole history, streamed: never held in memory twice
        if token_budget is not None:
            raise ValueError("token_budget applies only to view='request'")
        count = len(state.messages) if view == "full" else 0  # (the first pass counts)
        source = functools.partial(view_stream, store, view)
    else:
        listed = await view_messages(store, view, token_budget)
        count = len(listed)
        source = functools.partial(_listed, listed)
    pinned = ([i for i, k in enumerate(state.keys) if k in state.pinned] if view == "full" else [])
    header: dict[str, Any] = {
        sc.MARKER: sc.SNAPSHOT_VERSION,
        "format": format,
        "view": view,
        "session_id": store.session_id,
        "seq_range": [1 if state.head_seq else 0, state.head_seq],
        "created_at": codec.now_iso(),
        "messages": count,
        "pinned": pinned,
        "tokenizer": state.session.get("tokenizer") or store.config.get("tokenizer"),
        "program": PROGRAM,
    }
    if "parent" in state.session:
        header["parent"] = state.session["parent"]
    if token_budget is not None:
        header["token_budget"] = token_budget
    if view == "request":  # the notes put in place of left-out messages: not messages of the session
        sources = await request_sources(store, listed)
        header["notes"] = [i for i in sc.note_indices(listed) if sources[i] is None]
    try:
        if format == "markdown":  # (for people: rendered whole)
            messages = [m async for m in source()]
            header["messages"] = len(messages)  # (a view other than full is counted as it is read)
            await write_atomic(Path(path), list(sc.encode_snapshot(header, messages, format)), progress)
        else:
            await _write_streamed(Path(path), header, format, source, progress)
    except orjson.JSONEncodeError as e:  # (only a message stored before the depth limit existed gets here)
        raise ValueError(f"cannot export session {store.session_id!r} as {format}: {e}: a message is nested "
                         f"deeper than the store accepts today ({codec.MAX_DEPTH} levels, docs/format.md); "
                         "format 'jsonl' writes each message on its own and can carry it") from None
    return header


async def history_messages(store: PersistentContextManager) -> AsyncIterator[dict[str, Any]]:
    """The full history, a message at a time, oldest first: ``iter_messages()`` where the store has it, else
    the messages it holds (for reading only: they are not copies)."""
    iterate = getattr(store, "iter_messages", None)
    if iterate is not None:
        async for m in iterate():
            yield m
        return
    for i, m in enumerate(list(store._full().messages)):
        if i and i % 1024 == 0:
            await asyncio.sleep(0)
        yield m


async def request_sources(store: PersistentContextManager, messages: list[dict[str, Any]]) -> list[int | None]:
    """The history index of each message of ``messages``, the store's request view just made, that is one of
    the history's unchanged (in order; None for a note, a masked or truncated message).

    Only the history messages the view can hold are read: after a windowed rebuild (compaction/window.py) the
    window's (the kept older ones and every one from its start), else the whole history a message at a time.
    Each view message is matched with the first equal one after the previous match."""
    state = store._state
    window = store._views.window
    candidates: AsyncIterator[tuple[int, dict[str, Any]]]
    if window is not None:
        indices = [i for i in window.indices if i < window.start] + list(range(window.start, len(state.messages)))
        candidates = _listed([(i, state.messages[i]) for i in indices])
    else:
        candidates = _numbered(history_messages(store))
    wanted = {fingerprint(m) for m in messages}
    where: dict[bytes, list[int]] = {}
    async for i, m in candidates:
        fp = fingerprint(m)
        if fp in wanted:
            where.setdefault(fp, []).append(i)
    out: list[int | None] = []
    last = -1
    for m in messages:
        found = next((i for i in where.get(fingerprint(m), ()) if i > last), None)
        if found is not None:
            last = found
        out.append(found)
    return out


async def _numbered(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


async def view_stream(store: PersistentContextManager, view: str) -> AsyncIterator[dict[str, Any]]:
    """The messages of ``view`` (``full``, ``conversation`` or ``reasoning``; views.py) one at a time, from
    :func:`history_messages`: the same messages as the store's ``get_*`` methods return, never held together."""
    sc.check_choice("view", view, ("full", "conversation", "reasoning"))
    async for m in history_messages(store):
        if view == "full":
            yield m
        elif view == "reasoning":
            if m.get("role") in REASONING_ROLES:
                yield m
        elif m.get("role") in ("user", "assistant"):
            kept = text_only(m)
            if kept is not None:
                yield kept


class _Changed(Exception):
    """The history changed between the two passes of a streamed export (a writer replaced it)."""


async def _write_streamed(path: Path, header: dict[str, Any], fmt: str,
                          source: Callable[[], AsyncIterator[dict[str, Any]]], progress: Progress | None) -> None:
    """A JSONL or JSON snapshot written as it goes, in two passes over ``source``: the first computes the body's
    checksum and message count (the header, which comes first, holds them), the second writes the file and
    checks it wrote the same body (else, the history changed meanwhile: it starts again, at most 3 times).
    Memory holds a message and a 1 MiB buffer, whatever the view's length."""
    for _attempt in range(3):
        h = hashlib.sha256()
        body = count = 0
        async for m in source():
            line = json_lossless.dumps(m) + b"\n"
            h.update(line)
            body += len(line)
            count += 1
        digest = "sha256:" + h.hexdigest()
        header.update(messages=count, body_sha256=digest)

        async def chunks() -> AsyncIterator[bytes]:
            again = hashlib.sha256()
            writer = sc.JsonWriter({"header": header}, "messages") if fmt == "json" else None
            if writer is None:
                yield json_lossless.dumps(header) + b"\n"
            async for m in source():
                line = json_lossless.dumps(m) + b"\n"
                again.update(line)
                yield line if writer is None else writer.item(m)
            if "sha256:" + again.hexdigest() != digest:
                raise _Changed
            if writer is not None:
                yield writer.end()

        try:
            await write_atomic(path, chunks(), progress, total=len(json_lossless.dumps(header)) + 1 + body)
            return
        except _Changed:
            continue
    raise RuntimeError(f"the history changed during each of 3 attempts to export it to {path}; export again")


# create_session, fork, open_at, replay and write_atomic live in new_session, time_travel and atomic_files; they
# stay importable from here, where callers have always found them.
__all__ = ["create_session", "export", "fork", "history_messages", "open_at", "replay", "request_sources",
           "rewrite_audit_exports", "view_messages", "view_stream", "write_atomic"]
