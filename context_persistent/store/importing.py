"""Importing a file as a new session, and exporting a session by its id: the operations that open a store.

They sit above both ``manager`` (which validates the configuration and opens the store) and ``snapshot``
(the formats, the atomic creation of a new session): the manager imports ``snapshot`` for its own
``export``/``fork``/``open_at``, and ``snapshot`` does not import the manager, so there is no import cycle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..model import events as ev
from ..transfer import snapshot_codec as sc
from .manager import PersistentContextManager
from ..storage.paths import validate_session_id
from ..transfer.atomic_files import Progress, read_file
from ..transfer.new_session import _first_checkpoint, _target, create_session, session_lines
from ..transfer.snapshot import export


async def import_(path: str | os.PathLike[str], *, session_id: str, storage_path: str | os.PathLike[str],
                  source: str = "auto", system_message: str | None = None, progress: Progress | None = None,
                  request_notes: str = "refuse", **config: Any) -> dict[str, Any]:
    """Create the NEW session ``session_id`` in ``storage_path`` from the file ``path``: a snapshot, a CLI
    transcript or a context-messages file.

    ``source`` says what the file is: ``"auto"`` detects it (docs/snapshots.md lists the rules),
    ``"snapshot"``, ``"transcript"`` or ``"reference"`` insist. ``progress`` (``progress(done, total)``) is
    called as the file is read. ``system_message`` prepends a
    system message (an Amplifier CLI transcript has none). Raises SessionExistsError if the session exists,
    MalformedInputError (a ValueError) naming the file and line for bad or truncated input, ValueError for
    a Markdown snapshot (one-way). Nothing is written unless the whole file is valid. Returns a summary.
    ``config`` selects the backend (``backend``/``dsn``), as for ``PersistentContextManager.open``.

    A request-view snapshot holds notes the store wrote in place of left-out messages (header ``notes``);
    ``request_notes`` says what to do with them: ``"refuse"`` (default: ValueError, nothing imported),
    ``"drop"`` (leave them out) or ``"keep"`` (store them as the user messages they look like).
    """
    validate_session_id(session_id)
    sc.check_choice("source", source, sc.SOURCES)
    sc.check_choice("request_notes", request_notes, sc.NOTE_CHOICES)
    if system_message is not None and not isinstance(system_message, str):
        raise ValueError(f"system_message must be a string, got {type(system_message).__name__}")
    cfg = _backend_config(config)
    p = Path(path)
    if cfg.get("backend", "file") == "file":
        _target(storage_path, session_id)  # fail fast, before reading a large file
    data = await read_file(p, progress)
    name = str(p)
    kind = sc.detect(data, name) if source == "auto" else source
    stamps: list[str | None] | None = None
    pins: list[int] = []
    header: dict[str, Any] = {}
    provenance: dict[str, Any] = {"path": str(p.resolve()), "digest": sc.sha256(data), "bytes": len(data)}
    if kind == "markdown":
        raise ValueError(f"{name} is a Markdown snapshot: Markdown is one-way (for people to read) and cannot "
                         "be imported; export the session with format 'jsonl' or 'json' to move it")
    if kind == "snapshot":
        header, messages = sc.parse_snapshot(data, name)
        pins = sc.header_pins(header, len(messages), name) if header.get("view") == "full" else []
        notes = sc.header_notes(header, messages, name)
        if notes and request_notes == "refuse":
            listed = ", ".join(map(str, notes[:10])) + (", …" if len(notes) > 10 else "")
            raise ValueError(
                f"{name} is a request view: {len(notes)} of its messages (at {listed}) are notes context-persistent "
                "wrote in place of left-out messages, not messages of the session; imported, they would become "
                "user messages. Export the full view to move a session, or choose what to do with the notes: "
                "drop them (CLI --request-notes drop) or keep them as user messages (--request-notes keep)")
        if notes and request_notes == "drop":
            gone = set(notes)
            messages = [m for i, m in enumerate(messages) if i not in gone]
        provenance["snapshot"] = {k: header.get(k) for k in ("session_id", "view", "seq_range", "created_at",
                                                             "format", "body_sha256")}
        if notes:
            provenance["request_notes"] = {"action": request_notes, "count": len(notes)}
    else:
        messages, stamps = sc.parse_message_lines(data, name)
        if kind == "messages":
            kind = sc.messages_kind(name, messages)
    if system_message is not None:
        messages = [{"role": "system", "content": system_message}, *messages]
        stamps = [None, *stamps] if stamps is not None else None
        pins = [i + 1 for i in pins]
    provenance = {"source": kind, **provenance, "messages": len(messages)}
    if cfg.get("secret_scanner") is not None:  # (docs/operations.md, "Secrets")
        from ..model.secret_scan import redact_messages

        messages, _, secrets = redact_messages(cfg["secret_scanner"], messages,
                                               [ev.validate_message(m, f"message {i + 1}")
                                                for i, m in enumerate(messages)])
        if secrets:
            provenance["secrets"] = secrets
    started = {"imported": provenance}
    if kind == "snapshot" and isinstance(header.get("tokenizer"), str):
        started["tokenizer"] = header["tokenizer"]
    lines = session_lines(session_id, started, messages, pins, stamps)
    log_path = await create_session(storage_path, session_id, lines, cfg)
    await _first_checkpoint(PersistentContextManager, storage_path, session_id, lines, cfg)
    return {"session_id": session_id, "source": kind, "messages": len(messages), "pinned": len(pins),
            "head_seq": len(lines), "path": str(log_path), "from": str(p)}


def _backend_config(config: dict[str, Any]) -> dict[str, Any]:
    if not config:
        return {}
    return PersistentContextManager.check_config(config)


async def export_session(storage_path: str | os.PathLike[str], session_id: str, path: str | os.PathLike[str],
                         **kwargs: Any) -> dict[str, Any]:
    """``export`` of a session opened read-only (no lock: works while an agent is writing it)."""
    backend = {k: kwargs.pop(k) for k in ("backend", "dsn", "pg_schema") if k in kwargs}
    async with await PersistentContextManager.open(storage_path=storage_path, session_id=session_id,
                                                   readonly=True, **backend) as store:
        return await export(store, path, **kwargs)


__all__ = ["export_session", "import_"]
