"""History edits on their own (HistoryEdits and Eraser over a Session and a Writer): the resume rule of
set_messages, replace_messages, clear, pin/unpin/redact by index or seq, and erase with its receipt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from context_persistent.model import events as ev
from context_persistent.store.appends import Appends
from context_persistent.store.edits import HistoryEdits
from context_persistent.store.erase import Eraser
from context_persistent.store.system_prompt import SystemPrompt
from parts import records, started

HISTORY = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


class _Store:
    """What erasure.py and snapshot.py read from a store: its session's log, checkpoints and identity."""

    def __init__(self, session: Any) -> None:
        self._log, self._checkpoints = session.log, session.checkpoints
        self.session_id, self.config, self.storage_path = session.session_id, session.config, session.storage_path

    def _log_dir(self) -> Path:
        return self.storage_path / self.session_id  # type: ignore[no-any-return]


async def edits_over(storage: Path, *, loaded: bool = False, **config: Any) -> tuple[Any, HistoryEdits, Eraser,
                                                                                    list[int]]:
    session, writer = await started(storage, tokenizer="chars/4", **config)
    appends = Appends(session, writer, SystemPrompt(session, writer))
    await appends.add_messages([dict(m) for m in HISTORY])
    session.loaded_from_file = loaded
    store: Any = _Store(session)
    forgotten: list[int] = []
    edits = HistoryEdits(session, writer, appends, store)
    return session, edits, Eraser(session, writer, appends, edits, lambda: forgotten.append(1), store), forgotten


async def test_a_fresh_session_accepts_set_messages_and_a_loaded_one_keeps_its_log(storage: Path) -> None:
    """Not loaded: the history is replaced. Loaded: a filtered transcript is ignored (audited), an explicit
    reason replaces it, and resume_rule strict ignores even that."""
    session, edits, _, _ = await edits_over(storage)
    await edits.set_messages([HISTORY[0]], None)
    assert session.state.messages == [HISTORY[0]]
    session, edits, _, _ = await edits_over(storage / "b", loaded=True)
    await edits.set_messages([HISTORY[0]], None)
    # (the audit record goes out with the next write: nothing is written by the ignored call itself)
    assert session.state.messages == HISTORY and records(storage / "b")[-1]["type"] == ev.MESSAGE_ADDED
    await edits.set_messages([HISTORY[1]], "undo")
    assert session.state.messages == [HISTORY[1]] and records(storage / "b")[-1]["data"]["reason"] == "undo"
    assert records(storage / "b")[-2]["type"] == ev.TRANSCRIPT_IGNORED
    session, edits, _, _ = await edits_over(storage / "c", loaded=True, resume_rule="strict")
    await edits.set_messages([HISTORY[1]], "undo")
    assert session.state.messages == HISTORY
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        await edits.set_messages([], " ")


async def test_clear_and_replace_messages_are_events_and_clear_allows_a_later_set(storage: Path) -> None:
    """clear empties the history and marks it cleared here; replace_messages ignores the resume rule."""
    session, edits, _, _ = await edits_over(storage, loaded=True)
    await edits.replace_messages([HISTORY[1]])
    assert session.state.messages == [HISTORY[1]]
    await edits.clear()
    assert session.state.messages == [] and session.cleared_here
    await edits.set_messages(HISTORY, None)
    assert session.state.messages == HISTORY
    assert records(storage)[-1]["data"]["reason"] == "after clear() in this process"


async def test_marks_name_a_message_by_index_or_seq(storage: Path) -> None:
    """pin by index, unpin by seq, redact hides it; naming both, neither or no message is a ValueError."""
    session, edits, _, _ = await edits_over(storage)
    await edits.mark(ev.PINNED, -1, None)
    key = session.state.keys[1]
    assert session.state.pinned == {key}
    await edits.mark(ev.UNPINNED, None, records(storage)[2]["seq"])
    assert session.state.pinned == set()
    await edits.mark(ev.REDACTED, 0, None)
    assert session.state.messages == [HISTORY[1]]
    for index, seq, match in ((None, None, "exactly one"), (0, 2, "exactly one"), (5, None, "out of range"),
                              (None, 1, "not a message_added")):
        with pytest.raises(ValueError, match=match):
            edits.resolve_key(index, seq)


async def test_erase_removes_the_bytes_rebuilds_the_history_and_forgets_what_was_derived(storage: Path) -> None:
    """After erase the log keeps a tombstone instead of the message, the history no longer shows it, the
    derived caches are dropped, and the receipt verifies."""
    session, _, eraser, forgotten = await edits_over(storage)
    receipt = await eraser.erase(0, None, 0, "asked")
    assert session.state.messages == [HISTORY[1]] and forgotten == [1]
    assert b'"content":"q"' not in (storage / "part" / "events.jsonl").read_bytes()
    assert await eraser.verify(receipt) == []
    with pytest.raises(ValueError, match="another session|not 'part'"):
        await eraser.verify({**receipt, "session_id": "other"})
    with pytest.raises(ValueError, match="reason must be a string"):
        await eraser.erase(0, None, 0, None)  # type: ignore[arg-type]
