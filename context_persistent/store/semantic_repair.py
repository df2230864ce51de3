"""``repair --semantic``: the fixes ``operations/semantic.py`` finds, recorded as events through an open store
(it opens the session as its writer, so it sits with the store)."""

from __future__ import annotations

import os
from pathlib import Path

from ..model import events as ev
from ..operations.semantic import SemanticRepair, _answered_ids, _result_keys, check, placeholders
from .manager import PersistentContextManager


async def repair_semantic(storage_path: str | os.PathLike[str], session_id: str) -> SemanticRepair:
    """Record fixes for the problems :func:`check` finds, as events (see the module docstring).

    Opens the session as its writer (SessionLockedError while another store has it open). A message that holds
    orphan results next to other content (text) is left as it is (listed in ``left``): redacting it would hide
    the text too, and request views leave the orphan blocks out anyway.
    """
    result = SemanticRepair(session_id)
    async with await PersistentContextManager.open(storage_path=Path(storage_path), session_id=session_id,
                                                   recognise_replay=False) as store:
        messages = await store.get_messages()
        keys = list(store._full().keys)
        found = [f for f in check(messages, keys) if f.problem]
        if not found:
            return result
        unanswered = [f for f in found if f.kind == "unanswered_call"]
        orphans = [f for f in found if f.kind == "orphan_result"]
        # Orphans first, from the end (a redaction shifts the indices after it; placeholders go at the end).
        orphan_indices = sorted({f.index for f in orphans}, reverse=True)
        for index in orphan_indices:
            m = messages[index]
            results, other = _result_keys(m)
            mine = [f for f in orphans if f.index == index]
            if other or len(mine) < len(results):
                result.left.extend(mine)  # it holds something else too: not hidden
                continue
            await store.redact(message_index=index)
            result.redacted.append({"seq": mine[0].seq, "index": index, "call_ids": [f.call_id for f in mine]})
        for msg in placeholders(messages, unanswered):
            await store.add_message(msg)
            result.placeholders.append({"seq": store.head_seq, "message": msg})
        await store._commit(ev.SEMANTIC_REPAIRED, {
            "program": "context-persistent repair --semantic",
            "placeholders": [{"seq": p["seq"], "call_ids": _answered_ids(p["message"])} for p in result.placeholders],
            "unanswered": [{"seq": f.seq, "call_id": f.call_id, "tool": f.tool} for f in unanswered],
            "redacted": result.redacted,
            "left": [{"seq": f.seq, "call_id": f.call_id, "kind": f.kind} for f in result.left],
        })
        result.audit_seq = store.head_seq
    return result


__all__ = ["repair_semantic"]
