"""The search benchmarks' data and queries: the agent mix with topic words, and queries in classes.

The agent mix (long_data.messages) is written from a vocabulary of about a hundred words, so each of its words
is in about half the messages: a search for one of them is the worst case for ranking (every match is ranked),
and nothing in it is rare. What a user asks ("where did I discuss X?") is usually a word few messages hold: a
project, an error, a library. So each user and assistant message here also names two *topic words* drawn from
50,000 (``kw1x`` ... ``kw50000x``) with Zipf's law (the r-th most frequent word in about 1/r of the
messages the first one is in, as words of natural text are): the first few topic words are in thousands of
messages, most in a handful. The queries come in classes by how many messages they match, reported apart:

- ``rare``: a topic word of rank 1,000 to 20,000 (in one to a few dozen messages at 1 GB);
- ``mid``: a topic word of rank 3 to 30 (in thousands of messages at 1 GB);
- ``common``: a word of the mix (about half the messages);
- ``and``: two words of the mix; ``phrase``: two words of the mix as a phrase; ``prefix``: the first four
  letters of a word of the mix and ``*``; ``or``: two words of the mix joined by ``OR``;
- ``rare+common``: a rare topic word and a word of the mix (both must match).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator
from typing import Any

from .long_data import messages

TOPICS = 50_000
#: The classes, in the order the benchmark reports them.
CLASSES = ("rare", "mid", "common", "and", "phrase", "prefix", "or", "rare+common")
_CUM = list(itertools.accumulate(1 / r for r in range(1, TOPICS + 1)))


def topic(rank: int) -> str:
    return f"kw{rank}x"


def topic_messages(n: int, seed: int) -> Iterator[dict[str, Any]]:
    """``n`` messages of the agent mix, each user and assistant text followed by two topic words."""
    rng = random.Random(seed * 7919 + 1)
    ranks = range(1, TOPICS + 1)
    for m in messages(n, seed=seed):
        if m["role"] in ("user", "assistant"):
            words = " ".join(topic(r) for r in rng.choices(ranks, cum_weights=_CUM, k=2))
            m = {**m, "content": f"{m.get('content') or ''} {words}".lstrip()}
        yield m


def _mix_words() -> list[str]:
    return [w for m in messages(400, seed=99) for w in re.findall(r"[a-z]{5,}", str(m.get("content") or ""))]


def queries(rng: random.Random, per_class: int) -> list[tuple[str, str]]:
    """``per_class`` queries of each class, as ``(class, query)``, the classes interleaved."""
    words = _mix_words()
    out = []
    for _ in range(per_class):
        a, b = rng.choice(words), rng.choice(words)
        rare = topic(rng.randint(1000, 20_000))
        made = {"rare": rare, "mid": topic(rng.randint(3, 30)), "common": a, "and": f"{a} {b}",
                "phrase": f'"{a} {b}"', "prefix": f"{a[:4]}*", "or": f"{a} OR {b}", "rare+common": f"{rare} {a}"}
        out += [(c, made[c]) for c in CLASSES]
    return out


def legacy_queries(rng: random.Random, n: int) -> list[str]:
    """The queries of the first version of the benchmark (every one of words of the mix: the common classes)."""
    words = _mix_words()
    out = []
    for i in range(n):
        a, b = rng.choice(words), rng.choice(words)
        out.append([a, f"{a} {b}", f'"{a} {b}"', f"{a[:4]}*", f"{a} OR {b}"][i % 5])
    return out
