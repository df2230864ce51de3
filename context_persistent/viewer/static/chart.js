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
  const maxCum = Math.max(1, data.total, data.budget || 0, ...(data.usage || []).map((u) => Math.max(u.input_tokens || 0, u.estimated_tokens || 0)));
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
  const usage = data.usage || [];
  if (usage.length) {
    // Reported by the provider: each request's input tokens as it counted them (a dot, joined by a dashed
    // line), beside the store's estimate of the same request (a tick), after the request's last message.
    const ux = (u) => x(Math.min(n, u.at)).toFixed(1);
    const reported = usage.filter((u) => u.input_tokens !== null);
    if (reported.length > 1) {
      svg.append(s("path", { d: reported.map((u, i) => `${i ? "L" : "M"}${ux(u)},${yCum(u.input_tokens).toFixed(1)}`).join(" "), class: "usage" }));
    }
    for (const u of usage) {
      const g = s("g", { class: "usage-point" });
      if (u.estimated_tokens !== null) g.append(s("line", { x1: +ux(u) - 4, x2: +ux(u) + 4, y1: yCum(u.estimated_tokens), y2: yCum(u.estimated_tokens), class: "estimate" }));
      if (u.input_tokens !== null) g.append(s("circle", { cx: ux(u), cy: yCum(u.input_tokens), r: 3, class: "reported" }));
      const runs = u.reports > 1 ? ` (the largest of ${u.reports} requests)` : "";
      g.append(s("title", {}, `request at seq ${u.request_seq}${runs}: ${u.input_tokens ?? "?"} input tokens reported by the provider, ${u.estimated_tokens ?? "?"} estimated by the store; ${u.output_tokens ?? "?"} output tokens`));
      svg.append(g);
    }
  }
  svg.append(s("text", { x: L - 6, y: T + 8, class: "label", "text-anchor": "end" }, fmt(maxBar)));
  svg.append(s("text", { x: L - 6, y: H - B, class: "label", "text-anchor": "end" }, "0"));
  if (maxCum !== data.budget) svg.append(s("text", { x: W - R + 4, y: T + 8, class: "label cum-label" }, fmt(maxCum)));
  svg.append(s("text", { x: L, y: H - 8, class: "label" }, "message 0"));
  svg.append(s("text", { x: W - R, y: H - 8, class: "label", "text-anchor": "end" }, `${n} messages`));
  return svg;
}
