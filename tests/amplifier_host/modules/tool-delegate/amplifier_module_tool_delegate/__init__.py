"""Spawns or resumes a sub-session through the CLI's ``session.spawn`` / ``session.resume`` capabilities
(what the real delegate tool does), for the real-CLI tests."""

from __future__ import annotations

from typing import Any

from amplifier_core import ToolResult

__amplifier_module_type__ = "tool"


class Delegate:
    name = "delegate"
    description = "Run a sub-session."
    input_schema = {"type": "object", "properties": {"action": {"type": "string"},
                                                     "session_id": {"type": "string"}}}

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    async def execute(self, input: dict[str, Any]) -> ToolResult:
        if input.get("action") == "resume":
            resume = self.coordinator.get_capability("session.resume")
            result = await resume(sub_session_id=input["session_id"], instruction="child follow-up")
        else:
            spawn = self.coordinator.get_capability("session.spawn")
            result = await spawn(agent_name="helper", instruction="child task",
                                 parent_session=self.coordinator.session,
                                 agent_configs={"helper": {"instruction": "You are the helper agent."}})
        return ToolResult(success=True, output=f"sub-session {result['session_id']}: {result['output']}")


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("tools", Delegate(coordinator), name="delegate")
