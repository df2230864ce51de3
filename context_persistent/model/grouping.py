"""Atomic message groups and the orphan repairs that every request view gets (pure).

This module owns one rule: *an assistant message that calls tools, together with all of its results, is one
unit*. Every compaction strategy works on the :class:`Group` objects made here, so none of them can split a
call from its results.

Formats understood (mixed freely within one history):

- OpenAI: ``assistant.tool_calls[*].id`` answered by ``{"role": "tool", "tool_call_id": ...}`` messages; the
  legacy ``assistant.function_call`` answered by a ``{"role": "function", "name": ...}`` message.
- Anthropic: ``{"type": "tool_use", "id": ...}`` blocks in assistant ``content`` answered by
  ``{"type": "tool_result", "tool_use_id": ...}`` blocks in a following ``user`` message (Amplifier's
  ``tool_call``/``tool_result`` blocks with ``tool_call_id`` are read the same way).
- Amplifier's own form, as its orchestrators store it: ``assistant.tool_calls[*] = {"id", "tool",
  "arguments"}`` (often next to a ``tool_call`` block with the same id: one call) answered by ``role: tool``.

Repairs (a provider rejects these whatever the budget, so they apply to every request view):

- **Orphan result** (no earlier unanswered call with that id, including a second result for an id already
  answered): dropped. There is nothing to attach it to, and inventing a call would put words in the model's
  mouth. A user message that also holds text keeps its text; only the orphan blocks go.
- **Unanswered call** (e.g. a crash mid-tool): a clearly marked placeholder result is added right after the
  call. Dropping the call instead would also drop the assistant's text and reasoning (and thinking-block
  signatures) and hide that the action was attempted, which invites the model to repeat a possibly
  non-idempotent action; the placeholder keeps all of that and tells the model the outcome is unknown.
- **Late result** (separated from its call by other messages): moved up to sit right after its call, before
  the messages that came between; nothing is lost and what happened stays readable.
- ``tool_calls: []`` (rejected by OpenAI): the empty key is removed.

The input is never mutated: changed messages are new dicts; unchanged ones are passed through as the same
objects by :func:`analyse` (callers that hand messages out must copy them; :func:`repair` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from .values import Frozen, set_field as _set

GroupKind = Literal["system", "user", "assistant", "tool", "other"]

SYSTEM_ROLES = frozenset({"system", "developer"})
CALL_BLOCK_TYPES = frozenset({"tool_use", "tool_call"})
_RESULT_ROLES = frozenset({"tool", "function"})


def placeholder_text(name: str, call_id: str) -> str:
    """The text of a synthesised result for a call whose result never came."""
    return (
        f"[no result recorded for tool '{name}' ({call_id}): the stored history has this call but no result "
        "(interrupted?); context-persistent added this note so the request stays valid]"
    )


def is_system(message: dict[str, Any]) -> bool:
    """True for ``system`` and ``developer`` messages (always kept)."""
    return message.get("role") in SYSTEM_ROLES


def is_real_user_turn(message: dict[str, Any]) -> bool:
    """True for a user message a person wrote: any content other than ``tool_result`` blocks."""
    if message.get("role") != "user":
        return False
    content = message.get("content")
    if not isinstance(content, list):
        return True
    return any(not (isinstance(b, dict) and b.get("type") == "tool_result") for b in content) or not content


def tool_calls_of(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The calls an assistant message makes, as ``(key, tool name, format)``; ``[]`` for other messages.

    ``format`` is ``"openai"``, ``"function"`` (legacy, keyed ``"function:<name>"``), or the block type
    (``"tool_use"`` / ``"tool_call"``).
    """
    if message.get("role") != "assistant":
        return []
    calls: list[tuple[str, str, str]] = []
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            fn = call.get("function")
            name = fn.get("name") if isinstance(fn, dict) else call.get("name") or call.get("tool")
            calls.append((call["id"], str(name or "?"), "openai"))
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") in CALL_BLOCK_TYPES and isinstance(block.get("id"), str):
                if any(key == block["id"] for key, _, _ in calls):
                    continue  # one call stored twice (Amplifier: a tool_call block and a tool_calls entry)
                calls.append((block["id"], str(block.get("name") or "?"), block["type"]))
    legacy = message.get("function_call")
    if isinstance(legacy, dict) and not calls:
        name = str(legacy.get("name") or "?")
        calls.append((f"function:{name}", name, "function"))
    return calls


def result_block_id(block: Any) -> str | None:
    """The call id a ``tool_result`` content block answers, or None if it is not one."""
    if isinstance(block, dict) and block.get("type") == "tool_result":
        key = block.get("tool_use_id", block.get("tool_call_id"))
        return key if isinstance(key, str) else ""
    return None


