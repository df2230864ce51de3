// One session: its facts, the token chart, time travel, and one of five panes: the timeline of events, the
// full, conversation or reasoning view, or the request view next to the full history.
import { api, clear, el, errorBox, sessionHash, sessionPath, size } from "./dom.js";
import { tokenChart } from "./chart.js";
import { Pairing, eventRow, hideRedacted, messageRow, str } from "./render.js";

const MODES = ["timeline", "full", "conversation", "reasoning", "request"];
const PAGE = 200;

export function sessionPage(main, id, params, info) {
  // The page draws into a container of its own: what an earlier page's pending requests add after the
  // address changed goes into its detached container, never into this one.
  const root = main.appendChild(el("div", { class: "page" }));
  let alive = true;
  const ctx = { session: id };
  const mode = MODES.includes(params.get("view")) ? params.get("view") : "timeline";
  const num = (k) => (/^\d+$/.test(params.get(k) || "") ? Number(params.get(k)) : null);
  const at = num("at"), start = num("start"), budget = num("budget"), from = num("from");
  const base = { view: mode === "timeline" ? null : mode, at, budget: mode === "request" ? budget : null };
  const go = (changes) => { location.hash = sessionHash(id, { ...base, ...changes }); };
  const closers = [];
  (async () => {
    let s;
    try { s = await api(sessionPath(id)); } catch (e) { root.append(el("h1", {}, id), errorBox(e.message)); return; }
    if (at !== null && (at < 1 || at > s.head_seq)) { root.append(errorBox(`seq ${at} is outside 1..${s.head_seq}`)); return; }
    root.append(header(s, mode, at, budget), controls(s, mode, at, budget, go));
    const chartBox = el("div", { id: "chart", class: "chart-box" }, el("p", { class: "muted" }, "counting tokens…"));
    const pane = el("div", { id: "pane", "data-mode": mode });
    root.append(chartBox, pane);
    loadChart(chartBox, id, at, budget, go);
    try {
      let closer = null;
      if (mode === "timeline") closer = await timeline(pane, ctx, s, at, from, go);
      else if (mode === "request") await requestPane(pane, ctx, at, budget, start, go);
      else closer = await viewPane(pane, ctx, s, mode, at, start, go);
      if (closer && !alive) closer(); else closers.push(closer);
    } catch (e) { pane.append(errorBox(e.message)); }
  })();
  return () => { alive = false; for (const c of closers) if (c) c(); };
}

function header(s, mode, at, budget) {
  const exportView = mode === "timeline" ? "full" : mode;
  const link = (fmt, label) => {
    const q = new URLSearchParams({ format: fmt, view: exportView });
    if (at) q.set("at", at);
    if (mode === "request" && budget) q.set("budget", budget);
    return el("a", { href: `${sessionPath(s.session_id)}/export?${q}`, download: "", class: "export" }, label);
  };
  const facts = [`${s.messages} messages`, `${s.head_seq} events`, size(s.bytes), `${s.pinned} pinned`, `tokenizer ${s.tokenizer}`];
  const kinds = Object.entries(s.events).filter(([k]) => k !== "message_added").map(([k, v]) => `${k} ${v}`).join(", ");
  return el("section", { class: "facts" },
    el("h1", {}, el("a", { href: "#/", class: "muted" }, "sessions / "), s.session_id),
    el("div", {}, facts.join(" · ")),
    kinds ? el("div", { class: "muted" }, `events: ${kinds}`) : null,
    s.parent ? el("div", {}, "forked from ", el("a", { href: sessionHash(String(s.parent.session_id), { at: s.parent.seq }), id: "parent" }, `${str(s.parent.session_id)} at seq ${s.parent.seq}`)) : null,
    s.forks.length ? el("div", { id: "forks" }, "forks: ", s.forks.map((f, i) => [i ? ", " : "", el("a", { href: sessionHash(f.session_id) }, `${f.session_id} (from seq ${f.seq})`)])) : null,
    s.imported ? el("div", { class: "muted" }, `imported from ${str(s.imported.source)} ${str(s.imported.path ?? "")}`) : null,
    el("div", { class: "exports" }, `export ${exportView}${at ? ` as of seq ${at}` : ""}: `, link("jsonl", "JSONL"), " ", link("json", "JSON"), " ", link("markdown", "Markdown")));
}

