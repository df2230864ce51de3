"""Edits of the history: replacing it (under the resume rule, docs/resume.md), clearing it, and marking
messages (pin, unpin, redact). Each is one event; the log keeps every earlier record."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

from ..errors import ConcurrencyError
from ..model import json_lossless
from ..model import codec
from ..model import events as ev
from .appends import Appends
from ..storage.log import FileEventLog
from ..model.projection import MAX_BATCH, make_key, split_key
from .session import EVENT_SECRET_REDACTED, EVENT_TRANSCRIPT_IGNORED, Session
from .writer import Writer

if TYPE_CHECKING:
    from .manager import PersistentContextManager

logger = logging.getLogger("context_persistent")


def _array(parts: list[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


#: A payload of at least this many bytes is digested on a thread (:class:`_Digest`); a smaller one at once.
THREAD_DIGEST_BYTES = 1 << 20


class _Digest:
    """``ev.digest(payload)``, made on a thread of its own for a large payload: hashlib lets other threads run
    while it hashes, so what the caller does meanwhile (the resume rule's comparison of the transcript, about as
    long at 100k messages) costs no extra time where a second core is free. :meth:`value` waits for it."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._value: str | None = None
        self._thread: threading.Thread | None = None
        if len(payload) >= THREAD_DIGEST_BYTES:
            thread = threading.Thread(target=self._run, name="context-persistent-digest", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # (no thread to be had: made in value())
                return
            self._thread = thread

    def _run(self) -> None:
        self._value = ev.digest(self._payload)

    def value(self) -> str:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._value is None:  # (small, no thread, or the thread failed: made here)
            self._value = ev.digest(self._payload)
        return self._value


class HistoryEdits:
    """set_messages, replace_messages, clear, pin, unpin and redact for one session.

    ``store`` is the store these edits belong to, for the functions that take one (snapshot.py).
    """

    def __init__(self, session: Session, writer: Writer, appends: Appends, store: PersistentContextManager) -> None:
        self._s = session
        self._writer = writer
        self._appends = appends
        self._store = store
        #: Held by ``pop`` from its read to its redaction: concurrent pops each take a different message.
        self._popping = asyncio.Lock()

    async def set_messages(self, messages: list[dict[str, Any]], reason: str | None) -> None:
        s = self._s
        s.check_writable()
        if (reason is None and s.scanner is None and s.loaded_from_file and not s.cleared_here
                and s.config["resume_rule"] != "strict" and await self._stored_transcript(messages)):
            return
        if s.scanner is None:  # (the array in one encode: the resume rule only needs its bytes and digest)
            payload, secrets = ev.encode_messages(messages), None
            count = len(messages)
        else:
            parts = ev.validate_messages(messages)
            count = len(parts)
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise ValueError(f"reason must be a non-empty string saying why the history is replaced, got {reason!r}")
        self._appends.end_replay()
        if count >= MAX_BATCH:
            raise ValueError(f"set_messages takes at most {MAX_BATCH - 1} messages, got {count}")
        if s.scanner is not None:
            parts, secrets = self._redact_all(messages, parts)
            payload = _array(parts)
        if s.loaded_from_file and s.config["resume_rule"] == "strict":
            await self._ignore(count, payload, "strict", "resume_rule is strict: the store loaded its own log, "
                               "which is authoritative")
            return
        if not s.loaded_from_file or s.cleared_here:
            why = reason or ("after clear() in this process" if s.cleared_here else None)
            await self._replace(payload, why, secrets)
            return
        if reason is not None:
            await self._replace(payload, reason, secrets)
            return
        # (without a scanner the payload is the messages as given: classify those, not a parse of it)
        await self._resume_rule(count, payload, secrets, messages if s.scanner is None else None)

    async def _stored_transcript(self, messages: Any) -> bool:
        """The resume rule's usual case, decided before the transcript is checked and encoded message by
        message: the history's own conversation messages (model/resume.is_stored_transcript), a filtered
        transcript, ignored and audited as :meth:`_resume_rule` does. Its messages equal stored ones, so the
        checks they passed when stored hold: one encode for the audit record's digest is all it costs, and the
        digest of a large one is made on a thread while the transcript is compared (:class:`_Digest`). The
        encode is made first and used only once the comparison says it is such a transcript (it skips the
        checks: of anything else it is thrown away). False (nothing done) for anything else, which takes the
        whole path."""
        from ..model.resume import FILTERED, is_stored_transcript

        if type(messages) is not list or not messages or len(messages) >= MAX_BATCH:
            return False
        try:
            payload = codec.dumps_stored(messages)
        except (TypeError, ValueError):  # (orjson's errors: a lone surrogate, a subclass: the whole path says)
            return False
        digest = _Digest(payload)
        if not is_stored_transcript(self._s.full().messages, messages):
            return False
        self._appends.end_replay()
        await self._ignore(len(messages), payload, FILTERED, "a filtered transcript of the history the store "
                           "loaded from its own log, which is authoritative", digest.value())
        return True

    async def _resume_rule(self, count: int, payload: bytes, secrets: list[dict[str, Any]] | None,
                           given: list[dict[str, Any]] | None = None) -> None:
        """A store that loaded its own log: accept a repair, ignore a filtered transcript or anything else."""
        from ..model.resume import FILTERED, REPAIR, classify

        s = self._s
        offered = json_lossless.loads(payload) if given is None else given
        history = s.full()
        kind, merged = classify(history.messages, offered)
        if kind == REPAIR:
            assert merged is not None
            logger.warning("session %s: set_messages repaired the history (%d -> %d messages); accepted",
                           s.session_id, len(s.state.messages), len(merged))
            if secrets:  # the scanner's note, for the messages the repair added (at their places in merged)
                where = {id(m): i for i, m in enumerate(merged)}
                secrets = [{**e, "index": where[id(offered[e["index"]])]} for e in secrets
                           if id(offered[e["index"]]) in where] or None
            await self._replace(_array([codec.dumps(m) for m in merged]), REPAIR, secrets)
        elif kind == FILTERED:
            await self._ignore(count, payload, FILTERED, "a filtered transcript of the history the store "
                               "loaded from its own log, which is authoritative")
        elif not await self._edited(history, offered, count, payload):
            await self._ignore(count, payload, kind, "neither a filtered transcript, a repair of the history "
                               "nor an explicit replacement (pass reason=...); the store's own log is kept")

    async def _edited(self, history: Any, offered: list[dict[str, Any]], count: int, payload: bytes) -> bool:
        """An edited transcript (model/resume.py, ``transcript_edits``): the first time in the session, one
        ``transcript_edited`` record and a warning naming ``context-persistent erase``; after that, ignored
        like any other. False when ``offered`` is no edit."""
        from ..model.resume import EDITED, transcript_edits

        found = transcript_edits(history.messages, offered)
        if found is None:
            return False
        s = self._s
        seqs = {k: sorted({split_key(history.keys[i])[0] for i in found[k]}) for k in ("removed", "changed")}
        reason = ("the host's transcript lacks or changes messages of the history (edited by hand?); the store's "
                  "own log is kept")
        if s.state.counts.get(ev.TRANSCRIPT_EDITED):  # (warned once already: recorded, not repeated)
            await self._ignore(count, payload, EDITED, reason)
            return True
        info = {"count": count, "digest": ev.digest(payload), "bytes": len(payload), "kind": EDITED,
                "reason": reason, "removed_seqs": seqs["removed"], "changed_seqs": seqs["changed"]}
        await self._writer.commit(ev.TRANSCRIPT_EDITED, info)
        logger.warning(edited_warning(s.session_id, seqs["removed"], seqs["changed"]))
        await s.emit(EVENT_TRANSCRIPT_IGNORED, dict(info))
        return True

    async def replace_messages(self, messages: list[dict[str, Any]], if_version: Any = None) -> None:
        s = self._s
        s.check_writable()
        parts = ev.validate_messages(messages)
        if len(parts) >= MAX_BATCH:
            raise ValueError(f"replace_messages takes at most {MAX_BATCH - 1} messages, got {len(parts)}")
        if if_version is not None and not (isinstance(if_version, tuple) and len(if_version) == 2):
            raise ValueError(f"if_version must be a value of history_version, got {if_version!r}")
        self._appends.end_replay()
        parts, secrets = self._redact_all(messages, parts)
        if if_version is None:
            await self._replace(_array(parts), None, secrets)
            return
        # Compare and replace with no append or erase in between: both wait while the log is held (an append
        # queued meanwhile is written after the replacement, so it stays in the history).
        async with s.rewriting, self._writer.exclusive():
            s.check_writable()
            if s.version != tuple(if_version):
                raise ConcurrencyError(f"session {s.session_id!r}: the history changed since it was read (version "
                                       f"{tuple(if_version)}, now {s.version}: an append or an erase); nothing "
                                       "was replaced")
            data, data_json = self._replaced(_array(parts), None, secrets)
            await self._writer.commit_with_deferred([(ev.MESSAGES_REPLACED, data, data_json)])
        if secrets:  # (after the log is released: a hook may write)
            await s.emit(EVENT_SECRET_REDACTED, {"seq": s.state.head_seq, "secrets": secrets})

    async def pop(self) -> dict[str, Any] | None:
        """Redact the newest message and return it (None if the history is empty); one pop at a time, so each
        reads the history its predecessor left."""
        async with self._popping:
            self._s.check_writable()
            newest = ev.copy_json(self._s.state.messages[-1:])
            if not newest:
                return None
            await self.mark(ev.REDACTED, -1, None)
            return newest[0]

    @staticmethod
    def _replaced(payload: bytes, reason: str | None, secrets: list[dict[str, Any]] | None
                  ) -> tuple[dict[str, Any], bytes]:
        """The data of a ``messages_replaced`` event, and its JSON (the messages' as they are)."""
        data: dict[str, Any] = {"messages": json_lossless.loads(payload)}
        extra = b""
        if reason is not None:
            data["reason"] = reason
            extra += b',"reason":%s' % codec.dumps(reason)
        if secrets:  # what kinds the scanner removed, never the secrets (docs/operations.md, "Secrets")
            data["secrets"] = secrets
            extra += b',"secrets":%s' % codec.dumps(secrets)
        return data, b'{"messages":%s%s}' % (payload, extra)

    async def _replace(self, payload: bytes, reason: str | None, secrets: list[dict[str, Any]] | None = None
                       ) -> None:
        """One ``messages_replaced`` event: the history becomes ``payload`` (a JSON array of messages)."""
        data, data_json = self._replaced(payload, reason, secrets)
        seq = await self._writer.commit(ev.MESSAGES_REPLACED, data, data_json)
        if secrets:
            await self._s.emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": secrets})

    async def _ignore(self, count: int, payload: bytes, kind: str, reason: str, digest: str | None = None) -> None:
        """The audit record of a ``set_messages`` ignored (``digest``: ``ev.digest(payload)`` if made already)."""
        info = {"count": count, "digest": digest or ev.digest(payload), "bytes": len(payload), "kind": kind,
                "reason": reason}
        logger.info("session %s: set_messages with %d messages ignored (%s)", self._s.session_id, count, reason)
        # An audit record that changes no view: it rides with the next append (or the close) like a request
        # view's, instead of costing a resumed CLI turn a sync of its own (#23).
        self._s.check_writable()
        self._writer.defer(ev.TRANSCRIPT_IGNORED, info)
        await self._s.emit(EVENT_TRANSCRIPT_IGNORED, dict(info))

    def _redact_all(self, messages: list[dict[str, Any]], parts: list[bytes]
                    ) -> tuple[list[bytes], list[dict[str, Any]] | None]:
        """The messages' JSON with secrets redacted (when a scanner is set), and what was removed (or None)."""
        scanner = self._s.scanner
        if scanner is None:
            return parts, None
        from ..model.secret_scan import redact_messages

        _, parts, found = redact_messages(scanner, messages, parts)
        return parts, found or None

    async def clear(self) -> None:
        self._s.check_writable()
        self._appends.end_replay()
        await self._writer.commit(ev.CLEARED, {})
        self._s.cleared_here = True

    def resolve_key(self, message_index: int | None, seq: int | None) -> int:
        """The key of the message named by exactly one of ``message_index`` and ``seq``."""
        if (message_index is None) == (seq is None):
            raise ValueError("give exactly one of message_index (position in get_messages()) or seq")
        state = self._s.state
        if message_index is not None:
            if isinstance(message_index, bool) or not isinstance(message_index, int):
                raise ValueError(f"message_index must be an int, got {message_index!r}")
            n = len(state.keys)
            if not -n <= message_index < n:
                raise ValueError(f"message_index {message_index} is out of range; the history has {n} messages")
            return state.keys[message_index]
        key = make_key(seq) if isinstance(seq, int) and not isinstance(seq, bool) else None
        if key is None or state.index_of(key) is None:
            raise ValueError(f"seq {seq!r} is not a message_added event of the current history")
        return key

    async def mark(self, type_: str, message_index: int | None, seq: int | None) -> None:
        """One ``pinned``, ``unpinned`` or ``redacted`` event for the message named; after a redaction the
        store's own audit exports are rewritten without it."""
        self._appends.end_replay()  # any other write ends a replay recognition (docs/resume.md)
        key = self.resolve_key(message_index, seq)
        at, index = split_key(key)
        await self._writer.commit(type_, {"key": key, "seq": at, "index": index})
        if type_ == ev.REDACTED and isinstance(self._s.log, FileEventLog):
            from ..transfer.snapshot import rewrite_audit_exports  # (export_on_compact's snapshots must not keep it)

            await rewrite_audit_exports(self._store, at)


def edited_warning(session_id: str, removed: list[int], changed: list[int]) -> str:
    """The one warning about an edited transcript: what differs, that it has no effect, and what does."""
    what = "; ".join(f"{name} the message(s) of seq {', '.join(map(str, seqs[:8]))}{' ...' if len(seqs) > 8 else ''}"
                     for name, seqs in (("removes", removed), ("changes", changed)) if seqs)
    example = (removed or changed)[0]
    return (f"session {session_id}: the host's transcript (transcript.jsonl) differs from the session's log: it {what}. "
            "Editing the transcript changes nothing: the log is the session's record, and the host writes the "
            "whole history back to the transcript after the next turn. To remove a message for good, close the "
            f"session and run `context-persistent erase {session_id} --seq {example}` (`context-persistent show "
            f"{session_id}` lists the seqs). This warning is shown once per session.")
