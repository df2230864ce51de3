// Rendering messages and events as DOM (text nodes only), and pairing tool calls with their results.
import { api, el, sessionHash, sessionPath, shortTime } from "./dom.js";

// A clipped string from the API: {"$clipped": head, "more": n}.
function isClipped(v) {
  return v && typeof v === "object" && !Array.isArray(v) && "$clipped" in v;
}

export function str(v) {
  if (isClipped(v)) return `${v.$clipped}… (${v.more} more characters)`;
  if (typeof v === "string") return v;
  return JSON.stringify(v);
}

function jsonBlock(value) {
  return el("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

function textBlock(v, ctx) {
  const node = el("div", { class: "text" }, isClipped(v) ? v.$clipped : String(v ?? ""));
  if (isClipped(v)) {
    node.append(el("span", { class: "clipped" }, ` … ${v.more} more characters `));
    if (ctx && ctx.seq) node.append(el("button", { class: "link", onclick: () => showRecord(ctx, node) }, "show the whole record"));
  }
  return node;
}

async function showRecord(ctx, node) {
  try {
    const rec = await api(`${sessionPath(ctx.session)}/record/${ctx.seq}`);
    node.replaceWith(jsonBlock(rec));
  } catch (e) {
    node.append(el("span", { class: "error" }, ` ${e.message}`));
  }
}

function callLine(name, args, id) {
  const a = typeof args === "string" || isClipped(args) ? str(args) : JSON.stringify(args);
  return el("div", { class: "call" }, el("span", { class: "arrow" }, "→ "), el("b", {}, String(str(name ?? "?"))),
    `(${a})`, id ? el("span", { class: "muted" }, `  [${str(id)}]`) : null);
}

// One message: its text, blocks, tool calls and results, each as text.
export function renderContent(m, ctx) {
  const out = el("div", { class: "content" });
  if (!m || typeof m !== "object") { out.append(jsonBlock(m)); return out; }
  const shownCalls = new Set();
  const c = m.content;
  if (typeof c === "string" || isClipped(c)) out.append(textBlock(c, ctx));
  else if (Array.isArray(c)) {
    for (const b of c) {
      if (!b || typeof b !== "object") { out.append(textBlock(str(b), ctx)); continue; }
      const t = b.type;
      if (t === "text") out.append(textBlock(b.text, ctx));
      else if (t === "tool_use" || t === "tool_call") { shownCalls.add(str(b.id)); out.append(callLine(b.name, b.input ?? b.arguments, b.id)); }
      else if (t === "tool_result") {
        const inner = b.content ?? b.output;
        out.append(el("div", { class: "result" }, el("span", { class: "arrow" }, "← "),
          el("span", { class: "muted" }, `[${str(b.tool_use_id ?? b.tool_call_id)}] `),
          Array.isArray(inner) ? inner.map((x) => textBlock(x && typeof x === "object" ? (x.text ?? JSON.stringify(x)) : x, ctx)) : textBlock(typeof inner === "object" && !isClipped(inner) ? JSON.stringify(inner) : inner, ctx)));
      } else if (t === "thinking" || t === "redacted_thinking") out.append(el("details", { class: "thinking" }, el("summary", {}, "thinking"), textBlock(b.thinking ?? "(redacted thinking)", ctx)));
      else out.append(el("details", {}, el("summary", {}, `[${str(t)} block]`), jsonBlock(b)));
    }
  } else if (c !== undefined && c !== null) out.append(jsonBlock(c));
  for (const call of Array.isArray(m.tool_calls) ? m.tool_calls : []) {
    if (!call || typeof call !== "object" || shownCalls.has(str(call.id))) continue;
    const fn = call.function;
    if (fn && typeof fn === "object") out.append(callLine(fn.name, fn.arguments, call.id));
    else out.append(callLine(call.tool ?? call.name, call.arguments ?? call.input, call.id));
  }
  if (m.function_call && typeof m.function_call === "object") out.append(callLine(m.function_call.name, m.function_call.arguments, null));
  const extra = Object.keys(m).filter((k) => !["role", "content", "tool_calls", "tool_call_id", "name", "function_call"].includes(k));
  if (extra.length) {
    const rest = {};
    for (const k of extra) rest[k] = m[k];
    out.append(el("details", { class: "extra" }, el("summary", {}, extra.join(", ")), jsonBlock(rest)));
  }
  return out;
}

export function roleBadge(role) {
  const r = String(str(role ?? "?"));
  return el("span", { class: `role role-${/^[a-z]+$/.test(r) ? r : "other"}` }, r);
}

// Pairs tool calls with their results inside one list: a result whose calls are all on the list goes into
// the fold under its call; otherwise it stays where it is, saying which call it answers.
export class Pairing {
  constructor() { this.slots = new Map(); }

  callFolds(entry) {
    const folds = [];
    for (const id of entry.calls || []) {
      const fold = el("details", { class: "fold", "data-call": id }, el("summary", {}, `result of ${id}: `, el("span", { class: "pending muted" }, "none yet")));
      this.slots.set(id, fold);
      folds.push(fold);
    }
    return folds;
  }

  // Returns true when the row was put into a call's fold.
  place(entry, row) {
    const ids = entry.answers || [];
    if (!ids.length || !ids.every((id) => this.slots.has(id))) return false;
    const fold = this.slots.get(ids[0]);
    for (const id of ids) {
      const f = this.slots.get(id);
      const pending = f.querySelector(".pending");
      if (pending) pending.textContent = "folded below";
      f.classList.add("answered");
    }
    fold.append(row);
    return true;
  }
}

// A message row: position/seq, role, tokens, pins, then the content and the folds for its calls.
export function messageRow(entry, ctx, pairing, opts = {}) {
  const m = entry.message;
  const head = el("div", { class: "head" },
    opts.index !== undefined ? el("span", { class: "idx", title: "position in the history" }, `#${opts.index}`) : null,
    entry.seq !== undefined && entry.seq !== null ? el("span", { class: "seq", title: "seq of the event that added it" }, `seq ${entry.seq}`) : null,
    roleBadge(m && m.role), m && m.name ? el("span", { class: "muted" }, ` ${str(m.name)}`) : null,
    entry.pinned ? el("span", { class: "badge pin" }, "pinned") : null,
    entry.tokens !== undefined && entry.tokens !== null ? el("span", { class: "tokens" }, `${entry.tokens} tok`) : null,
    (entry.answers || []).length ? el("span", { class: "muted" }, ` answers ${entry.answers.join(", ")}`) : null,
    ...(opts.badges || []));
  const row = el("div", { class: "msg", id: entry.key !== undefined ? `k-${entry.key}` : null, "data-key": entry.key }, head);
  if (entry.redacted) row.append(el("div", { class: "redacted" }, "[redacted: a redaction hides this message from every view]"));
  else if (entry.erased) row.append(el("div", { class: "redacted" }, "[erased: the message is gone from the log]"));
  else row.append(renderContent(m, { ...ctx, seq: entry.seq }));
  if (pairing) for (const f of pairing.callFolds(entry)) row.append(f);
  return row;
}

function kv(data, keys) {
  return keys.filter((k) => data && data[k] !== undefined && data[k] !== null).map((k) => `${k} ${typeof data[k] === "object" ? JSON.stringify(data[k]) : data[k]}`).join(" · ");
}

// One line saying what a non-message event did.
export function eventSummary(rec) {
  const d = rec.data || {};
  switch (rec.type) {
    case "session_started":
      return `session started: ${str(d.program ?? "")} format ${d.format}, tokenizer ${str(d.tokenizer ?? "")}`;
    case "pinned": case "unpinned": case "redacted":
      return `${rec.type} the message of seq ${d.seq} (index ${d.index})`;
    case "compacted":
      return `compaction: ${str(d.strategy_used ?? d.strategy ?? "")} ${d.before_tokens} → ${d.after_tokens} tokens at a ${d.budget}-token budget; ` +
        kv(d, ["outputs_masked", "groups_dropped", "truncated", "summarized", "budget_source"]);
    case "messages_replaced":
      return `history replaced: ${(rec.messages || []).length} messages${d.reason ? "; reason: " + str(d.reason) : ""}`;
    case "system_prompt_set":
      return `system prompt changed (${str(d.source ?? "")}): ${(rec.messages || []).length} message(s)`;
    case "cleared": return "history cleared";
    case "replay_recognised":
      return Array.isArray(d.keys) ? `${d.keys.length} replayed messages folded out of the views` : `${d.count} replayed messages (audit only)`;
    case "transcript_ignored": return `set_messages of ${d.count} messages ignored (${str(d.kind ?? "")}): ${str(d.reason ?? "")}`;
    case "erased": return `erasure tombstone of a ${str(d.of ?? "")} record${d.reason ? "; reason: " + str(d.reason) : ""}`;
    case "expired": return `retention: older records expired (${kv(d, ["first_seq", "last_seq", "rule"])})`;
    case "log_repaired": return `log repaired: ${kv(d, ["gaps", "reason", "quarantined"])}`;
    case "semantic_repaired": return `semantic repair: ${kv(d, ["placeholders", "redacted", "reason"])}`;
    default: return `${rec.type}`;
  }
}

export function eventRow(rec, ctx, pairing, onRedacted) {
  if (rec.type === "message_added" && rec.messages && rec.messages.length) {
    const entry = { ...rec.messages[0], seq: rec.seq };
    const row = messageRow(entry, ctx, pairing);
    row.querySelector(".head").append(el("span", { class: "ts" }, shortTime(rec.ts)));
    return { row, entry };
  }
  const row = el("div", { class: `event ev-${/^[a-z_]+$/.test(rec.type) ? rec.type : "other"}`, id: `e-${rec.seq}` },
    el("div", { class: "head" }, el("span", { class: "seq" }, `seq ${rec.seq}`), el("span", { class: "etype" }, String(rec.type)),
      el("span", { class: "ts" }, shortTime(rec.ts))),
    el("div", { class: "summary" }, eventSummary(rec)));
  const d = rec.data || {};
  if (["pinned", "unpinned", "redacted"].includes(rec.type) && Number.isInteger(d.key)) {
    row.querySelector(".summary").append(" ", el("a", { href: `#/`, onclick: (e) => { e.preventDefault(); const t = document.getElementById(`k-${d.key}`); if (t) t.scrollIntoView({ block: "center" }); } }, "go to it"));
    if (rec.type === "redacted" && onRedacted) onRedacted(d.key);
  }
  if (d.parent && d.parent.session_id) row.append(el("div", {}, "forked from ", el("a", { href: sessionHash(String(d.parent.session_id), { at: d.parent.seq }) }, `${str(d.parent.session_id)} at seq ${d.parent.seq}`)));
  if (rec.messages && rec.messages.length) {
    const fold = el("details", { class: "fold" }, el("summary", {}, `${rec.messages.length} message(s)`));
    for (const m of rec.messages) fold.append(messageRow({ ...m, seq: rec.seq }, ctx, pairing));
    row.append(fold);
  }
  row.append(el("details", { class: "extra" }, el("summary", {}, "data"), jsonBlock(d)));
  return { row, entry: null };
}

// Hide a message that a redaction arriving later names (live follow).
export function hideRedacted(root, key) {
  const row = root.querySelector(`[data-key="${Number(key)}"]`);
  if (!row) return;
  for (const child of [...row.children]) if (!child.classList.contains("head")) child.remove();
  row.append(el("div", { class: "redacted" }, "[redacted: a redaction hides this message from every view]"));
}