def result_key(message: dict[str, Any]) -> str | None:
    """The call key a ``tool``/``function`` message answers (``""`` when it names none), else None."""
    role = message.get("role")
    if role == "tool":
        key = message.get("tool_call_id")
        return key if isinstance(key, str) else ""
    if role == "function":
        return f"function:{message.get('name') or '?'}"
    return None


def has_result_blocks(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return (
        message.get("role") == "user"
        and isinstance(content, list)
        and any(result_block_id(b) is not None for b in content)
    )


class Group(Frozen):
    """Messages ``[start, stop)`` of a (repaired) sequence that are kept or left out together."""

    __slots__ = ("start", "stop", "kind")
    start: int
    stop: int
    kind: GroupKind

    def __init__(self, start: int, stop: int, kind: GroupKind) -> None:
        _set(self, "start", start)
        _set(self, "stop", stop)
        _set(self, "kind", kind)

    @property
    def indices(self) -> range:
        return range(self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def token_sum(self, tokens: Sequence[int]) -> int:
        """Sum of ``tokens[i]`` over this group's messages."""
        return sum(tokens[self.start : self.stop])


class RepairReport(Frozen):
    """What :func:`analyse` changed to make a sequence valid for providers (call ids, in order)."""

    __slots__ = ("orphan_results_dropped", "placeholders_added", "results_moved", "empty_tool_calls_removed")
    orphan_results_dropped: tuple[str, ...]
    placeholders_added: tuple[str, ...]
    results_moved: tuple[str, ...]
    empty_tool_calls_removed: int

    def __init__(self, orphan_results_dropped: tuple[str, ...] = (), placeholders_added: tuple[str, ...] = (),
                 results_moved: tuple[str, ...] = (), empty_tool_calls_removed: int = 0) -> None:
        _set(self, "orphan_results_dropped", orphan_results_dropped)
        _set(self, "placeholders_added", placeholders_added)
        _set(self, "results_moved", results_moved)
        _set(self, "empty_tool_calls_removed", empty_tool_calls_removed)

    @property
    def changed(self) -> bool:
        return bool(
            self.orphan_results_dropped or self.placeholders_added or self.results_moved
            or self.empty_tool_calls_removed
        )

    def problems(self) -> list[str]:
        """Human-readable descriptions of what was wrong (empty when the sequence was valid)."""
        out = [f"orphan tool result for {k!r}" for k in self.orphan_results_dropped]
        out += [f"tool call {k!r} has no result" for k in self.placeholders_added]
        out += [f"result for {k!r} is separated from its call" for k in self.results_moved]
        out += ["assistant message with empty tool_calls"] * self.empty_tool_calls_removed
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "orphan_results_dropped": list(self.orphan_results_dropped),
            "placeholders_added": list(self.placeholders_added),
            "results_moved": list(self.results_moved),
            "empty_tool_calls_removed": self.empty_tool_calls_removed,
        }


class Analysis(Frozen):
    """A repaired sequence, where each message came from, and its groups.

    ``sources[i]`` is the input index message ``i`` came from (None for a synthesised placeholder). When
    ``messages[i] is input[sources[i]]`` the message is unchanged and its cached token count still holds.
    """

    __slots__ = ("messages", "sources", "groups", "report")
    messages: list[dict[str, Any]]
    sources: list[int | None]
    groups: list[Group]
    report: RepairReport

    def __init__(self, messages: list[dict[str, Any]], sources: list[int | None], groups: list[Group],
                 report: RepairReport) -> None:
        _set(self, "messages", messages)
        _set(self, "sources", sources)
        _set(self, "groups", groups)
        _set(self, "report", report)


class _Unit:
    __slots__ = ("kind", "items", "pending")

    def __init__(self, kind: GroupKind, items: list[tuple[dict[str, Any], int | None]]) -> None:
        self.kind = kind
        self.items = items
        self.pending: dict[str, tuple[str, str]] = {}  # key -> (name, format)


def _kind(message: dict[str, Any]) -> GroupKind:
    role = message.get("role")
    if role in SYSTEM_ROLES:
        return "system"
    if role == "user":
        return "user"
    if role == "assistant":
        return "assistant"
    return "other"


def analyse(messages: Sequence[dict[str, Any]]) -> Analysis:
    """Repair ``messages`` for providers and split the result into atomic groups, in one O(n) pass."""
    units: list[_Unit] = []
    open_calls: dict[str, _Unit] = {}
    dropped: list[str] = []
    moved: list[str] = []
    empty_calls = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            units.append(_Unit("other", [(m, i)]))
            continue
        calls = tool_calls_of(m)
        if calls:
            unit = _Unit("tool", [(m, i)])
            for key, name, fmt in calls:
                open_calls[key] = unit  # an earlier unanswered call with the same id keeps its placeholder
                unit.pending[key] = (name, fmt)
            units.append(unit)
            continue
        answers = result_key(m)
        if answers is not None:
            owner = open_calls.pop(answers, None)
            if owner is None:
                dropped.append(answers)
                continue
            del owner.pending[answers]
            if owner is not units[-1]:
                moved.append(answers)
            owner.items.append((m, i))
            continue
        if has_result_blocks(m):
            _attach_result_blocks(m, i, units, open_calls, dropped, moved)
            continue
        if m.get("role") == "assistant" and "tool_calls" in m and m["tool_calls"] == []:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            empty_calls += 1
        units.append(_Unit(_kind(m), [(m, i)]))

    placeholders: list[str] = []
    out: list[dict[str, Any]] = []
    sources: list[int | None] = []
    groups: list[Group] = []
    for unit in units:
        if unit.pending:
            placeholders.extend(unit.pending)
            _add_placeholders(unit)
        start = len(out)
        for msg, src in unit.items:
            out.append(msg)
            sources.append(src)
        groups.append(Group(start, len(out), unit.kind))
    report = RepairReport(tuple(dropped), tuple(placeholders), tuple(moved), empty_calls)
    return Analysis(out, sources, groups, report)


def _attach_result_blocks(
    m: dict[str, Any],
    i: int,
    units: list[_Unit],
    open_calls: dict[str, _Unit],
    dropped: list[str],
    moved: list[str],
) -> None:
    """Give each tool_result block of user message ``m`` to its call's unit; keep any other content."""
    buckets: dict[int, tuple[_Unit, list[Any]]] = {}
    rest: list[Any] = []
    kept_all: list[Any] = []  # content minus orphan blocks, in order
    for block in m["content"]:
        key = result_block_id(block)
        if key is None:
            rest.append(block)
            kept_all.append(block)
            continue
        owner = open_calls.pop(key, None)
        if owner is None:
            dropped.append(key)
            continue
        del owner.pending[key]
        buckets.setdefault(id(owner), (owner, []))[1].append(block)
        kept_all.append(block)
    if len(buckets) == 1:
        ((owner, blocks),) = buckets.values()
        if owner is units[-1]:  # the normal case: the results follow their call
            msg = m if len(kept_all) == len(m["content"]) else {**m, "content": kept_all}
            owner.items.append((msg, i))
            return
    for owner, blocks in buckets.values():
        if owner is not units[-1]:
            moved.extend(str(result_block_id(b)) for b in blocks)
        owner.items.append(({**m, "content": blocks}, i))
    if rest:
        units.append(_Unit("user", [({**m, "content": rest}, i)]))


def _add_placeholders(unit: _Unit) -> None:
    """Answer every still-pending call of ``unit`` with a marked placeholder result (new dicts only)."""
    blocks: list[dict[str, Any]] = []
    for key, (name, fmt) in unit.pending.items():
        text = placeholder_text(name, key.removeprefix("function:") if fmt == "function" else key)
        if fmt == "openai":
            unit.items.append(({"role": "tool", "tool_call_id": key, "content": text}, None))
        elif fmt == "function":
            unit.items.append(({"role": "function", "name": name, "content": text}, None))
        elif fmt == "tool_call":
            blocks.append({"type": "tool_result", "tool_call_id": key, "output": text})
        else:
            blocks.append({"type": "tool_result", "tool_use_id": key, "content": text, "is_error": True})
    unit.pending.clear()
    if not blocks:
        return
    for pos, (msg, src) in enumerate(unit.items):
        if has_result_blocks(msg):  # merge into the existing results message: one user turn, results first
            content = list(msg["content"])
            last = max(j for j, b in enumerate(content) if result_block_id(b) is not None)
            unit.items[pos] = ({**msg, "content": content[: last + 1] + blocks + content[last + 1 :]}, src)
            return
    unit.items.append(({"role": "user", "content": blocks}, None))


def repair(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], RepairReport]:
    """``messages`` made valid for providers, as new dicts, and what was changed. The input is untouched."""
    result = analyse(messages)
    return [dict(m) for m in result.messages], result.report


def group_messages(messages: Sequence[dict[str, Any]]) -> list[Group]:
    """The atomic groups of a valid sequence.

    Raises ``ValueError`` naming the problems when ``messages`` needs a repair first (see :func:`repair`),
    because group indices must refer to the caller's own list.
    """
    result = analyse(messages)
    if result.report.changed:
        raise ValueError(
            "messages need repair before grouping: " + "; ".join(result.report.problems())
            + " (call repair() or analyse() first)"
        )
    return result.groups


def validate_sequence(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Provider-validity problems of ``messages`` (orphans, unanswered or split calls); empty when valid."""
    return analyse(messages).report.problems()
