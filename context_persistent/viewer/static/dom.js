// DOM helpers. Every piece of session content enters the document through text nodes (el's string
// children, textContent): never innerHTML, never an href built from content (docs/viewer.md).

// C0 controls (but tab and newline), DEL, C1 controls and the bidirectional overrides are shown as visible
// marks, so content cannot hide text, reorder it, or garble the page.
const CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g;

export function visible(text) {
  return String(text).replace(CONTROL, (c) => {
    const code = c.charCodeAt(0);
    if (code < 0x20) return String.fromCharCode(0x2400 + code);
    if (code === 0x7f) return "\u2421";
    return "\u27e8U+" + code.toString(16).toUpperCase().padStart(4, "0") + "\u27e9";
  });
}

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = visible(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "href") node.setAttribute("href", safeHref(v));
    else node.setAttribute(k, String(v));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(visible(c)));
  }
  return node;
}

// Links are only ever the viewer's own: a hash route or one of its API paths.
function safeHref(v) {
  const s = String(v);
  return s.startsWith("#/") || s.startsWith("/api/") ? s : "#/";
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

export async function api(path, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") query.set(k, v);
  const url = query.toString() ? `${path}?${query}` : path;
  const res = await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } });
  const body = await res.json().catch(() => ({ error: `HTTP ${res.status}` }));
  if (!res.ok) throw new Error(body.error || `HTTP ${res.status}`);
  return body;
}

export function sessionPath(id) {
  return `/api/sessions/${encodeURIComponent(id)}`;
}

export function sessionHash(id, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const tail = q.toString();
  return `#/s/${encodeURIComponent(id)}${tail ? "?" + tail : ""}`;
}

export function size(n) {
  if (n === null || n === undefined) return "-";
  let v = n;
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (v < 1024 || unit === "GiB") return unit === "B" ? `${v} B` : `${v.toFixed(1)} ${unit}`;
    v /= 1024;
  }
  return `${n} B`;
}

export function shortTime(ts) {
  return ts ? String(ts).slice(0, 19).replace("T", " ") + "Z" : "-";
}

export function errorBox(message) {
  return el("p", { class: "error", role: "alert" }, String(message));
}
