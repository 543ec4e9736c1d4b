"""The page `megatron-rl report` writes: HTML, CSS and the inline script that draws it.

`PAGE` has two slots: {{TITLE}} (the run name, HTML-escaped) and {{DATA}} (the JSON from
`report.collect`, every "<" written as \\u003c). The script builds every element with DOM
calls and sets text through textContent, so rollout text is never parsed as HTML. Charts are
SVG: line series (markers on evaluation curves), percentile bands for the per-step
distributions.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{{TITLE}} - megatron-rl report</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0 auto; max-width: 1220px;
         padding: 16px 24px; color: #222; background: #fff; }
  h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 18px; margin: 28px 0 8px;
       border-bottom: 1px solid #ddd; padding-bottom: 4px; }
  .sub { color: #666; } .grid { display: flex; flex-wrap: wrap; gap: 12px; }
  .chart { border: 1px solid #e3e3e3; border-radius: 6px; padding: 6px; background: #fcfcfc; }
  .chart svg text { font: 11px system-ui, sans-serif; fill: #333; }
  .chart svg .title { font-size: 13px; font-weight: 600; }
  .legend { font-size: 12px; padding: 0 6px; } .legend span { margin-right: 12px; }
  .swatch { display: inline-block; width: 14px; height: 3px; vertical-align: middle;
            margin-right: 4px; }
  table.kv td { padding: 1px 12px 1px 0; } table.kv td:first-child { color: #666; }
  .controls { margin: 8px 0; display: flex; gap: 8px; align-items: center; }
  .group { border: 1px solid #ddd; border-radius: 6px; margin: 10px 0; padding: 8px 10px; }
  .group .prompt, td.response { font-family: ui-monospace, monospace; white-space: pre-wrap;
                                word-break: break-word; }
  .group .prompt { background: #f4f6fa; padding: 4px 6px; border-radius: 4px; }
  table.samples { border-collapse: collapse; width: 100%; margin-top: 6px; }
  table.samples th, table.samples td { border-top: 1px solid #eee; padding: 3px 6px;
                                       text-align: left; vertical-align: top; }
  table.samples th { font-weight: 600; color: #555; font-size: 12px; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
  .empty { color: #888; font-style: italic; }
  pre.config { background: #f7f7f7; padding: 8px; overflow: auto; max-height: 400px; }
</style>
</head>
<body>
<h1 id="title">{{TITLE}}</h1>
<div class="sub" id="subtitle"></div>
<table class="kv" id="summary"></table>
<h2>Training curves</h2>
<div class="grid" id="curves"></div>
<div class="controls"><label for="more-select">more metrics</label>
  <select id="more-select"></select></div>
<div class="grid" id="more"></div>
<h2>Per-step distributions (rollout store)</h2>
<div class="grid" id="dist"></div>
<h2>Rollouts</h2>
<div id="rollout-info" class="sub"></div>
<div class="controls" id="rollout-controls">
  <button id="prev" type="button">&larr; prev</button>
  <select id="step-select"></select>
  <button id="next" type="button">next &rarr;</button>
  <span id="step-stats" class="sub"></span>
</div>
<div id="rollouts"></div>
<details id="config-box"><summary>config.yaml</summary><pre class="config" id="config"></pre>
</details>
<script id="report-data" type="application/json">{{DATA}}</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const NS = "http://www.w3.org/2000/svg";  // the SVG namespace name (nothing is fetched)
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"];

function el(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function svg(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e);
  return e;
}
function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(+v.toPrecision(4));
}
function ticks(lo, hi, n) {
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const r = raw / mag, step = (r >= 7.5 ? 10 : r >= 3.5 ? 5 : r >= 1.5 ? 2 : 1) * mag;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    out.push(+t.toPrecision(12));
  }
  return out;
}
function extent(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }
  return [lo, hi];
}

// spec: {title, ylabel, series: [{name, points: [[x, y]], marker, dash, color}],
//        bands: [{lo: [[x, y]], hi: [[x, y]], color, opacity}], xdomain: [x0, x1] (optional)}
function chart(parent, spec) {
  const W = 580, H = 270, L = 58, R = 14, T = 26, B = 38;
  const box = el("div", {class: "chart"}, parent);
  const xs = [], ys = [];
  for (const s of spec.series) for (const [x, y] of s.points) if (y !== null) { xs.push(x); ys.push(y); }
  for (const b of spec.bands || []) {
    for (const [x, y] of b.lo.concat(b.hi)) if (y !== null) { xs.push(x); ys.push(y); }
  }
  const root = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`}, box);
  svg("text", {x: L, y: 16, class: "title"}, root, spec.title);
  if (!xs.length) { svg("text", {x: L, y: H / 2}, root, "no data"); return box; }
  let [x0, x1] = extent(xs.concat(spec.xdomain || [])), [y0, y1] = extent(ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 + 0.5; y1 += Math.abs(y1) * 0.1 + 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (const t of ticks(y0, y1, 5)) {
    svg("line", {x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#e6e6e6"}, root);
    svg("text", {x: L - 6, y: Y(t) + 4, "text-anchor": "end"}, root, fmt(t));
  }
  for (const t of ticks(x0, x1, 6)) {
    svg("line", {x1: X(t), x2: X(t), y1: H - B, y2: H - B + 4, stroke: "#888"}, root);
    svg("text", {x: X(t), y: H - B + 16, "text-anchor": "middle"}, root, fmt(t));
  }
  svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#bbb"}, root);
  svg("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle"}, root, "step");
  svg("text", {x: 12, y: (T + H - B) / 2, "text-anchor": "middle",
               transform: `rotate(-90 12 ${(T + H - B) / 2})`}, root, spec.ylabel || "");
  for (const b of spec.bands || []) {
    const up = b.hi.filter(p => p[1] !== null).map(p => `${X(p[0])},${Y(p[1])}`);
    const down = b.lo.filter(p => p[1] !== null).reverse().map(p => `${X(p[0])},${Y(p[1])}`);
    svg("polygon", {points: up.concat(down).join(" "), fill: b.color,
                    "fill-opacity": b.opacity, stroke: "none"}, root);
  }
  const legend = el("div", {class: "legend"}, box);
  spec.series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    let d = "", pen = "M";
    for (const [x, y] of s.points) {
      if (y === null) { pen = "M"; continue; }
      d += `${pen}${X(x).toFixed(1)},${Y(y).toFixed(1)}`; pen = "L";
    }
    if (d) {
      svg("path", {d: d, fill: "none", stroke: color, "stroke-width": 1.6,
                   "stroke-dasharray": s.dash || "none"}, root);
    }
    if (s.marker) {
      for (const [x, y] of s.points) {
        if (y !== null) svg("circle", {cx: X(x), cy: Y(y), r: 3.2, fill: color}, root);
      }
    }
    const item = el("span", {}, legend);
    el("span", {class: "swatch", style: `background:${color}`}, item);
    item.appendChild(document.createTextNode(s.name));
  });
  return box;
}

function header() {
  document.getElementById("subtitle").textContent =
    `${DATA.run_dir} - generated ${DATA.generated} by megatron-rl report`;
  const t = document.getElementById("summary");
  for (const [k, v] of DATA.summary) {
    const tr = el("tr", {}, t); el("td", {}, tr, k); el("td", {}, tr, v);
  }
  if (DATA.config) document.getElementById("config").textContent = DATA.config;
  else document.getElementById("config-box").remove();
}

function curves() {
  const box = document.getElementById("curves");
  if (!DATA.curves.length) el("p", {class: "empty"}, box, "no metrics.jsonl in this run");
  for (const spec of DATA.curves) chart(box, Object.assign({xdomain: DATA.xdomain}, spec));
  const sel = document.getElementById("more-select"), more = document.getElementById("more");
  const keys = Object.keys(DATA.more);
  if (!keys.length) { sel.parentElement.remove(); return; }
  for (const k of keys) el("option", {value: k}, sel, k);
  const draw = () => {
    more.replaceChildren();
    const k = sel.value, pts = DATA.more[k];
    chart(more, {title: `${DATA.run}: ${k}`, ylabel: k, xdomain: DATA.xdomain,
                 series: [{name: k, points: pts, marker: pts.length < 20 || k.startsWith("eval/")}]});
  };
  sel.addEventListener("change", draw);
  draw();
}

function distributions() {
  const box = document.getElementById("dist"), D = DATA.dist;
  if (!D) { el("p", {class: "empty"}, box, "no rollout store (rollouts.zarr) in this run"); return; }
  const pts = v => D.steps.map((s, i) => [s, v[i]]);
  for (const [key, label, color] of [["reward", "reward", "#1f77b4"],
                                     ["length", "response length (tokens)", "#2ca02c"]]) {
    const q = D[key];
    chart(box, {
      title: `${DATA.run}: ${label} per step`, ylabel: label,
      bands: [{lo: pts(q.p10), hi: pts(q.p90), color: color, opacity: 0.15},
              {lo: pts(q.p25), hi: pts(q.p75), color: color, opacity: 0.3}],
      series: [{name: "median (bands: 25-75th, 10-90th percentile)", points: pts(q.p50),
                color: color},
               {name: "mean", points: pts(q.mean), color: "#444", dash: "4 3"}]});
  }
  chart(box, {title: `${DATA.run}: finish reasons`, ylabel: "fraction of samples",
              series: Object.entries(D.finish).map(([r, v]) => ({name: r, points: pts(v)}))});
}

function rollouts() {
  const R = DATA.rollouts, box = document.getElementById("rollouts");
  const info = document.getElementById("rollout-info");
  if (!R || !R.steps.length) {
    document.getElementById("rollout-controls").remove();
    el("p", {class: "empty"}, box, R ? "the rollout store has no steps yet"
                                       : "no rollout store (rollouts.zarr) in this run");
    return;
  }
  info.textContent = `${R.steps.length} of ${R.stored_steps} stored steps, up to ` +
    `${R.groups_per_step} prompts each; megatron-rl inspect RUN_DIR --step N prints any step.`;
  const sel = document.getElementById("step-select");
  R.steps.forEach((st, i) => el("option", {value: i}, sel, `step ${st.step}`));
  const show = i => {
    sel.value = i;
    const st = R.steps[i];
    document.getElementById("step-stats").textContent =
      `${st.num_samples} samples, ${st.num_groups} prompts; mean reward ${fmt(st.reward_mean)},` +
      ` mean length ${fmt(st.length_mean)}`;
    box.replaceChildren();
    const rs = st.groups.flatMap(g => g.samples.map(s => s.reward)).filter(r => r !== null);
    const [lo, hi] = extent(rs);
    for (const g of st.groups) group(box, g, lo, hi);
  };
  sel.addEventListener("change", () => show(+sel.value));
  document.getElementById("prev").addEventListener("click", () => show(Math.max(0, +sel.value - 1)));
  document.getElementById("next").addEventListener("click",
    () => show(Math.min(R.steps.length - 1, +sel.value + 1)));
  show(R.steps.length - 1);
}

function group(parent, g, lo, hi) {
  const card = el("div", {class: "group"}, parent);
  const head = el("div", {}, card);
  el("b", {}, head, g.group_id);
  head.appendChild(document.createTextNode(`  ground truth: ${g.ground_truth}`));
  el("div", {class: "prompt"}, card, g.prompt);
  const extra = [...new Set(g.samples.flatMap(s => Object.keys(s.extra)))];
  const terms = [...new Set(g.samples.flatMap(s => Object.keys(s.terms)))];
  const table = el("table", {class: "samples"}, card);
  const hr = el("tr", {}, el("thead", {}, table));
  for (const h of ["#", "response", "reward", "advantage", "length", "finish", ...terms, ...extra]) {
    el("th", {}, hr, h);
  }
  const body = el("tbody", {}, table);
  for (const s of g.samples) {
    const tr = el("tr", {}, body);
    el("td", {class: "num"}, tr, s.i);
    el("td", {class: "response"}, tr, s.response);
    const t = hi > lo ? (s.reward - lo) / (hi - lo) : 0.5;
    el("td", {class: "num", style: `background:hsl(${Math.round(120 * t)},65%,88%)`}, tr,
       fmt(s.reward));
    el("td", {class: "num"}, tr, (s.advantage > 0 ? "+" : "") + fmt(s.advantage));
    el("td", {class: "num"}, tr, s.length);
    el("td", {}, tr, s.finish);
    for (const k of terms) el("td", {class: "num"}, tr, fmt(s.terms[k]));
    for (const k of extra) el("td", {}, tr, fmt(s.extra[k]));
  }
}

header();
curves();
distributions();
rollouts();
document.body.setAttribute("data-rendered", "1");
</script>
</body>
</html>
"""
