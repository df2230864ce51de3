"""Importing other agents' sessions: Claude Code, Codex, pi (one module per format; opencode is not done).

``import_agent_sessions(paths, source=FORMAT, storage_path=...)`` reads each file, maps it to the store's chat
messages (tool calls as ``tool_calls``, each result a ``tool`` message with its ``tool_call_id``), and creates
one NEW session per file, all or nothing, with the provenance in its ``session_started`` record
(``imported``: format, file, digest, the agent's own session id, what was not carried over) and each
message's source line under ``imported.line``. Every file is read and checked before any session is
written: a damaged line anywhere is a MalformedInputError naming the file and line, and nothing is imported.
The session id is ``<format>:<agent's session id>`` unless given; importing the same file again finds
the session it made (same digest) and writes nothing. docs/importing.md has the mapping table.

May import what ``store`` may; the CLI (``context-persistent import --from``) calls it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import MalformedInputError, SessionExistsError, SessionNotFoundError
from ...storage.backends import open_log
from ...storage.paths import LOG_NAME, validate_session_id
from ...transfer import snapshot_codec as sc
from ...transfer.atomic_files import read_file
from ...transfer.new_session import _first_checkpoint, create_session, session_lines
from ..manager import PersistentContextManager
from . import claude_code, codex, pi
from .common import Parsed, pairing

#: The formats, each a function ``(bytes, file name) -> Parsed``.
FORMATS: dict[str, Callable[[bytes, str], Parsed]] = {
    claude_code.FORMAT: claude_code.parse, codex.FORMAT: codex.parse, pi.FORMAT: pi.parse}


def _decompressed(data: bytes, name: str) -> bytes:
    if not name.endswith(".zst"):
        return data
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    except zstandard.ZstdError as e:
        raise MalformedInputError(name, None, f"is not a complete zstd stream ({e})") from None


def default_session_id(parsed: Parsed, path: Path) -> str:
    """``<format>:<the agent's session id>`` (else the file's name), with characters a session id cannot have
    replaced by ``_``."""
    own = parsed.agent_session_id or path.name.split(".")[0]
    sid = re.sub(r"[^A-Za-z0-9_.:@+=-]", "_", f"{parsed.format}:{own}")[:128]
    return validate_session_id(sid)


async def _imported_from(storage_path: Path, session_id: str, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The ``imported`` provenance of an existing session (``{}`` if it was not imported); None if there is none."""
    if cfg.get("backend", "file") == "file" and not (storage_path / session_id / LOG_NAME).exists():
        return None
    try:
        log = await open_log(storage_path, session_id, cfg, readonly=True)
    except SessionNotFoundError:
        return None
    try:
        async for batch in log.read_batches(batch=1):
            data = batch[0].get("data") if batch else None
            found = data.get("imported") if isinstance(data, dict) else None
            return found if isinstance(found, dict) else {}
    finally:
        await log.close()
    return None


async def import_agent_sessions(paths: Sequence[str | os.PathLike[str]], *, source: str,
                                storage_path: str | os.PathLike[str], session_id: str | None = None,
                                **config: Any) -> list[dict[str, Any]]:
    """Import each file of ``paths`` (a ``source`` agent's session) as a new session; a summary per file.

    ``session_id`` names the session (one path only). ``config`` selects the backend (``backend``/``dsn``).
    Raises ValueError for an unknown ``source``, MalformedInputError for a damaged file (nothing imported),
    SessionExistsError when the session id is taken by something not imported from the same bytes.
    """
    sc.check_choice("source", source, tuple(FORMATS))
    if not paths:
        raise ValueError("give at least one file to import")
    if session_id is not None and len(paths) > 1:
        raise ValueError(f"a session id names one session: give one file with it, not {len(paths)}")
    cfg = PersistentContextManager.check_config(config) if config else {}
    storage = Path(storage_path).expanduser()
    plans = []
    for raw in paths:  # (every file is read and checked before anything is written)
        path = Path(raw)
        data = await read_file(path)
        parsed = FORMATS[source](_decompressed(data, path.name), str(path))
        sid = validate_session_id(session_id) if session_id is not None else default_session_id(parsed, path)
        plans.append((path, data, parsed, sid))
    results = []
    for path, data, parsed, sid in plans:
        digest = sc.sha256(data)
        before = await _imported_from(storage, sid, cfg)
        summary = {"session_id": sid, "source": source, "from": str(path), "messages": len(parsed.messages),
                   "agent_session_id": parsed.agent_session_id, "ignored": parsed.ignored,
                   **pairing(parsed.messages)}
        if before is not None:
            if before.get("format") == source and before.get("digest") == digest:
                results.append({**summary, "already_imported": True})
                continue
            raise SessionExistsError(
                f"session {sid!r} already exists and was not imported from these bytes of {path} (the agent's "
                "session may have grown since): nothing was imported; give another id with --session-id")
        provenance = {"source": source, "format": source, "path": str(path.resolve()), "digest": digest,
                      "bytes": len(data), "agent_session_id": parsed.agent_session_id,
                      "messages": len(parsed.messages), "ignored": parsed.ignored, **pairing(parsed.messages),
                      **({"agent": parsed.meta} if parsed.meta else {})}
        lines = session_lines(sid, {"imported": provenance}, parsed.messages, (), parsed.stamps)
        where = await create_session(storage, sid, lines, cfg)
        await _first_checkpoint(PersistentContextManager, storage, sid, lines, cfg)
        results.append({**summary, "already_imported": False, "path": str(where), "head_seq": len(lines)})
    return results


__all__ = ["FORMATS", "default_session_id", "import_agent_sessions"]
