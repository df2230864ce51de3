// The viewer's page: a hash router over two pages, the sessions and one session.
import { api, clear, el, errorBox, sessionHash, shortTime, size } from "./dom.js";
import { sessionPage } from "./session.js";

const main = document.getElementById("main");
let info = { features: {} };
let leave = null; // the current page's clean-up (closes a live follow)

function route() {
  if (leave) { leave(); leave = null; }
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/s\/([^?]+)(?:\?(.*))?$/);
  clear(main);
  if (m) {
    let id;
    try { id = decodeURIComponent(m[1]); } catch { main.append(errorBox("bad session address")); return; }
    leave = sessionPage(main, id, new URLSearchParams(m[2] || ""), info);
  } else sessionsPage(main);
}

const COLUMNS = [
  ["session_id", "session", (r) => el("a", { href: sessionHash(r.session_id) }, r.session_id)],
  ["messages", "messages", (r) => r.messages ?? "-", true],
  ["events", "events", (r) => r.events ?? "-", true],
  ["bytes", "size", (r) => size(r.bytes), true],
  ["created", "created", (r) => shortTime(r.created)],
  ["last_activity", "last activity", (r) => shortTime(r.last_activity)],
  ["parent", "forked from", (r) => r.parent ? el("a", { href: sessionHash(String(r.parent.session_id), { at: r.parent.seq }) }, `${r.parent.session_id} @ ${r.parent.seq}`) : ""],
];

async function sessionsPage(main) {
  const root = main.appendChild(el("div", { class: "page" }));
  const state = { sort: "last_activity", desc: true, filter: "" };
  const filter = el("input", { type: "search", placeholder: "filter sessions by id", id: "filter", "aria-label": "filter sessions" });
  const table = el("table", { class: "sessions", id: "sessions" });
  const count = el("span", { class: "muted" });
  const search = info.features.search ? searchBox() : null;
  root.append(...[el("h1", {}, "Sessions"), el("div", { class: "toolbar" }, filter, count), search, table].filter(Boolean));
  let rows = [];
  try {
    rows = (await api("/api/sessions")).sessions;
  } catch (e) { root.append(errorBox(e.message)); return; }
  const draw = () => {
    clear(table);
    const head = el("tr", {});
    for (const [key, label, , num] of COLUMNS) {
      const mark = state.sort === key ? (state.desc ? " ▼" : " ▲") : "";
      head.append(el("th", { class: num ? "num" : "", "data-sort": key, onclick: () => { state.desc = state.sort === key ? !state.desc : key !== "session_id"; state.sort = key; draw(); } }, label + mark));
    }
    table.append(el("thead", {}, head));
    const body = el("tbody", {});
    const shown = rows.filter((r) => r.session_id.toLowerCase().includes(state.filter.toLowerCase()));
    const val = (r) => { const v = r[state.sort]; return v && typeof v === "object" ? v.session_id : v; };
    shown.sort((a, b) => { const x = val(a), y = val(b); const c = x === y ? 0 : x === undefined || x === null ? -1 : y === undefined || y === null ? 1 : x < y ? -1 : 1; return state.desc ? -c : c; });
    for (const r of shown) {
      const tr = el("tr", {});
      if (r.error) tr.append(el("td", {}, el("a", { href: sessionHash(r.session_id) }, r.session_id)), el("td", { colspan: COLUMNS.length - 1, class: "error" }, r.error));
      else for (const [, , cell, num] of COLUMNS) tr.append(el("td", { class: num ? "num" : "" }, cell(r)));
      body.append(tr);
    }
    table.append(body);
    count.textContent = ` ${shown.length} of ${rows.length} session(s)`;
  };
  filter.addEventListener("input", () => { state.filter = filter.value; draw(); });
  draw();
}

// Shown only when the viewer was given a search provider (the search projection).
function searchBox() {
  const input = el("input", { type: "search", placeholder: "search the sessions", "aria-label": "search" });
  const hits = el("ul", { class: "hits" });
  const form = el("form", { class: "search", onsubmit: async (e) => {
    e.preventDefault();
    clear(hits);
    try {
      for (const h of (await api("/api/search", { q: input.value })).hits) {
        hits.append(el("li", {}, el("a", { href: sessionHash(String(h.session_id), { at: h.seq }) }, `${h.session_id} @ ${h.seq}`), " ", typeof h.snippet === "string" ? h.snippet : ""));
      }
    } catch (err) { hits.append(el("li", { class: "error" }, err.message)); }
  } }, input, el("button", { type: "submit" }, "search"));
  return el("div", {}, form, hits);
}

async function start() {
  try {
    info = await api("/api/info");
    document.getElementById("source").textContent = info.source;
  } catch (e) { main.append(errorBox(e.message)); }
  window.addEventListener("hashchange", route);
  route();
}

start();
