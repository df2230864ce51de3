"""opencode sessions: its SQLite database (``~/.local/share/opencode/opencode.db``), every session in it.

The schema is opencode's ``packages/opencode/src/session/session.sql.ts``: ``session`` (``id``, ``parent_id``,
``title``, ``directory``, ``version``, ``revert``, ...), ``message`` (``id``, ``session_id``, ``time_created``,
``data``: the message JSON without its ids) and ``part`` (``id``, ``message_id``, ``session_id``, ``data``: the
part JSON). Messages are read in opencode's order (``time_created``, ``id``) and each message's parts by ``id``,
as opencode itself hydrates them (``message-v2.ts``). A user message's ``text`` and ``file`` parts become one
``user`` message; an assistant message's ``text`` parts its content, ``reasoning`` parts ``reasoning_content``,
and each ``tool`` part (one part holds the call and its state) a ``tool_calls`` entry with its ``input``, followed
by a ``tool`` message with the state's ``output`` (``completed``) or ``error`` (``error``, ``is_error``); a
``pending``/``running`` call has no result (counted as unanswered). Text after a tool part starts the next
assistant message, so every result sits between its call and what the model said next. ``step-start``,
``step-finish`` (their tokens are in the message's ``opencode.tokens``), ``snapshot``, ``patch``, ``agent`` and
``retry`` parts are counted, not imported; messages a session's ``revert`` undid are counted as ``reverted``.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...errors import MalformedInputError
from .common import Parsed, tool_call

FORMAT = "opencode"
#: Parts that carry no conversation (opencode's bookkeeping of steps, file snapshots, retries).
_BOOKKEEPING = ("step-start", "step-finish", "snapshot", "patch", "agent", "retry")
_INFO_KEYS = ("providerID", "modelID", "agent", "mode", "tokens", "cost", "finish", "error", "summary", "variant")


def _stamp(ms: Any) -> str | None:
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat().replace("+00:00", "Z")
    return None


def _json(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            raise MalformedInputError(where, None, "its data is not UTF-8") from None
    if not isinstance(raw, str):
        raise MalformedInputError(where, None, f"its data must be JSON text, it is {type(raw).__name__}")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise MalformedInputError(where, None, f"its data is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise MalformedInputError(where, None, f"its data is a JSON {type(obj).__name__}, not an object")
    return obj


class _Session:
    """Builds one session's messages from its message rows and their parts."""

    def __init__(self, p: Parsed, name: str) -> None:
        self.p = p
        self.name = name

    def where(self, table: str, row_id: str) -> str:
        return f"{self.name}: table {table}, row {row_id}"

    def user(self, mid: str, parts: list[tuple[str, dict[str, Any]]], stamp: str | None) -> None:
        blocks: list[dict[str, Any]] = []
        used = []
        for pid, part in parts:
            kind = part.get("type")
            if kind == "text":
                if part.get("ignored"):
                    self.p.ignore("ignored_text")
                    continue
                blocks.append({"type": "text", "text": self.text(part, pid)})
            elif kind == "file":
                blocks.append({"type": "file", **{k: part[k] for k in ("mime", "filename", "url") if k in part}})
            elif kind == "compaction":  # (what opencode sends the model for it)
                blocks.append({"type": "text", "text": "What did we do so far?"})
            elif kind == "subtask":
                blocks.append({"type": "text", "text": "The following tool was executed by the user"})
            else:
                self.p.ignore(f"part:{kind}")
                continue
            used.append(pid)
        if not blocks:
            self.p.ignore("empty_message")
            return
        only_text = all(b["type"] == "text" for b in blocks)
        content: Any = "\n".join(b["text"] for b in blocks) if only_text else blocks
        self.p.add({"role": "user", "content": content, "imported": {"table": "message", "id": mid,
                                                                     "parts": used}}, 0, stamp)

    def text(self, part: dict[str, Any], pid: str) -> str:
        text = part.get("text")
        if not isinstance(text, str):
            raise MalformedInputError(self.where("part", pid), None,
                                      f"a {part.get('type')} part: 'text' must be a string")
        return text

    def assistant(self, mid: str, info: dict[str, Any], parts: list[tuple[str, dict[str, Any]]],
                  stamp: str | None) -> None:
        meta = {k: info[k] for k in _INFO_KEYS if k in info}
        current: dict[str, Any] | None = None
        results: list[dict[str, Any]] = []
        made = 0

        def flush() -> None:
            nonlocal current, results, made
            if current is not None:
                self.p.add(current, 0, stamp)
                made += 1
                for r in results:
                    self.p.add(r, 0, stamp)
            current, results = None, []

        def target() -> dict[str, Any]:
            nonlocal current
            if current is None:
                current = {"role": "assistant", "content": None,
                           "imported": {"table": "message", "id": mid, "parts": []}}
                if meta and not made:  # (the message's tokens and cost: on its first part only, counted once)
                    current["opencode"] = meta
            return current

        for pid, part in parts:
            kind = part.get("type")
            if kind in ("text", "reasoning"):
                if results or (current is not None and current.get("tool_calls")):
                    flush()  # (the model spoke after its tool calls: their results go first)
                m = target()
                if kind == "text":
                    m["content"] = (m["content"] + "\n" if m["content"] else "") + self.text(part, pid)
                else:
                    m["reasoning_content"] = m.get("reasoning_content", "") + self.text(part, pid)
                m["imported"]["parts"].append(pid)
            elif kind == "tool":
                self.tool(pid, part, target(), results)
            elif kind == "file":
                m = target()
                m.setdefault("blocks", []).append({k: part[k] for k in ("type", "mime", "filename", "url")
                                                   if k in part})
                m["imported"]["parts"].append(pid)
            elif kind in _BOOKKEEPING:
                self.p.ignore(kind)
            else:
                self.p.ignore(f"part:{kind}")
        flush()
        if not made:
            self.p.ignore("empty_message")  # (an aborted or failed turn that produced nothing)

    def tool(self, pid: str, part: dict[str, Any], m: dict[str, Any], results: list[dict[str, Any]]) -> None:
        state = part.get("state")
        call_id, name = part.get("callID"), part.get("tool")
        if not isinstance(state, dict) or not isinstance(call_id, str) or not isinstance(name, str):
            raise MalformedInputError(self.where("part", pid), None,
                                      "a tool part needs 'callID' and 'tool' (strings) and 'state' (an object)")
        status = state.get("status")
        if status not in ("pending", "running", "completed", "error"):
            raise MalformedInputError(self.where("part", pid), None, f"a tool part's state has status {status!r}; "
                                      "known: pending, running, completed, error")
        m.setdefault("tool_calls", []).append(tool_call(call_id, name, state.get("input", {})))
        m["imported"]["parts"].append(pid)
        where = {"table": "part", "id": pid, "status": status}
        if status == "completed":
            out = state.get("output")
            result = {"role": "tool", "tool_call_id": call_id, "name": name,
                      "content": out if isinstance(out, str) else json.dumps(out, ensure_ascii=False),
                      "imported": {**where, **({"title": state["title"]} if "title" in state else {})}}
            results.append(result)
        elif status == "error":
            results.append({"role": "tool", "tool_call_id": call_id, "name": name, "is_error": True,
                            "content": str(state.get("error", "")), "imported": where})


