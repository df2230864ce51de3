"""The history's system prompt: the host's factory, asked before every request, and the prompts a host re-adds
at session start on a resume; both become ``system_prompt_set`` events (docs/resume.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..model import codec
from ..model import events as ev
from .session import EVENT_SECRET_REDACTED, Session
from .writer import Writer


def is_prompt(message: dict[str, Any]) -> bool:
    """A system message that can be the system prompt (a hook's injection, ``metadata.source == "hook"``, is
    conversation content)."""
    if message.get("role") != "system":
        return False
    meta = message.get("metadata")
    return not (isinstance(meta, dict) and meta.get("source") == "hook")


class SystemPrompt:
    """Keeps the history's leading system messages equal to what the host says its system prompt is."""

    def __init__(self, session: Session, writer: Writer) -> None:
        self._s = session
        self._writer = writer
        #: The host's system prompt factory (set_system_prompt_factory; hooks read and wrap this attribute).
        self.factory: Callable[[], Awaitable[str]] | None = None
        #: The factory's last text, and its prompt as stored and what the scanner removed (scanned once).
        self._scanned: tuple[str, dict[str, Any], list[dict[str, Any]] | None] | None = None
        #: System messages added at session start on a resume (the host's fallback for a system prompt): they
        #: replace the history's leading system messages instead of piling up (docs/resume.md).
        self.start_prompts: list[dict[str, Any]] | None = None

    def set_factory(self, factory: Callable[[], Awaitable[str]] | None) -> None:
        if factory is not None and not callable(factory):
            raise ValueError(f"the system prompt factory must be an async callable returning a str, got {factory!r}")
        self.factory = factory

    async def offer_at_start(self, stored: dict[str, Any], found: list[dict[str, Any]] | None) -> bool:
        """At session start on a resume, a system prompt added as a message replaces the leading system
        messages (True: it was taken). Any other message ends the session start."""
        if self.start_prompts is None:
            return False
        if not is_prompt(stored):
            self.start_prompts = None
            return False
        prompts = [*self.start_prompts, stored]
        await self.set_prompts(prompts, "add_message", found)
        self.start_prompts = prompts
        return True

    async def refresh(self) -> None:
        """Ask the factory; write a ``system_prompt_set`` event when its prompt differs from the history's."""
        s = self._s
        factory = self.factory
        if factory is None or s.readonly or s.closed:
            return
        result = factory()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        if not isinstance(result, str):
            raise ValueError(f"the system prompt factory returned {type(result).__name__}, expected a str")
        prompt: dict[str, Any] = {"role": "system", "content": result}
        found = None
        scanner = s.scanner
        if scanner is not None:  # the prompt is stored like any message: never with its secrets
            cached = self._scanned
            if cached is not None and cached[0] == result:
                prompt, found = cached[1], cached[2]
            else:
                hit = scanner.redact(prompt, codec.dumps(prompt))
                if hit is not None:
                    prompt, _, found = hit
                self._scanned = (result, prompt, found)
        state = s.state
        if state.leading_system_count() == 1 and state.messages[0] == prompt:
            return
        await self.set_prompts([prompt], "factory", found)

    async def set_prompts(self, prompts: list[dict[str, Any]], source: str,
                          secrets: list[dict[str, Any]] | None) -> None:
        """One ``system_prompt_set`` event (with what kinds the scanner removed, never the secrets)."""
        data: dict[str, Any] = {"messages": prompts, "source": source}
        if secrets:
            data["secrets"] = secrets
        seq = await self._writer.commit(ev.SYSTEM_PROMPT_SET, data)
        if secrets:
            await self._s.emit(EVENT_SECRET_REDACTED, {"seq": seq, "secrets": secrets})
