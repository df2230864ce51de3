"""Building the store's parts on their own (without PersistentContextManager), for the parts' unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from context_persistent.storage.backends import open_log
from context_persistent.model.codec import FORMAT_VERSION, crc_of, decode, root_crc
from context_persistent.store.config import check_config
from context_persistent.store.session import Session
from context_persistent.store.writer import Writer

SESSION = "part"


class Hooks:
    """Records what the parts emit."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, data: dict[str, Any]) -> None:
        self.seen.append((event, data))

    def names(self) -> list[str]:
        return [e for e, _ in self.seen]


async def open_session(storage: Path, *, readonly: bool = False, hooks: Any = None, **config: Any) -> Session:
    """A Session over a newly opened log (nothing replayed: its projection is empty)."""
    cfg = check_config(config)
    log = await open_log(storage, SESSION, cfg, readonly=readonly)
    return Session(storage_path=storage, session_id=SESSION, log=log, config=cfg, hooks=hooks)


async def started(storage: Path, **config: Any) -> tuple[Session, Writer]:
    """A Session and its Writer, with ``session_started`` written (as a fresh store begins)."""
    session = await open_session(storage, **config)
    writer = Writer(session)
    await writer.commit("session_started", {"format": FORMAT_VERSION, "tokenizer": session.counter.requested,
                                            "program": "context-persistent", "session_id": SESSION})
    return session, writer


def records(storage: Path) -> list[dict[str, Any]]:
    """Every record of the part's log, decoded; each crc and each link of the chain is checked."""
    out = []
    prev = root_crc(SESSION)
    for line in (storage / SESSION / "events.jsonl").read_bytes().splitlines(keepends=True):
        record = decode(line)
        assert record["prev"] == prev.decode(), f"record {record['seq']} does not name its predecessor"
        prev = crc_of(line)
        out.append(record)
    return out
