"""What every strategy shares: the plan it edits, and how a plan becomes messages (pure); the request it gets and
the result it gives are in request.py, loaded with the first compaction."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..grouping import Group, result_block_id
from ..values import Value

if TYPE_CHECKING:
    from .request import CompactionRequest, CompactionResult

Message = dict[str, Any]

#: Truncation never cuts a text below this many characters (head and tail of it are kept).
MIN_TRUNCATED_CHARS = 200


class Plan(Value):
    """Which groups are kept and which messages are replaced, with a running token total.

    ``total`` includes an upper-bound estimate of one marker per left-out span, so a plan that fits its
    limit still fits once the markers are in.
    """

    __slots__ = ("request", "keep", "marker_cost", "intro_cost", "replaced", "kept_tokens", "spans")
    request: CompactionRequest
    keep: list[bool]
    marker_cost: int
    intro_cost: int
    replaced: dict[int, tuple[Message, int]]
    kept_tokens: int
    spans: int

    def __init__(self, request: CompactionRequest, keep: list[bool], marker_cost: int, intro_cost: int = 0,
                 replaced: dict[int, tuple[Message, int]] | None = None, kept_tokens: int = 0, spans: int = 0) -> None:
        self.request = request
        self.keep = keep
        self.marker_cost = marker_cost
        self.intro_cost = intro_cost
        self.replaced = {} if replaced is None else replaced
        self.kept_tokens = kept_tokens
        self.spans = spans

    @classmethod
    def start(cls, request: CompactionRequest, keep: Sequence[bool]) -> Plan:
        short = request.count(marker_message(10**6, 10**9, first=False))
        plan = cls(request, list(keep), short, request.count(marker_message(10**6, 10**9)) - short)
        plan.kept_tokens = sum(t for t, k in zip(request.group_tokens, plan.keep) if k)
        plan.spans = sum(1 for g, k in enumerate(plan.keep) if not k and (g == 0 or plan.keep[g - 1]))
        return plan

    @property
    def total(self) -> int:
        return self.kept_tokens + self.spans * self.marker_cost + (self.intro_cost if self.spans else 0)

    def _neighbours_dropped(self, g: int) -> int:
        left = g > 0 and not self.keep[g - 1]
        right = g + 1 < len(self.keep) and not self.keep[g + 1]
        return int(left) + int(right)

    def group_cost(self, g: int) -> int:
        """Tokens group ``g`` costs now (with replacements applied)."""
        cost = self.request.group_tokens[g]
        for i in self.request.groups[g].indices:
            if i in self.replaced:
                cost += self.replaced[i][1] - self.request.tokens[i]
        return cost

    def cost_if_added(self, g: int) -> int:
        """``total`` after keeping the dropped group ``g``."""
        spans = self.spans + self._neighbours_dropped(g) - 1
        markers = spans * self.marker_cost + (self.intro_cost if spans else 0)
        return self.kept_tokens + self.group_cost(g) + markers

    def drop(self, g: int) -> None:
        if self.keep[g]:
            self.keep[g] = False
            self.kept_tokens -= self.group_cost(g)
            self.spans += 1 - self._neighbours_dropped(g)

    def add(self, g: int) -> None:
        if not self.keep[g]:
            self.spans -= 1 - self._neighbours_dropped(g)
            self.keep[g] = True
            self.kept_tokens += self.group_cost(g)

    def group_of(self, i: int) -> int:
        """Index of the group holding message ``i``."""
        return _group_of(self.request.groups, i)

    def replace(self, i: int, message: Message, tokens: int) -> None:
        """Use ``message`` (``tokens`` long) in place of message ``i``."""
        before = self.replaced[i][1] if i in self.replaced else self.request.tokens[i]
        self.replaced[i] = (message, tokens)
        if self.keep[self.group_of(i)]:
            self.kept_tokens += tokens - before


def _group_of(groups: Sequence[Group], i: int) -> int:
    lo, hi = 0, len(groups) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if groups[mid].stop <= i:
            lo = mid + 1
        else:
            hi = mid
    return lo


def view_token_counts(request: CompactionRequest, out: Sequence[Message]) -> list[int]:
    """Tokens of each message of a view: cached for messages passed through from the request, else counted."""
    index = {id(m): i for i, m in enumerate(request.messages)}
    return [request.tokens[index[id(m)]] if id(m) in index else request.count(m) for m in out]


def count_view(request: CompactionRequest, out: Sequence[Message]) -> int:
    """Total tokens of a view (see :func:`view_token_counts`)."""
    return sum(view_token_counts(request, out))


def marker_message(n_messages: int, n_tokens: int | None, first: bool = True) -> Message:
    """The note put where messages were left out (a user-role note: every provider accepts it anywhere).

    The first gap's note explains itself; later gaps get a short one, so a view with many gaps does not
    spend its budget on notes. ``n_tokens`` is None when the left-out messages were never counted (a
    windowed rebuild, ``compaction/window.py``).
    """
    size = "" if n_tokens is None else f" ({n_tokens:,} tokens)"
    text = f"[context-persistent: {n_messages:,} messages{size} left out here"
    if first:
        text += " to fit the token budget; the full history is kept in the event log"
    return {"role": "user", "content": text + "]"}


def summary_message(n_messages: int, text: str) -> Message:
    return {
        "role": "user",
        "content": f"[context-persistent: summary of {n_messages:,} earlier messages left out of this request]\n\n{text}",
    }


def _text_slots(message: Message) -> list[tuple[tuple[Any, ...], str]]:
    """Each truncatable string of a message with its path: str content, text blocks, tool_result text."""
    content = message.get("content")
    if isinstance(content, str):
        return [((), content)]
    slots: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(content, list):
        for j, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                slots.append(((j, "text"), block["text"]))
            elif result_block_id(block) is not None:
                for key in ("content", "output"):
                    if isinstance(block.get(key), str):
                        slots.append(((j, key), block[key]))
    return slots


def _with_text(message: Message, path: tuple[Any, ...], text: str) -> Message:
    if not path:
        return {**message, "content": text}
    j, key = path
    content = list(message["content"])
    content[j] = {**content[j], key: text}
    return {**message, "content": content}


def truncate_message(message: Message, tokens: int, max_tokens: int, count: Callable[[Message], int]) -> tuple[Message, int] | None:
    """A copy of ``message`` whose longest text is cut (head and tail kept) toward ``max_tokens``.

    Returns None when nothing can be cut. Tool call arguments and thinking blocks are never touched (cutting
    them would break JSON or signatures).
    """
    slots = _text_slots(message)
    if not slots:
        return None
    path, text = max(slots, key=lambda s: len(s[1]))
    current, cur_tokens = message, tokens
    for _ in range(3):
        if cur_tokens <= max_tokens or len(text) <= MIN_TRUNCATED_CHARS:
            break
        chars_per_token = max(len(text) / max(cur_tokens, 1), 0.5)
        keep = max(MIN_TRUNCATED_CHARS, int(len(text) - (cur_tokens - max_tokens + 40) * chars_per_token * 1.1))
        cut_tokens = max(1, int((len(text) - keep) / chars_per_token))
        head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
        text = f"{head}\n[... truncated by context-persistent: about {cut_tokens:,} tokens cut ...]\n{tail}"
        current = _with_text(message, path, text)
        cur_tokens = count(current)
    return (current, cur_tokens) if current is not message else None


async def finish(plan: Plan, **stats: Any) -> CompactionResult:
    """Turn a plan into messages: kept groups in order, a marker (or the summary) per left-out span.

    Markers that would push the view over the budget are left out (the view's validity and size come
    first). With ``config.summarizer`` the summary of every left-out message goes where the first span was.
    """
    from .request import CompactionResult

    req = plan.request
    spans: list[tuple[int, list[int]]] = []  # (position in out, dropped message indices)
    out: list[Message] = []
    out_tokens: list[int] = []
    for g, group in enumerate(req.groups):
        if not plan.keep[g]:
            if not spans or spans[-1][0] != len(out):
                spans.append((len(out), []))
            spans[-1][1].extend(group.indices)
            continue
        for i in group.indices:
            msg, tok = plan.replaced.get(i, (req.messages[i], req.tokens[i]))
            out.append(msg)
            out_tokens.append(tok)
    total = sum(out_tokens)
    notes: list[tuple[int, Message, int]] = []
    warning = stats.pop("warning", None)
    summarized = False
    if spans and req.config.summarizer is not None:
        dropped = [i for _, idx in spans for i in idx]
        summary, warn = await _summarize(req, dropped, room=req.budget - total)
        if summary is not None:
            notes.append((spans[0][0], summary[0], summary[1]))
            total += summary[1]
            spans = spans[1:]
            summarized = True
        warning = warning or warn
    for n, (pos, idx) in enumerate(spans):
        marker = marker_message(len(idx), sum(req.tokens[i] for i in idx), first=n == 0 and not summarized)
        cost = req.count(marker)
        if total + cost <= req.budget:
            notes.append((pos, marker, cost))
            total += cost
    if notes:  # merge the notes in, in one pass (positions ascend: spans are in order)
        notes.sort(key=lambda n: n[0])
        merged: list[Message] = []
        merged_tokens: list[int] = []
        prev = 0
        for pos, msg, tok in notes:
            merged += out[prev:pos]
            merged_tokens += out_tokens[prev:pos]
            merged.append(msg)
            merged_tokens.append(tok)
            prev = pos
        out, out_tokens = merged + out[prev:], merged_tokens + out_tokens[prev:]
    return CompactionResult(
        out, groups_dropped=plan.keep.count(False), summarized=summarized, warning=warning,
        token_counts=out_tokens, **stats,
    )


async def _summarize(req: CompactionRequest, dropped: list[int], room: int) -> tuple[tuple[Message, int] | None, str | None]:
    try:
        text = req.config.summarizer([dict(req.messages[i]) for i in dropped])
        if inspect.isawaitable(text):
            text = await text
    except Exception as e:  # a broken summariser must not break the request
        return None, f"summarizer failed ({type(e).__name__}: {e}); a marker was used instead"
    if not isinstance(text, str) or not text.strip():
        return None, "summarizer returned no text; a marker was used instead"
    msg = summary_message(len(dropped), text)
    tokens = req.count(msg)
    if tokens > room:
        cut = truncate_message(msg, tokens, room, req.count)
        if cut is None or cut[1] > room:
            return None, "the summary did not fit the budget; a marker was used instead"
        msg, tokens = cut
    return (msg, tokens), None
