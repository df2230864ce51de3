"""Messages coming in: validation with one serialisation, the store's own copy, secrets, the session start on a
resume, and the recognition of a host replaying the loaded history (replay.py, docs/resume.md).

A message is serialised once, by ``events.validate_message``: the record embeds those bytes, the replay
recogniser compares them, and the projection keeps the copy (never a second encoding).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..model import codec
from ..model import events as ev
from ..model.projection import Projection, make_key
from ..model.replay import MISMATCH, TRANSCRIPT_SKIPS, ReplayRecogniser
from .session import EVENT_SECRET_REDACTED, Session
from .system_prompt import SystemPrompt
from .writer import Writer

logger = logging.getLogger("context_persistent")


class Appends:
    """``add_message`` and ``add_messages`` for one session."""

    def __init__(self, session: Session, writer: Writer, prompt: SystemPrompt) -> None:
        self._s = session
        self._writer = writer
        self._prompt = prompt
        self.replay: ReplayRecogniser | None = None

    def begin_resume(self, state: Projection) -> None:
        """A writable store loaded history: the session start begins (a host may re-add its system prompt),
        and with ``recognise_replay`` a replay of that history is watched for."""
        self._prompt.start_prompts = []
        if self._s.config["recognise_replay"]:
            replay = ReplayRecogniser(state.messages)
            self.replay = replay if replay.active else None

    def end_replay(self) -> None:
        """Any other write, a request for the model or close() ends a replay recognition (nothing is held),
        and the session start (system messages added from then on are conversation messages)."""
        self.replay = None
        self._prompt.start_prompts = None

    async def add_message(self, message: dict[str, Any]) -> None:
        s = self._s
        s.check_writable()
        msg_json = ev.validate_message(message)
        # Our own copy (the caller may change its dict later). Validated, the message holds only JSON types, so
        # copy_json gives what orjson.loads(msg_json) would, faster (docs/performance.md).
        stored = ev.copy_json(message)
        found = None
        scanner = s.scanner
        if scanner is not None:
            hit = scanner.redact(stored, msg_json)
            if hit is not None:
                stored, msg_json, found = hit
        if self._prompt.start_prompts is not None and await self._prompt.offer_at_start(stored, found):
            return
        replay = self.replay
        if replay is not None and replay.complete:
            # The next message after a complete replay confirms it: fold the repetition out, then go on.
            self.replay = None
            await self._commit_replay(replay)
            replay = None
        data, data_json = {"message": stored}, b'{"message":%s}' % msg_json
        if found is not None:  # what kinds were removed, never the secret (docs/operations.md, "Secrets")
            data["secrets"] = found
            data_json = b'{"message":%s,"secrets":%s}' % (msg_json, codec.dumps(found))
        writer = self._writer
        if replay is None:
            if writer.inline:
                seq = await writer.commit(ev.MESSAGE_ADDED, data, data_json)
            else:
                seq = await writer.enqueue(ev.MESSAGE_ADDED, data, data_json)  # (writability is checked above)
        else:
            seq = await writer.commit(ev.MESSAGE_ADDED, data, data_json)
            if self.replay is replay and stored.get("role") not in TRANSCRIPT_SKIPS:
                if replay.offer(stored, make_key(seq), msg_json) == MISMATCH:
                    self.replay = None
        if found is not None:
            await s.emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": found})

    async def add_messages(self, messages: list[dict[str, Any]]) -> None:
        s = self._s
        s.check_writable()
        parts = ev.validate_messages(messages)
        if not parts:
            return
        if self.replay is not None or self._prompt.start_prompts is not None or s.scanner is not None:
            for message in messages:
                await self.add_message(message)
            return
        copy = ev.copy_json
        batch = [(ev.MESSAGE_ADDED, {"message": copy(m)}, b'{"message":%s}' % j) for m, j in zip(messages, parts)]
        writer = self._writer
        if writer.inline and s.config["reserve_tail"]:
            for type_, data, j in batch:
                await writer.commit(type_, data, j)
        elif writer.inline:
            await writer.commit_with_deferred(batch)  # (with the audit records of earlier request views, if any)
        else:  # queued together before the flush task runs: one group commit
            await asyncio.gather(*[writer.enqueue(type_, data, j) for type_, data, j in batch])

    async def _commit_replay(self, replay: ReplayRecogniser) -> None:
        """Write the ``replay_recognised`` event that folds a confirmed replay out of the views."""
        payload = b"[" + b",".join(replay.digests) + b"]"
        await self._writer.commit(ev.REPLAY_RECOGNISED, {"count": len(replay.keys), "keys": list(replay.keys),
                                                         "digest": ev.digest(payload)})
        logger.info("session %s: %d add_message calls replayed the loaded history; folded out of the views",
                    self._s.session_id, len(replay.keys))