def _rows(db: sqlite3.Connection, name: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.DatabaseError as e:
        raise MalformedInputError(name, None, f"is not an opencode database this importer can read ({e}); it "
                                  "needs opencode's session, message and part tables") from None


def parse_database(path: Path) -> list[Parsed]:
    """Every session of one opencode database, parents before their sub-agent sessions; MalformedInputError
    names the file, table and row of a damaged row."""
    name = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (give opencode's database, opencode.db)")
    if path.read_bytes()[:16] != b"SQLite format 3\x00":
        raise MalformedInputError(name, None, "is not a SQLite database (opencode keeps its sessions in "
                                  "~/.local/share/opencode/opencode.db)")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        sessions = _rows(db, name, "SELECT id, parent_id, title, directory, version, revert, time_created "
                                   "FROM session ORDER BY time_created, id")
        return [_parse_session(db, name, *row[:6]) for row in sessions]
    finally:
        db.close()


def _parse_session(db: sqlite3.Connection, name: str, sid: str, parent: Any, title: Any, directory: Any,
                   version: Any, revert_raw: Any) -> Parsed:
    p = Parsed(FORMAT, name, sid)
    p.meta = {k: v for k, v in (("title", title), ("directory", directory), ("version", version),
                                ("parent_session_id", parent)) if v is not None}
    s = _Session(p, name)
    revert = _json(revert_raw, s.where("session", sid)) if revert_raw is not None else {}
    reverted_from = revert.get("messageID") if isinstance(revert.get("messageID"), str) else None
    parts_of: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for pid, mid, data in _rows(db, name, "SELECT id, message_id, data FROM part WHERE session_id = ? "
                                          "ORDER BY message_id, id", (sid,)):
        parts_of.setdefault(mid, []).append((pid, _json(data, s.where("part", pid))))
    digest_rows = []
    reverted = False
    for mid, created, data in _rows(db, name, "SELECT id, time_created, data FROM message WHERE session_id = ? "
                                              "ORDER BY time_created, id", (sid,)):
        info = _json(data, s.where("message", mid))
        parts = parts_of.pop(mid, [])
        digest_rows.append([mid, data, [[pid, part] for pid, part in parts]])
        reverted = reverted or mid == reverted_from
        if reverted:
            p.ignore("reverted")
            continue
        role = info.get("role")
        stamp = _stamp((info.get("time") or {}).get("created") if isinstance(info.get("time"), dict) else None) \
            or _stamp(created)
        if role == "user":
            s.user(mid, parts, stamp)
        elif role == "assistant":
            s.assistant(mid, info, parts, stamp)
        else:
            raise MalformedInputError(s.where("message", mid), None,
                                      f"a message with role {role!r}; known: user, assistant")
    for orphans in parts_of.values():  # (parts whose message row is gone: counted, never dropped silently)
        for _ in orphans:
            p.ignore("part_without_message")
    p.digest_source = json.dumps(digest_rows, sort_keys=True, ensure_ascii=False).encode()
    return p
