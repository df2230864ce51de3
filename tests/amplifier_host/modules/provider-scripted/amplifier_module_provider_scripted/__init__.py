"""A scripted provider for the real-CLI tests: canned replies, and it records every request it receives.

Each request is appended as one JSON line to ``$CP_E2E_PROVIDER_LOG``: the session id and the messages as
the orchestrator sent them. The reply depends only on the last message:

- a user message containing ``spawn`` asks for the ``delegate`` tool (a sub-session);
- ``again <sub-session id>`` asks ``delegate`` to resume that sub-session;
- ``tool`` or ``slow`` asks for the ``echo`` tool (``slow``: the tool blocks, for kill tests);
- a tool result is answered with ``done: <result>``; anything else with ``reply to: <text>``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from amplifier_core.message_models import ChatResponse, TextBlock, ToolCall, Usage
from amplifier_core.models import ProviderInfo

__amplifier_module_type__ = "provider"


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, dict):
            parts.append(str(block.get("text") or block.get("output") or ""))
    return " ".join(parts)


class ScriptedProvider:
    name = "scripted"

    def __init__(self, session_id: str, config: dict[str, Any]) -> None:
        self.session_id = session_id
        self.config = config

    def get_info(self) -> ProviderInfo:
        return ProviderInfo(id="scripted", display_name="Scripted", credential_env_vars=[],
                            capabilities=["tools"],
                            # (the benchmark's turns without compaction give it a window larger than the history)
                            defaults={"model": "scripted-1",
                                      "context_window": int(self.config.get("context_window", 200000)),
                                      "max_output_tokens": 4000})

    async def list_models(self) -> list[Any]:
        return []

    async def complete(self, request: Any, **kwargs: Any) -> ChatResponse:
        messages = [m.model_dump(mode="json") for m in request.messages]
        path = os.environ.get("CP_E2E_PROVIDER_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"session_id": self.session_id, "pid": os.getpid(),
                                    "messages": messages}) + "\n")
        last = messages[-1]
        text = text_of(last.get("content"))
        usage = Usage(input_tokens=1, output_tokens=1, total_tokens=2)
        call_id = f"call_{len(messages)}_{os.getpid()}"
        if last["role"] == "user":
            again = re.search(r"again (\S+)", text)
            if again:
                return self._call(call_id, "delegate", {"action": "resume", "session_id": again.group(1)}, usage)
            if "spawn" in text:
                return self._call(call_id, "delegate", {"action": "spawn"}, usage)
            if "tool" in text or "slow" in text:
                return self._call(call_id, "echo", {"text": text[-200:]}, usage)
        if last["role"] == "tool":
            return ChatResponse(content=[TextBlock(text=f"done: {text[:200]}")], usage=usage)
        return ChatResponse(content=[TextBlock(text=f"reply to: {text[-200:]}")], usage=usage)

    @staticmethod
    def _call(call_id: str, name: str, arguments: dict[str, Any], usage: Usage) -> ChatResponse:
        return ChatResponse(content=[TextBlock(text=f"calling {name}")],
                            tool_calls=[ToolCall(id=call_id, name=name, arguments=arguments)], usage=usage)

    def parse_tool_calls(self, response: Any) -> list[Any]:
        return response.tool_calls or []


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    provider = ScriptedProvider(str(getattr(coordinator, "session_id", "")), config or {})
    await coordinator.mount("providers", provider, name="scripted")
