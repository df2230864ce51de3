// The token chart, drawn as SVG by hand (docs/viewer.md says why): a bar per message (per run of messages on
// a long session), the cumulative line, the budget line, compactions as vertical marks, and the time-travel
// position. Every label is a text node.
const NS = "http://www.w3.org/2000/svg";
const W = 1000, H = 200, L = 56, R = 64, T = 12, B = 26;

function s(tag, attrs, text) {
  const n = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
  if (text !== undefined) n.textContent = text;
  return n;
}

function fmt(n) {
  return n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e3 ? (n / 1e3).toFixed(1) + "k" : String(n);
}

// data: the /tokens answer; onPick(seq): a bar was clicked (time travel to it).
export function tokenChart(data, onPick) {
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": "tokens over the session" });
  const n = Math.max(1, data.messages);
  const pts = data.points;
  const maxBar = Math.max(1, ...pts.map((p) => p.tokens));
  const maxCum = Math.max(1, data.total, data.budget || 0);
  const x = (i) => L + (i / n) * (W - L - R);
  const yBar = (v) => H - B - (v / maxBar) * (H - B - T);
  const yCum = (v) => H - B - (v / maxCum) * (H - B - T);
  svg.append(s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  for (const p of pts) {
    const bar = s("rect", { x: x(p.start), y: yBar(p.tokens), width: Math.max(1, x(p.end) - x(p.start) - 0.5), height: H - B - yBar(p.tokens), class: p.uncounted ? "bar uncounted" : "bar" });
    const span = p.end - p.start > 1 ? `messages ${p.start}–${p.end - 1}` : `message ${p.start}`;
    bar.append(s("title", {}, `${span} (to seq ${p.seq}): ${p.tokens} tokens${p.uncounted ? `, ${p.uncounted} not counted` : ""}; cumulative ${p.cumulative}`));
    if (onPick) bar.addEventListener("click", () => onPick(p.seq));
    svg.append(bar);
  }
  if (pts.length) {
    const d = `M${x(0)},${yCum(0)} ` + pts.map((p) => `L${x(p.end).toFixed(1)},${yCum(p.cumulative).toFixed(1)}`).join(" ");
    svg.append(s("path", { d, class: "cumulative" }));
  }
  if (data.budget) {
    const y = yCum(data.budget);
    svg.append(s("line", { x1: L, y1: y, x2: W - R, y2: y, class: "budget" }));
    svg.append(s("text", { x: W - R + 4, y: y + 4, class: "label budget-label" }, `budget ${fmt(data.budget)}`));
  }
  for (const c of data.compactions || []) {
    const cx = x(c.at);
    const mark = s("line", { x1: cx, y1: T, x2: cx, y2: H - B, class: "compaction" });
    const d = c.data || {};
    mark.append(s("title", {}, `compaction at seq ${c.seq}: ${d.before_tokens} → ${d.after_tokens} tokens (budget ${d.budget})`));
    svg.append(mark);
  }
  if (data.usage && data.usage.length) {
    // Provider-reported input tokens per request (the usage ledger), on the cumulative scale.
    const seqToX = (seq) => { const p = pts.find((q) => q.seq >= seq); return p ? x(p.end) : x(n); };
    const d = data.usage.map((u, i) => `${i ? "L" : "M"}${seqToX(u.seq).toFixed(1)},${yCum(u.input_tokens || 0).toFixed(1)}`).join(" ");
    svg.append(s("path", { d, class: "usage" }));
  }
  svg.append(s("text", { x: L - 6, y: T + 8, class: "label", "text-anchor": "end" }, fmt(maxBar)));
  svg.append(s("text", { x: L - 6, y: H - B, class: "label", "text-anchor": "end" }, "0"));
  if (maxCum !== data.budget) svg.append(s("text", { x: W - R + 4, y: T + 8, class: "label cum-label" }, fmt(maxCum)));
  svg.append(s("text", { x: L, y: H - 8, class: "label" }, "message 0"));
  svg.append(s("text", { x: W - R, y: H - 8, class: "label", "text-anchor": "end" }, `${n} messages`));
  return svg;
}