function controls(s, mode, at, budget, go) {
  const tabs = el("nav", { class: "tabs", "aria-label": "views" }, MODES.map((m) =>
    el("a", { href: sessionHash(s.session_id, { view: m === "timeline" ? null : m, at, budget: m === "request" ? budget : null }), class: m === mode ? "tab active" : "tab", "data-view": m }, m === "request" ? "request vs history" : m)));
  const travel = el("input", { type: "range", id: "travel", min: 1, max: Math.max(1, s.head_seq), value: at ?? s.head_seq, "aria-label": "time travel: the session as of seq" });
  const shown = el("output", { id: "travel-seq" }, at ? `as of seq ${at} of ${s.head_seq}` : `now (seq ${s.head_seq})`);
  travel.addEventListener("input", () => { shown.textContent = `as of seq ${travel.value} of ${s.head_seq}`; });
  travel.addEventListener("change", () => go({ at: Number(travel.value) === s.head_seq ? null : Number(travel.value), start: null, from: null }));
  const live = el("span", { id: "live", class: at ? "muted" : "live" }, at ? "time travel (live follow off)" : "");
  const bar = el("div", { class: "toolbar" }, tabs, el("label", { class: "travel" }, "time travel ", travel), shown,
    at ? el("a", { href: sessionHash(s.session_id, { view: mode === "timeline" ? null : mode, budget: mode === "request" ? budget : null }), id: "now" }, "back to now") : null, live);
  if (mode === "request") {
    const input = el("input", { type: "number", min: 1, id: "budget", value: budget ?? "", placeholder: String(s.budget), "aria-label": "token budget" });
    bar.append(el("form", { class: "budget", onsubmit: (e) => { e.preventDefault(); go({ budget: input.value || null, start: null }); } }, "budget ", input, el("button", { type: "submit" }, "apply")));
  }
  return bar;
}

async function loadChart(box, id, at, budget, go, count) {
  try {
    const data = await api(`${sessionPath(id)}/tokens`, { at, budget, count: count ? 1 : null });
    clear(box);
    box.append(tokenChart(data, (seq) => go({ at: seq, start: null, from: null })));
    const legend = el("div", { class: "legend" },
      el("span", { class: "key bar-key" }, "tokens per message" + (data.per_point > 1 ? ` (summed over ${data.per_point})` : "")), " ",
      el("span", { class: "key cum-key" }, `cumulative (${data.total} tokens, ${data.tokenizer})`), " ",
      el("span", { class: "key budget-key" }, `budget ${data.budget} (${data.budget_source})`), " ",
      el("span", { class: "key compaction-key" }, `${data.compactions.length} compaction(s)`),
      data.usage && data.usage.length ? el("span", { class: "key usage-key", id: "usage-key" }, `reported by the provider: ${data.usage.length} request(s) (dots; ticks: the store's estimate)`) : null);
    box.append(legend);
    if (data.uncounted) box.append(el("div", { class: "muted" }, `${data.uncounted} messages not counted yet `, el("button", { onclick: () => loadChart(box, id, at, budget, go, true) }, "count them")));
  } catch (e) { clear(box).append(errorBox(e.message)); }
}

function follow(id, after, onRecord, status) {
  const source = new EventSource(`${sessionPath(id)}/follow?after=${after}`);
  status.textContent = "● live";
  source.onmessage = (e) => onRecord(JSON.parse(e.data));
  source.addEventListener("failed", (e) => { status.textContent = `live follow stopped: ${JSON.parse(e.data).error}`; source.close(); });
  source.onerror = () => { status.textContent = "○ reconnecting…"; };
  source.onopen = () => { status.textContent = "● live"; };
  return () => source.close();
}

async function timeline(pane, ctx, s, at, from, go) {
  const list = el("div", { id: "timeline", class: "list" });
  const pairing = new Pairing();
  const add = (rec, where) => {
    const { row, entry } = eventRow(rec, ctx, pairing, (key) => hideRedacted(list, key));
    if (entry && pairing.place(entry, row)) return;
    if (where === "top") list.prepend(row); else list.append(row);
  };
  const page = await api(`${sessionPath(ctx.session)}/timeline`, { limit: PAGE, at, after: from !== null ? Math.max(0, from - 1) : null });
  const records = page.records;
  let first = records.length ? records[0].seq : 1, last = records.length ? records[records.length - 1].seq : 0;
  const jump = el("input", { type: "number", min: 1, placeholder: "seq", "aria-label": "go to seq" });
  const earlier = el("button", { id: "earlier", onclick: async () => {
    const after = Math.max(0, first - 1 - PAGE);
    const more = (await api(`${sessionPath(ctx.session)}/timeline`, { after, limit: Math.max(1, first - 1 - after) })).records;
    for (const r of more.reverse()) add(r, "top");
    if (more.length) first = more[more.length - 1].seq;
    earlier.disabled = first <= 1;
  } }, "load earlier events");
  earlier.disabled = first <= 1;
  pane.append(el("div", { class: "toolbar" }, earlier,
    el("form", { onsubmit: (e) => { e.preventDefault(); if (jump.value) go({ from: jump.value, at: null }); } }, "go to seq ", jump)), list);
  for (const r of records) add(r, "end");
  const status = document.getElementById("live");
  if (at !== null) return null;
  if (from !== null && last < page.head_seq) {
    pane.append(el("a", { href: sessionHash(ctx.session, {}), class: "tab" }, "go to the end (live)"));
    status.textContent = `showing seqs from ${from}; live follow off`;
    return null;
  }
  return follow(ctx.session, last, (rec) => { add(rec, "end"); last = rec.seq; const t = document.getElementById("travel"); if (t) t.max = rec.seq; }, status);
}

