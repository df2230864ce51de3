"""The floor for the host benchmark: a context that keeps the messages in a list in memory.

It does what any context module must (append, hand back, replace, clear, the system prompt factory)
and nothing else: no file, no token counting, no compaction. Its turn through the CLI is the host's own
cost; what a real module adds is measured against it.
"""

from __future__ import annotations

from typing import Any

__amplifier_module_type__ = "context"


class MemoryContext:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.factory: Any = None

    async def add_message(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    async def get_messages(self) -> list[dict[str, Any]]:
        return list(self.messages)

    async def get_messages_for_request(self, token_budget: int | None = None, provider: Any = None) -> list[dict[str, Any]]:
        messages = [m for m in self.messages if m.get("role") != "system"] if self.factory else list(self.messages)
        if self.factory:
            messages.insert(0, {"role": "system", "content": await self.factory()})
        return messages

    async def set_messages(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    async def clear(self) -> None:
        self.messages = []

    async def set_system_prompt_factory(self, factory: Any) -> None:
        self.factory = factory


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("context", MemoryContext())
