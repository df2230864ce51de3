"""A tiny orchestrator for end-to-end tests: one agent turn with one tool round trip, no LLM."""

from __future__ import annotations

import json
from typing import Any


class FakeLoop:
    def __init__(self, config: dict[str, Any]) -> None:
        self.system_prompt = config.get("system_prompt", "You are a test agent.")
        self.requests: list[list[dict[str, Any]]] = []

    async def execute(self, prompt: str, context: Any, providers: dict[str, Any], tools: dict[str, Any],
                      hooks: Any, **kwargs: Any) -> str:
        provider = next(iter(providers.values()))
        if not await context.get_messages():
            await context.add_message({"role": "system", "content": self.system_prompt})
        await context.add_message({"role": "user", "content": prompt})
        while True:
            request = await context.get_messages_for_request(provider=provider)
            self.requests.append(request)
            reply = await provider.complete(request)
            usage = getattr(provider, "last_usage", None)
            if usage is not None:  # as loop-basic does right after provider.complete()
                await hooks.emit("provider:response", {"provider": "fake", "usage": usage,
                                                       "tool_calls": bool(reply.get("tool_calls"))})
            await context.add_message(reply)
            if not reply.get("tool_calls"):
                return reply["content"]
            for call in reply["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                await context.add_message({"role": "tool", "tool_call_id": call["id"],
                                           "content": f"contents of {args['path']}"})


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("orchestrator", FakeLoop(config or {}))