function pager(total, startAt, count, go) {
  const nav = el("div", { class: "pager" }, `messages ${startAt}–${Math.max(startAt, startAt + count - 1)} of ${total} `);
  const link = (label, start, enabled) => nav.append(enabled ? el("a", { href: "#/", class: "tab", onclick: (e) => { e.preventDefault(); go({ start }); } }, label) : el("span", { class: "tab disabled" }, label));
  link("first", 0, startAt > 0);
  link("earlier", Math.max(0, startAt - PAGE), startAt > 0);
  link("later", startAt + PAGE, startAt + count < total);
  link("last", null, startAt + count < total);
  return nav;
}

async function viewPane(pane, ctx, s, mode, at, start, go) {
  const page = await api(`${sessionPath(ctx.session)}/messages`, { view: mode, start, limit: PAGE, at });
  const list = el("div", { id: "messages", class: "list" });
  const pairing = mode === "conversation" ? null : new Pairing();
  for (const item of page.items) {
    const row = messageRow(item, ctx, pairing, { index: item.index });
    if (!(pairing && pairing.place(item, row))) list.append(row);
  }
  const note = page.left_out ? el("p", { class: "muted" }, `${page.left_out} message(s) of this page are not in the ${mode} view`) : null;
  pane.append(...[pager(page.total, page.start, page.end - page.start, go), note, list].filter(Boolean));
  const atEnd = page.end >= page.total;
  if (at !== null || !atEnd) return null;
  let timer = null;
  return follow(ctx.session, page.head_seq, () => {
    clearTimeout(timer); // a burst of events reloads the page once
    timer = setTimeout(() => { window.dispatchEvent(new HashChangeEvent("hashchange")); }, 500);
  }, document.getElementById("live"));
}

const KIND_TEXT = { kept: "in the request", note: "note (not a message of the history)", summary: "summary of left-out messages", masked: "masked copy", truncated: "truncated copy", placeholder: "placeholder result (repair)", changed: "changed copy" };

async function requestPane(pane, ctx, at, budget, start, go) {
  const req = await api(`${sessionPath(ctx.session)}/request`, { budget, at });
  const kept = new Map(req.messages.filter((m) => m.source !== null).map((m) => [m.source, m]));
  let firstOut = 0;
  while (firstOut < req.history_messages && kept.has(firstOut) && kept.get(firstOut).kind === "kept") firstOut++;
  const from = start ?? (firstOut < req.history_messages ? Math.max(0, firstOut - 3) : Math.max(0, req.history_messages - PAGE));
  const hist = await api(`${sessionPath(ctx.session)}/messages`, { view: "full", start: from, limit: PAGE, at });
  const st = req.stats || {};
  const left = el("div", { class: "column", id: "history" }, el("h2", {}, "full history"), pager(hist.total, hist.start, hist.end - hist.start, go));
  const leftOut = req.history_messages - req.kept.length - Object.keys(req.changed).length;
  for (const item of hist.items) {
    const used = kept.get(item.index);
    const status = used ? used.kind : req.summarised ? "summarised" : "dropped";
    const label = used ? (used.kind === "kept" ? `in the request (#${used.pos})` : `${KIND_TEXT[used.kind] || used.kind} in the request (#${used.pos})`) : req.summarised ? "left out (summarised)" : "left out (dropped)";
    const row = messageRow(item, ctx, null, { index: item.index, badges: [el("span", { class: `badge status-${status}` }, label)] });
    row.classList.add(status === "kept" ? "kept" : status === "summarised" || status === "dropped" ? "dropped" : "changed");
    left.append(row);
  }
  const right = el("div", { class: "column", id: "request" }, el("h2", {}, "request view"));
  for (const m of req.messages) {
    const row = messageRow(m, ctx, null, { index: undefined, badges: [el("span", { class: `badge status-${m.kind}` }, m.source !== null ? `${KIND_TEXT[m.kind]} · from #${m.source}` : KIND_TEXT[m.kind] || m.kind)] });
    row.classList.add(`kind-${m.kind}`);
    right.append(row);
  }
  const facts = [`${req.messages.length} messages, ${req.tokens} tokens at a ${req.budget}-token budget (${req.budget_source})`,
    `history: ${req.history_messages} messages; ${req.kept.length} kept, ${Object.keys(req.changed).length} changed, ${leftOut} left out`];
  if (st.strategy_used) facts.push(`compaction: ${st.strategy_used}, ${st.before_tokens} → ${st.after_tokens} tokens; ${st.outputs_masked ?? 0} masked, ${st.groups_dropped ?? 0} groups dropped, ${st.truncated ?? 0} truncated${st.summarized ? ", summarised" : ""}`);
  if (req.window) facts.push(`windowed rebuild: read from #${req.window.start} (${req.window.omitted} older messages not read)`);
  if (st.warning) facts.push(`warning: ${str(st.warning)}`);
  pane.append(el("div", { class: "request-facts" }, facts.map((f) => el("div", {}, f))), el("div", { class: "columns" }, left, right));
}
