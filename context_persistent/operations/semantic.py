"""Semantic integrity of a stored history: tool calls paired with their results, in order (pure checks, and
the repair that records fixes as events).

The byte checks (repair.py) prove every record is the one written; these prove the history they fold into is
one a provider accepts. Request views are always made valid anyway (grouping.py repairs each one), so a
finding here never stops the store from working; it shows what an export, the host's transcript or another
reader of the history would trip over, and where it is (the seq of the record that holds the message).

Formats (mixed freely, as in grouping.py): OpenAI ``tool_calls`` answered by ``role: tool`` messages, the legacy
``function_call`` answered by ``role: function``, Anthropic ``tool_use`` blocks answered by ``tool_result``
blocks in the next user message, and Amplifier's own ``tool_calls: [{"id", "tool", "arguments"}]`` (with or
without ``tool_call`` blocks holding the same ids) answered by ``role: tool``.

Findings (``kind``):

* ``unanswered_call`` (a problem): a call no result answers. The classic session-bricking damage of a crash
  mid-tool. When it is the last thing in the history and a writer has the session open, the tool may still be
  running: then it is only a note (``pending``).
* ``orphan_result`` (a problem): a result for a call that is not open: never made, or answered already.
* ``late_result`` (a note): a result separated from its call by other messages (providers want results right
  after the call; request views move them there).
* ``empty_tool_calls`` (a note): an assistant message with ``tool_calls: []`` (OpenAI rejects it; request views
  drop the key).

``store/semantic_repair.repair_semantic`` records fixes as events, never editing a record: a placeholder result (``message_added``,
marked in ``metadata``) for each unanswered call, a ``redacted`` tombstone for each message that holds nothing
but orphan results, then a ``semantic_repaired`` audit event listing what it did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..model.grouping import placeholder_text, result_block_id, result_key, tool_calls_of
from ..model.projection import split_key

PROBLEM_KINDS = ("unanswered_call", "orphan_result")


@dataclass
class Finding:
    """One semantic finding; ``seq`` is the record holding the message, ``index`` its place in the history."""

    kind: str
    seq: int
    index: int
    call_id: str
    tool: str | None
    detail: str
    problem: bool = True
    call_seq: int | None = None

    def describe(self) -> str:
        what = {"unanswered_call": "unanswered tool call", "orphan_result": "orphaned tool result",
                "late_result": "late tool result", "empty_tool_calls": "empty tool_calls"}[self.kind]
        tool = f" (tool {self.tool})" if self.tool else ""
        ident = f" {self.call_id!r}" if self.call_id else ""
        return f"{what}{ident}{tool} at seq {self.seq} (message {self.index}): {self.detail}"


@dataclass
class _Call:
    index: int
    name: str
    fmt: str
    separated: bool = False  # another message came after the call before its result
    seq: int = 0


def _seq(keys: Any, i: int) -> int:
    return split_key(keys[i])[0] if keys is not None else i


def _result_keys(m: dict[str, Any]) -> tuple[list[str], bool]:
    """The call keys a message answers, and whether it holds anything else (text after results)."""
    key = result_key(m)
    if key is not None:
        return [key], False
    content = m.get("content")
    if m.get("role") != "user" or not isinstance(content, list):
        return [], True
    keys = [k for k in (result_block_id(b) for b in content) if k is not None]
    return keys, len(keys) < len(content)


def check(messages: list[dict[str, Any]], keys: Any = None, writer_active: bool = False) -> list[Finding]:
    """Every finding in a history (``keys``: its message keys, for seqs; None: seqs are the indices)."""
    out: list[Finding] = []
    open_calls: dict[str, _Call] = {}
    answered: dict[str, int] = {}  # call key -> seq of the message that answered it
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        seq = _seq(keys, i)
        calls = tool_calls_of(m)
        if calls:
            for call in open_calls.values():
                call.separated = True
            for key, name, fmt in calls:
                open_calls[key] = _Call(i, name, fmt, seq=seq)
            continue
        results, other = _result_keys(m)
        for key in results:
            made = open_calls.pop(key, None)
            shown = key.removeprefix("function:")
            if made is None:
                why = (f"its call was answered already (at seq {answered[key]})" if key in answered
                       else "no call with this id comes before it")
                out.append(Finding("orphan_result", seq, i, shown, None, why))
                continue
            answered[key] = seq
            if made.separated:
                out.append(Finding("late_result", seq, i, shown, made.name,
                                   f"other messages come between it and its call at seq {made.seq}; request "
                                   "views move it next to the call", problem=False, call_seq=made.seq))
        if other:
            if m.get("role") == "assistant" and m.get("tool_calls") == []:
                out.append(Finding("empty_tool_calls", seq, i, "", None, "providers reject an empty tool_calls "
                                   "list; request views drop the key", problem=False))
            for call in open_calls.values():
                call.separated = True
    for key, call in open_calls.items():
        pending = writer_active and not call.separated
        detail = ("no result yet: a writer has the session open, the tool may still be running" if pending else
                  "no result answers it (a crash or kill during the tool?); request views add a placeholder, "
                  "`context-persistent repair --semantic` records one")
        out.append(Finding("unanswered_call", call.seq, call.index, key.removeprefix("function:"), call.name,
                           detail, problem=not pending))
    out.sort(key=lambda f: (f.index, f.kind))
    return out


def placeholders(messages: list[dict[str, Any]], unanswered: list[Finding]) -> list[dict[str, Any]]:
    """Placeholder result messages for unanswered calls, in the form each call was made in."""
    by_message: dict[int, list[Finding]] = {}
    for f in unanswered:
        by_message.setdefault(f.index, []).append(f)
    out: list[dict[str, Any]] = []
    for index, found in sorted(by_message.items()):
        fmts = {key: (name, fmt) for key, name, fmt in tool_calls_of(messages[index])}
        blocks: list[dict[str, Any]] = []
        for f in found:
            key = f.call_id if f.call_id in fmts else f"function:{f.call_id}"
            name, fmt = fmts.get(key, (f.tool or "?", "openai"))
            text = placeholder_text(name, f.call_id)
            if fmt == "openai":
                out.append({"role": "tool", "tool_call_id": f.call_id, "content": text})
            elif fmt == "function":
                out.append({"role": "function", "name": name, "content": text})
            elif fmt == "tool_call":
                blocks.append({"type": "tool_result", "tool_call_id": f.call_id, "output": text})
            else:
                blocks.append({"type": "tool_result", "tool_use_id": f.call_id, "content": text, "is_error": True})
        if blocks:
            out.append({"role": "user", "content": blocks})
    marker = {"context_persistent": {"placeholder": True,
                                     "reason": "repair --semantic: the call had no result in the stored history"}}
    return [{**m, "metadata": marker} for m in out]


@dataclass
class SemanticRepair:
    """What ``repair_semantic`` did: placeholders added, orphan messages redacted, and what it left."""

    session_id: str
    placeholders: list[dict[str, Any]] = field(default_factory=list)
    redacted: list[dict[str, Any]] = field(default_factory=list)
    left: list[Finding] = field(default_factory=list)
    audit_seq: int | None = None

    @property
    def changed(self) -> bool:
        return bool(self.placeholders or self.redacted)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed": self.changed}


def _answered_ids(m: dict[str, Any]) -> list[str]:
    keys, _ = _result_keys(m)
    return [k.removeprefix("function:") for k in keys]
