"""A scripted provider for end-to-end tests: asks for one tool call per turn, then answers."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any


class FakeProvider:
    name = "fake"

    def __init__(self, config: dict[str, Any]) -> None:
        self.context_window = config.get("context_window", 100_000)
        self.max_output_tokens = config.get("max_output_tokens", 4_000)
        self.calls = 0
        #: With ``report_usage``: the usage of the last response, counted as ``usage_ratio`` tokens per 4
        #: characters of the request's JSON plus ``usage_overhead`` (as a provider whose tokenizer differs).
        self.report_usage = config.get("report_usage", False)
        self.ratio = config.get("usage_ratio", 1.0)
        self.overhead = config.get("usage_overhead", 0)
        self.model = config.get("model")
        self.last_usage: dict[str, Any] | None = None

    def get_info(self) -> Any:
        return SimpleNamespace(id="fake", display_name="Fake", defaults={
            "context_window": self.context_window, "max_output_tokens": self.max_output_tokens,
            **({"model": self.model} if self.model else {})})

    async def list_models(self) -> list[Any]:
        return []

    async def complete(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        if self.report_usage:
            size = int(self.ratio * len(json.dumps(messages)) / 4) + self.overhead
            self.last_usage = {"input_tokens": size, "output_tokens": 7, "total_tokens": size + 7,
                               "cache_read_tokens": None, "cache_write_tokens": None, "cost_usd": 0.001}
        last = messages[-1]
        if last["role"] == "user":
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{self.calls}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{self.calls}.txt"})}}]}
        return {"role": "assistant", "content": f"answer {self.calls} after reading the file"}

    def parse_tool_calls(self, response: Any) -> list[Any]:
        return []


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    await coordinator.mount("providers", FakeProvider(config or {}), name="fake")
