"""An echo tool for the real-CLI tests. Text containing ``slow`` blocks (after touching
``$CP_E2E_TOOL_MARKER``), so a test can kill the process during a tool call."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from amplifier_core import ToolResult

__amplifier_module_type__ = "tool"


class Echo:
    name = "echo"
    description = "Echo the text back."
    input_schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def execute(self, input: dict[str, Any]) -> ToolResult:
        text = str(input.get("text", ""))
        marker = os.environ.get("CP_E2E_TOOL_MARKER")
        if "slow" in text and marker:
            with open(marker, "w", encoding="utf-8") as f:
                f.write(str(os.getpid()))
            await asyncio.sleep(600)
        return ToolResult(success=True, output="echo: " + text[-100:])


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("tools", Echo(), name="echo")
