"""Stands in for openai-agents' ``tests/test_responses.py`` (not in the archive): the three helpers its
``tests/memory/`` imports, built on the package's own ``agents.testing`` helpers. Copied to
``tests/test_responses.py`` of the test-time copy.
"""

from __future__ import annotations

import json
from typing import Any

from agents import FunctionTool
from agents.testing import assistant_message, function_call


def get_text_message(content: str) -> Any:
    return assistant_message(content, item_id="1")


def get_function_tool_call(name: str, arguments: str | None = None, call_id: str | None = None,
                           namespace: str | None = None) -> Any:
    return function_call(name, arguments or "", call_id=call_id or "2", item_id="1", namespace=namespace)


def get_function_tool(name: str | None = None, return_value: str | None = None,
                      hide_errors: bool = False) -> FunctionTool:
    async def invoke(_ctx: Any, _arguments: str) -> Any:
        return return_value

    return FunctionTool(name=name or "test_func", description="Test tool",
                        params_json_schema={"type": "object", "properties": {}, "additionalProperties": False},
                        on_invoke_tool=invoke)


__all__ = ["get_function_tool", "get_function_tool_call", "get_text_message", "json"]
