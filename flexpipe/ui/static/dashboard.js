// flexpipe dashboard: renders the gateway's view (GET /ui/api/view, pushed by /ui/events) or
// a simulator report (flexpipe sim ... --json) through the same views. Vanilla JS, no library.
// docs/dashboard.md describes the view's fields.
"use strict";

const STATES = [
  "starting", "rehearsing", "active", "draining", "asleep", "waking", "ejected",
];
const PHASES = ["warm", "rehearse", "switch", "drain", "migrate", "release", "sleep", "wake"];
const PHASE_COLORS = [
  "#8a9bb3", "#d99a00", "#1f6feb", "#e8743b", "#9c27b0", "#2e9d5b", "#5c6bc0", "#26a6b8",
];
const METHODS = ["kv_moved", "recomputed", "finished_in_place", "rerun"];
const Q_COLORS = { p50: "#1f6feb", p95: "#d99a00", p99: "#c62828" };
const GiB = 1024 ** 3;

// everyShift: the shift timeline shows every deployment's entries (?shifts=all), not this run's
const state = { view: null, source: null, events: null, selected: null, everyShift: false };

// ------------------------------------------------------------------ helpers
const $ = (id) => document.getElementById(id);
function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
function fmt(v, digits = 2) {
  const x = num(v);
  if (x === null) return "–";
  if (Math.abs(x) >= 1000) return x.toLocaleString("en", { maximumFractionDigits: 0 });
  return x.toFixed(digits);
}
function ms(v) { const x = num(v); return x === null ? "–" : (x * 1000).toFixed(x < 0.01 ? 2 : 0) + " ms"; }
function pct(v) { const x = num(v); return x === null ? "–" : (x * 100).toFixed(1) + " %"; }
function gib(b) { const x = num(b); return x === null ? "–" : (x / GiB).toFixed(1); }
function clock(t) {
  if (state.source && state.source.kind === "report") {
    const s = Math.round(t); const m = Math.floor(s / 60);
    return `+${m}:${String(s % 60).padStart(2, "0")}`;
  }
  return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
}
function parseTime(v) {
  if (typeof v === "number") return v;
  if (typeof v === "string") { const t = Date.parse(v); return isNaN(t) ? null : t / 1000; }
  return null;
}
const list = (v) => (Array.isArray(v) ? v : []);
// assign only what changed: a part re-drawn every push would lose a click in progress
const shown = new WeakMap();
function setHtml(el, html) {
  if (shown.get(el) === html) return;
  shown.set(el, html);
  el.innerHTML = html;
}
const obj = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : {});

// ------------------------------------------------------------------ charts (SVG)
// series: [{name, color, points: [[t, v|null], ...], dash}]; threshold: {value, label}
function lineChart(title, series, opts = {}) {
  const W = 460, H = 150, L = 46, R = 8, T = 8, B = 20;
  const pts = series.flatMap((s) => s.points.filter((p) => num(p[1]) !== null));
  const ts = series.flatMap((s) => s.points.map((p) => p[0]));
  if (!ts.length) return `<div class="chart"><h4>${esc(title)}</h4><p class="muted">no data yet</p></div>`;
  let t0 = Math.min(...ts), t1 = Math.max(...ts);
  if (opts.span) t0 = Math.max(t0, t1 - opts.span);  // what there is, up to the span
  if (t1 <= t0) t1 = t0 + 1;
  let ymax = Math.max(0, ...pts.map((p) => p[1]));
  const thr = opts.threshold && num(opts.threshold.value);
  if (thr !== null && thr !== undefined) ymax = Math.max(ymax, thr * 1.1);
  if (opts.ymax) ymax = Math.max(ymax, opts.ymax);
  if (ymax <= 0) ymax = 1;
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  const yfmt = opts.yfmt || ((v) => fmt(v, v < 10 ? 2 : 0));
  let svg = "";
  for (let i = 0; i <= 3; i++) {
    const v = (ymax * i) / 3;
    svg += `<line x1="${L}" x2="${W - R}" y1="${y(v)}" y2="${y(v)}" stroke="#e5e8ee"/>`;
    svg += `<text x="${L - 4}" y="${y(v) + 3}" text-anchor="end">${esc(yfmt(v))}</text>`;
  }
  for (let i = 0; i <= 3; i++) {
    const t = t0 + ((t1 - t0) * i) / 3;
    svg += `<text x="${x(t)}" y="${H - 5}" text-anchor="${i === 0 ? "start" : i === 3 ? "end" : "middle"}">${esc(clock(t))}</text>`;
  }
  if (thr !== null && thr !== undefined) {
    svg += `<line x1="${L}" x2="${W - R}" y1="${y(thr)}" y2="${y(thr)}" stroke="#c62828" stroke-dasharray="5 3"/>`;
    svg += `<text x="${W - R - 2}" y="${y(thr) - 3}" text-anchor="end" style="fill:#c62828">${esc(opts.threshold.label || "SLO")}</text>`;
  }
  for (const s of series) {
    let d = "", pen = false;
    for (const [t, v] of s.points) {
      if (num(v) === null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    }
    if (d) svg += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="1.6"${s.dash ? ' stroke-dasharray="4 3"' : ""}/>`;
  }
  const legend = series.length > 1 || series[0].name
    ? series.map((s) => `<span><span class="swatch" style="background:${s.color}"></span>${esc(s.name)}</span>`).join(" ")
    : "";
  return `<div class="chart"><h4>${esc(title)} <span class="muted">${legend}</span></h4>` +
    `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(title)}">${svg}</svg></div>`;
}

// ------------------------------------------------------------------ GPU map
function renderLegend() {
  const items = STATES.map((s) => `<span><span class="swatch" style="background:var(--${s})"></span>${s}</span>`);
  items.push(`<span><span class="swatch" style="background:var(--others)"></span>other tenants</span>`);
  items.push(`<span><span class="swatch" style="background:var(--free);border:1px solid #ccc"></span>free</span>`);
  items.push(`<span class="link"><span class="bar"></span>fast link</span><span class="link slow"><span class="bar"></span>slow link</span>`);
  setHtml($("legend"), items.join(""));
}

function linkHtml(l, label) {
  const cls = l.fast ? "link" : "link slow";
  return `<span class="${cls}" title="${l.fast ? "fast" : "slow"} link"><span class="bar"></span>${esc(label)} ${esc(l.link)} ${fmt(l.gb_per_s, 0)} GB/s</span>`;
}

function renderMap(v) {
  const c = v.cluster;
  $("cluster-name").textContent = c && c.name ? c.name : "";
  if (!c || !list(c.nodes).length) {
    const why = v.controller && v.controller.error ? ` (${v.controller.error})` : "";
    setHtml($("gpu-map"), `<p class="muted">no GPU map: ${v.source === "report" ? "the report has no cluster" : "the gateway has no controller (flexpipe up gives it one)" + esc(why)}</p>`);
    setHtml($("node-links"), "");
    return;
  }
  setHtml($("gpu-map"), list(c.nodes).map((n) => {
    const gpus = list(n.gpus).map((g) => {
      const cap = num(g.capacity_bytes) || 1;
      const others = num(g.others_bytes) || 0, ours = num(g.flexpipe_bytes) || 0;
      const st = g.state || "";
      const shared = list(g.shared);  // a GPU shared in memory: every model on it
      const inst = shared.length
        ? shared.map((s) => `${esc(s.model || "")} <b>${esc(s.gear || "")}</b> <span class="state ${esc(s.state || "")}">${esc(s.state || "")}</span>`).join("<br>")
        : g.instance
        ? `${esc(g.model || "")} <b>${esc(g.gear || "")}</b><br>${st ? `<span class="state ${esc(st)}">${esc(st)}</span>` : ""} ${g.stage ? "stage " + esc(g.stage) : ""}`
        : `<span class="muted">${g.owner ? "held by " + esc(g.owner) : "idle"}</span>`;
      return `<div class="gpu" data-gpu="${esc(g.id)}" data-state="${esc(st)}" data-instance="${esc(g.instance || "")}">` +
        `<div><span class="id">${esc(g.id)}</span> <span class="muted">${esc(g.type)}</span></div>` +
        `<div class="inst">${inst}</div>` +
        `<div class="membar" title="flexpipe ${gib(ours)} GiB, other tenants ${gib(others)} GiB of ${gib(cap)} GiB">` +
        `<span style="width:${(100 * ours) / cap}%;background:var(--${STATES.includes(st) ? st : "active"})"></span>` +
        `<span class="others" style="width:${(100 * others) / cap}%"></span></div>` +
        `<div class="mem">flexpipe ${gib(ours)} · others ${gib(others)} · of ${gib(cap)} GiB</div></div>`;
    }).join("");
    const links = list(n.links).map((l) => linkHtml(l, list(l.gpus).join("–"))).join("");
    const net = n.network ? `<span class="muted">network:</span> ${linkHtml(n.network, "")}` : "";
    return `<div class="node" data-node="${esc(n.name)}"><h3>${esc(n.name)}</h3><div class="gpus">${gpus}</div>` +
      `<div class="links">${links}${links ? "<br>" : ""}${net}</div></div>`;
  }).join(""));
  const nl = list(c.node_links);
  setHtml($("node-links"), nl.length
    ? `<span class="muted">between nodes:</span> ` + nl.map((l) => linkHtml(l, list(l.nodes).join("↔"))).join("")
    : "");
}

// ------------------------------------------------------------------ models
function seriesOf(points, model, get) {
  return points.map((p) => [p.t, get(obj(obj(p.models)[model]))]);
}

// where a model's GPU utilisation came from (the view's gpu_utilization_source)
const UTIL_WHY = {
  dcgm: "measured: how busy DCGM saw its GPUs over the window (DCGM_FI_PROF_GR_ENGINE_ACTIVE, else DCGM_FI_DEV_GPU_UTIL), the mean over its instances' GPUs",
  modelled: "modelled: its sim engines' busy time over the window, as the performance model gives it, the mean over its instances",
  none: "n/a: no DCGM exporter reports its GPUs and its engines report no busy time (vLLM does not); give the gateway --dcgm URL",
};

function renderModels(v) {
  const points = list(v.series);
  const scale = num(v.time_scale) || 1;
  $("latency-note").textContent = v.source === "report"
    ? "" : `figures over the last ${fmt(v.window_s, 0)} s${scale !== 1 ? `; latencies and rates in modelled seconds (time scale ${scale})` : ""}; charts: last ${fmt((v.max_age_s || 900) / 60, 0)} min`;
  const models = list(v.models);
  if (!models.length) { setHtml($("models"), `<p class="muted">no model yet</p>`); return; }
  setHtml($("models"), models.map((m) => {
    const now = obj(m.now), slo = obj(m.slo);
    const lat = (key, sloKey) => ["p50", "p95", "p99"].map((q) => {
      const val = num(obj(now[key])[q]), lim = num(slo[sloKey]);
      const cls = val === null || lim === null ? "" : val > lim ? "bad" : "good";
      return `<div class="fig"><div class="k">${key === "ttft_s" ? "TTFT" : "TPOT"} ${q}${q === "p99" && lim !== null ? " / SLO " + ms(lim) : ""}</div><div class="v ${q === "p99" ? cls : ""}">${ms(val)}</div></div>`;
    }).join("");
    const f = (k, val, title = "", note = "") => `<div class="fig"${title ? ` title="${esc(title)}"` : ""}><div class="k">${k}</div><div class="v">${val}</div>${note ? `<div class="src">${esc(note)}</div>` : ""}</div>`;
    // n/a: a window was measured but no DCGM exporter reports its GPUs and its engines report
    // no busy time (as `flexpipe status`); the label under it says where the figure came from
    const util = m.now ? (num(now.gpu_utilization) === null ? "n/a" : pct(now.gpu_utilization)) : "–";
    const source = now.gpu_utilization_source;
    const utilWhy = UTIL_WHY[source] || UTIL_WHY.none;
    const figures = f("requests/s", fmt(now.request_rate_per_s)) + f("errors/s", fmt(now.error_rate_per_s)) +
      lat("ttft_s", "ttft_p99_s") + lat("tpot_s", "tpot_p99_s") + f("queue", fmt(now.queue, 0)) +
      f("prefix-cache hits", pct(now.prefix_hit_rate)) + f("output tokens/s", fmt(now.tokens_per_s, 0)) +
      f("GPU util", util, utilWhy, source === "dcgm" ? "DCGM" : source === "modelled" ? "modelled" : "") +
      f("instances", list(m.instances).length || fmt(now.num_instances, 0));
    const q = (key) => ["p50", "p95", "p99"].map((name) => ({
      name, color: Q_COLORS[name], points: seriesOf(points, m.name, (x) => obj(x[key])[name]) }));
    const span = v.max_age_s || 900;
    const charts = [
      lineChart("requests/s", [
        { name: "ok", color: "#1f6feb", points: seriesOf(points, m.name, (x) => x.request_rate_per_s) },
        { name: "errors", color: "#c62828", points: seriesOf(points, m.name, (x) => x.error_rate_per_s) }], { span }),
      lineChart("TTFT", q("ttft_s"), { span, yfmt: ms, threshold: { value: slo.ttft_p99_s, label: "SLO p99" } }),
      lineChart("TPOT", q("tpot_s"), { span, yfmt: ms, threshold: { value: slo.tpot_p99_s, label: "SLO p99" } }),
      lineChart("output tokens/s", [{ name: "", color: "#2e9d5b", points: seriesOf(points, m.name, (x) => x.tokens_per_s) }], { span }),
      lineChart("queue", [{ name: "", color: "#e8743b", points: seriesOf(points, m.name, (x) => x.queue) }], { span }),
      lineChart("prefix-cache hit rate", [{ name: "", color: "#9c27b0", points: seriesOf(points, m.name, (x) => x.prefix_hit_rate) }], { span, ymax: 1, yfmt: pct }),
    ];
    for (const extra of list(v.extra_charts)) {
      charts.push(lineChart(extra.title, [{ name: "", color: "#555", points: points.map((p) => [p.t, obj(p.extra)[extra.key]]) }], {}));
    }
    return `<div class="model" data-model="${esc(m.name)}"><h3>${esc(m.name)}</h3><div class="figures">${figures}</div><div class="charts">${charts.join("")}</div></div>`;
  }).join(""));
}

// ------------------------------------------------------------------ instances
function renderInstances(v) {
  const rows = list(v.instances);
  if (!rows.length) { setHtml($("instances"), `<p class="muted">no instance</p>`); return; }
  const token = $("admin-token").value.trim();
  const canAct = v.source !== "report" && v.admin_enabled && token;
  setHtml($("instances"), `<table><thead><tr><th>instance</th><th>model</th><th>gear</th><th>GPUs</th><th>state</th>` +
    `<th>in flight</th><th>running</th><th>waiting</th><th>cap</th><th>KV used</th>${canAct ? "<th></th>" : ""}</tr></thead><tbody>` +
    rows.map((i) => `<tr data-url="${esc(i.url)}"><td>${esc(i.name || i.url)}<br><span class="muted">${esc(i.name ? i.url : "")}</span></td>` +
      `<td>${esc(i.model)}</td><td>${esc(i.gear || "–")}</td><td>${esc(list(i.stages || (i.gpus ? [i.gpus] : [])).map((s) => list(s).join("+")).join(" | ") || "–")}</td>` +
      `<td><span class="state ${esc(i.state)}">${esc(i.state || "–")}</span></td>` +
      `<td class="num">${fmt(i.num_in_flight, 0)}</td><td class="num">${fmt(i.num_running, 0)}</td><td class="num">${fmt(i.num_waiting, 0)}</td>` +
      `<td class="num">${fmt(i.max_concurrency, 0)}</td><td class="num">${pct(i.kv_usage)}</td>` +
      (canAct ? `<td>${i.gateway_state === "active" ? `<button data-drain="${esc(i.url)}">drain</button>` : ""}</td>` : "") + `</tr>`).join("") +
    `</tbody></table>`);
}

// ------------------------------------------------------------------ gateway replicas
function renderGateways(v) {
  // several replicas of the gateway, driven by one controller (docs/controller.md)
  const rows = list(v.gateways).map(obj);
  $("gateways-section").hidden = rows.length < 2;
  if (rows.length < 2) return;
  setHtml($("gateways"), `<table><thead><tr><th>gateway</th><th>up</th><th>in flight</th><th>req/s</th><th>pool</th></tr></thead><tbody>` +
    rows.map((g) => `<tr data-gateway="${esc(g.url)}"><td>${esc(g.url)}</td>` +
      `<td><span class="state ${g.up ? "active" : "gone"}">${g.up ? "up" : "down"}</span></td>` +
      `<td class="num">${fmt(g.num_in_flight, 0)}</td><td class="num">${fmt(g.requests_per_s, 2)}</td>` +
      `<td>${esc(g.pool || "–")}${!g.up && g.error ? `<br><span class="muted">${esc(g.error)}</span>` : ""}</td></tr>`).join("") +
    `</tbody></table>`);
}

async function drain(url) {
  const token = $("admin-token").value.trim();
  if (!confirm(`Drain ${url}? The gateway stops routing to it; requests in flight finish.`)) return;
  const resp = await fetch("/admin/instances/drain", {
    method: "POST", headers: { "content-type": "application/json", authorization: `Bearer ${token}` },
    body: JSON.stringify({ url }),
  });
  if (!resp.ok) {
    const body = await resp.json().catch(() => ({}));
    banner(`drain refused (${resp.status}): ${obj(body.error).message || ""}`);
  }
}

// ------------------------------------------------------------------ shifts
function phasesOf(e) {
  // the log's `warm_s`...; a report's raw phases (`warm`, `warm_in_place`) add up
  const p = obj(e.phases);
  return PHASES.map((name) => {
    const vals = Object.entries(p).filter(([k, v]) => num(v) !== null &&
      (k === name || k === `${name}_s` || k.startsWith(`${name}_`))).map(([, v]) => v);
    return vals.length ? vals.reduce((a, b) => a + b, 0) : null;
  });
}

function phaseBar(e) {
  const vals = phasesOf(e);
  const total = vals.reduce((a, b) => a + (b || 0), 0);
  if (!total) return "";
  return `<div class="phasebar" title="${PHASES.map((n, i) => `${n} ${vals[i] === null ? "–" : vals[i].toFixed(2) + " s"}`).join(", ")}">` +
    vals.map((x, i) => (x ? `<span style="width:${(100 * x) / total}%;background:${PHASE_COLORS[i]}"></span>` : "")).join("") + `</div>`;
}

function migratedText(e) {
  const m = obj(e.migrated);
  if (!Object.keys(m).length) return "–";
  return METHODS.map((k) => `${num(m[k]) ?? 0}`).join("/");
}

function shiftKey(e, i) { return String(e.id ?? `i${i}`); }

function renderShiftScope(v) {
  const live = v.source !== "report";
  $("shifts-all-label").hidden = !live;
  $("shifts-all").checked = v.shifts_scope === "all";
  if (!live) { $("shift-scope").textContent = ""; return; }
  const since = num(v.started_at_s);
  $("shift-scope").textContent = v.shifts_scope === "all" ? "every deployment on the store"
    : `this run${since !== null ? ` (since ${clock(since)})` : ""}${v.deployment ? ` of ${v.deployment}` : ""}`;
  const hidden = num(v.num_hidden_shifts) || 0;
  $("shifts-hidden").textContent = v.shifts_scope !== "all" && hidden ? `(${hidden} hidden)` : "";
}

function renderShifts(v) {
  renderShiftScope(v);
  const all = list(v.shifts);
  const others = v.shifts_scope === "all";  // each entry says which deployment wrote it
  const entries = all.map((e, i) => ({ e, key: shiftKey(e, i), t: parseTime(e.at ?? e.at_s ?? e.t) }));
  if (!entries.length) {
    setHtml($("shift-strip"), "");
    setHtml($("shift-list"), `<p class="muted">no shift logged${v.source === "report" ? " in this report" : " yet"}</p>`);
    return;
  }
  // the strip: each entry at its time, as wide as it took, coloured by outcome
  const times = entries.map((x) => x.t).filter((t) => t !== null);
  const end = v.source === "report" ? Math.max(...times, num(v.duration_s) || 0) : Math.max(num(v.at_s) || 0, ...times);
  const start = Math.min(...times, end - 60);
  const W = 1000, x = (t) => 10 + ((t - start) / Math.max(1, end - start)) * (W - 20);
  const colors = { succeeded: "#2e9d5b", failed: "#c62828", aborted: "#c62828", rolled_back: "#e8743b", pending: "#d99a00" };
  let svg = `<line x1="10" x2="${W - 10}" y1="30" y2="30" stroke="#ccd"/>`;
  for (const { e, key, t } of entries) {
    if (t === null) continue;
    const w = Math.max(4, x(t + (num(e.duration_s) || 0)) - x(t));
    const c = e.kind === "resources" ? "#8a9bb3" : colors[e.outcome] || "#1f6feb";
    svg += `<rect data-shift="${esc(key)}" x="${x(t)}" y="${e.kind === "resources" ? 24 : 16}" width="${w}" height="${e.kind === "resources" ? 12 : 20}" fill="${c}"><title>${esc(`${clock(t)} ${e.kind} ${e.trigger ?? ""} ${e.outcome ?? ""}`)}</title></rect>`;
  }
  svg += `<text x="10" y="46" font-size="10" fill="#687385">${esc(clock(start))}</text><text x="${W - 10}" y="46" font-size="10" text-anchor="end" fill="#687385">${esc(clock(end))}</text>`;
  setHtml($("shift-strip"), `<svg viewBox="0 0 ${W} 48" preserveAspectRatio="none">${svg}</svg>`);
  const rows = entries.slice().reverse().map(({ e, key, t }) =>
    `<tr class="shift" data-shift-id="${esc(key)}" data-kind="${esc(e.kind)}"><td class="num">${esc(e.id ?? "")}</td><td>${t === null ? "–" : esc(clock(t))}</td>` +
    `<td>${esc(e.kind)}</td><td>${esc(e.trigger ?? "–")}</td>${others ? `<td>${esc(e.deployment ?? "–")}</td>` : ""}<td>${esc(e.from_to ?? fromTo(e))}</td>` +
    `<td>${phaseBar(e)}<span class="muted">${num(e.duration_s) !== null ? fmt(e.duration_s, 1) + " s" : ""}</span></td>` +
    `<td>${migratedText(e)}</td><td class="outcome ${esc(e.outcome)}">${esc(e.outcome ?? "–")}</td>` +
    `<td>${esc(e.reason ?? "")}${e.error ? `<br><span class="muted">→ ${esc(e.error)}</span>` : ""}</td></tr>`).join("");
  setHtml($("shift-list"), `<table><thead><tr><th>id</th><th>time</th><th>kind</th><th>trigger</th>${others ? "<th>deployment</th>" : ""}<th>from → to</th>` +
    `<th>phases (${PHASES.join("/")})</th><th>migrated (kv/rc/fin/rerun)</th><th>outcome</th><th>why</th></tr></thead><tbody>${rows}</tbody></table>`);
}

function short(i) {
  const it = obj(i);
  const gpus = list(it.stages).flat().join("+") || list(it.gpus).join("+");
  return `${it.model ?? "?"} ${String(it.gear ?? "").split("-").slice(0, 2).join("-")}@${gpus}`;
}

function fromTo(e) {
  if (!Array.isArray(e.target)) return typeof e.from === "string" ? `${e.from} → ${e.to ?? ""}` : "—";
  const k = (i) => `${obj(i).model}|${obj(i).gear}|${list(obj(i).stages).flat().join(",")}`;
  const cur = new Set(list(e.current).map(k)), tgt = new Set(e.target.map(k));
  const removed = list(e.current).filter((i) => !tgt.has(k(i))).map(short);
  const added = e.target.filter((i) => !cur.has(k(i))).map(short);
  return `${removed.join(", ") || "∅"} → ${added.join(", ") || "∅"}`;
}

function table(rows, cols) {
  if (!rows.length) return `<p class="muted">none</p>`;
  return `<table><thead><tr>${cols.map((c) => `<th>${esc(c[0])}</th>`).join("")}</tr></thead><tbody>` +
    rows.map((r) => `<tr>${cols.map((c) => `<td>${c[1](r)}</td>`).join("")}</tr>`).join("") + `</tbody></table>`;
}

function showShift(key) {
  const entries = list(state.view && state.view.shifts);
  const idx = entries.findIndex((e, i) => shiftKey(e, i) === key);
  if (idx < 0) return;
  const e = entries[idx];
  state.selected = key;
  $("detail-title").textContent = `${e.kind ?? "shift"} #${e.id ?? idx} · ${e.trigger ?? ""} · ${e.outcome ?? ""}`;
  const price = obj(e.price);
  const alts = list(e.alternatives).slice().sort((a, b) => (num(b.score) ?? -1e18) - (num(a.score) ?? -1e18));
  const vals = phasesOf(e);
  $("detail-body").innerHTML =
    `<p><b>${esc(e.from_to ?? fromTo(e))}</b></p><p>${esc(e.reason ?? "")}${e.error ? `<br><b>error:</b> ${esc(e.error)}` : ""}</p>` +
    `<p class="muted">decided ${esc(typeof e.at === "number" ? clock(e.at) : e.at ?? "")}${e.finished_at ? `, finished ${esc(e.finished_at)}` : ""}${num(e.score) !== null ? `, score ${fmt(e.score)}` : ""}</p>` +
    `<h4>Phases</h4>${phaseBar(e)}` + table(PHASES.map((n, i) => [n, vals[i]]).filter((r) => r[1] !== null), [["phase", (r) => esc(r[0])], ["seconds", (r) => fmt(r[1], 3)]]) +
    `<h4>Requests migrated</h4>` + table(Object.entries(obj(e.migrated)), [["method", (r) => esc(r[0])], ["requests", (r) => esc(r[1])]]) +
    `<h4>Alternatives weighed</h4>` + table(alts, [["", (a) => (a.accepted ? "✔ taken" : "")], ["candidate", (a) => esc(a.name)], ["score", (a) => fmt(a.score)], ["why", (a) => esc(a.reason)], ["instances", (a) => esc(list(a.instances).join(", "))]]) +
    (Object.keys(price).length ? `<h4>Price</h4>` + table(Object.entries(price).filter((r) => r[0] !== "notes"), [["term", (r) => esc(r[0])], ["value", (r) => (typeof r[1] === "number" ? fmt(r[1], 3) : esc(r[1]))]]) + list(price.notes).map((n) => `<p class="muted">${esc(n)}</p>`).join("") : "") +
    `<h4>Rehearsal</h4>` + table(list(e.rehearsal), [["instance", (c) => esc(c.instance)], ["metric", (c) => esc(c.metric)], ["predicted", (c) => fmt(c.predicted, 4)], ["measured", (c) => fmt(c.measured, 4)], ["passed", (c) => (c.passed ? "yes" : "no")], ["why", (c) => esc(c.why)]]) +
    `<h4>Signals</h4>` + table(list(e.signals), [["model", (s) => esc(s.model)], ["queue", (s) => fmt(s.queue)], ["latency / SLO", (s) => fmt(s.latency)], ["utilisation", (s) => fmt(s.utilization)], ["zone", (s) => esc(s.zone)], ["fired", (s) => esc(s.fired)]]) +
    (list(e.notes).length ? `<h4>Notes</h4>` + list(e.notes).map((n) => `<p>${esc(n)}</p>`).join("") : "") +
    `<details><summary>the whole record (JSON)</summary><pre>${esc(JSON.stringify(e, null, 2))}</pre></details>`;
  const dlg = $("shift-detail");
  if (!dlg.open) dlg.showModal();
}

// ------------------------------------------------------------------ the page
function banner(text) {
  const b = $("banner");
  b.textContent = text || "";
  b.hidden = !text;
}

function render() {
  const v = state.view;
  if (!v) return;
  renderMap(v);
  renderModels(v);
  renderGateways(v);
  renderInstances(v);
  renderShifts(v);
  const ctl = obj(v.controller);
  const dead = list(obj(v.dcgm).exporters).map(obj).filter((e) => e.error).map((e) => e.error);
  if (v.source !== "report") banner([ctl.error, ...dead].filter(Boolean).join(" · "));
}

function setStatus(kind, text) {
  const s = $("status");
  s.dataset.state = kind;
  s.textContent = text;
}

function merge(old, incoming) {
  // a later push carries only the points the client lacks; a first one (or a reconnect) all
  if (!old || old.source !== "live") return incoming;
  const pts = list(incoming.series);
  const first = pts.length ? pts[0].t : Infinity;
  const keep = list(old.series).filter((p) => p.t < first);
  const horizon = (num(incoming.at_s) || 0) - (num(incoming.max_age_s) || 900);
  return { ...incoming, series: keep.concat(pts).filter((p) => p.t >= horizon) };
}

function connect() {
  if (state.events) state.events.close();
  const es = new EventSource(state.everyShift ? "/ui/events?shifts=all" : "/ui/events");
  state.events = es;
  state.source = { kind: "live" };
  es.addEventListener("view", (ev) => {
    state.view = merge(state.view, JSON.parse(ev.data));
    setStatus("live", "live");
    $("source").textContent = "";
    render();
  });
  es.onerror = () => setStatus("reconnecting", "reconnecting…");
}

// A simulator report (flexpipe/sim/report.py): whatever of these it has is shown; every key
// is optional (reports grow: per-model series and shifts are picked up when present).
function fromReport(doc) {
  const d = obj(doc);
  const models = Object.entries(obj(d.models)).map(([name, m]) => {
    const mm = obj(m), slo = obj(mm.slo);
    return {
      name,
      slo: { ttft_p99_s: num(slo.ttft_p99_s ?? slo.ttft_s), tpot_p99_s: num(slo.tpot_p99_s ?? slo.tpot_s) },
      now: {
        request_rate_per_s: num(d.duration_s) ? (num(mm.num_completed) || 0) / d.duration_s : null,
        error_rate_per_s: num(d.duration_s) ? (num(mm.num_failed) || 0) / d.duration_s : null,
        ttft_s: { p50: num(obj(mm.ttft_s).p50), p95: num(obj(mm.ttft_s).p95 ?? obj(mm.ttft_s).p90), p99: num(obj(mm.ttft_s).p99) },
        tpot_s: { p50: num(obj(mm.tpot_s).p50), p95: num(obj(mm.tpot_s).p95 ?? obj(mm.tpot_s).p90), p99: num(obj(mm.tpot_s).p99) },
        tokens_per_s: num(mm.throughput_tokens_per_s), queue: null, prefix_hit_rate: null,
      },
      instances: list(d.instances).filter((i) => obj(i).model === name).map((i) => i.name),
    };
  });
  const names = models.map((m) => m.name);
  let series = [];
  const given = list(d.series);
  if (given.length && given.every((p) => obj(p).models)) {
    series = given.map((p) => ({ ...p, t: num(p.t) ?? num(p.t_s) ?? num(p.start_s) ?? 0 }));
  } else {
    // the interval timeline: one row per interval for the whole run
    const rows = list(d.timeline);
    series = rows.map((r, i) => {
      const next = rows[i + 1];
      const dt = next ? num(next.start_s) - num(r.start_s) : (num(d.run_end_s) ?? num(d.duration_s) ?? 0) - (num(r.start_s) || 0);
      const fig = {
        request_rate_per_s: dt > 0 ? (num(r.completed) || 0) / dt : null,
        tokens_per_s: num(r.tokens_per_s), ttft_s: { p50: num(r.ttft_p50_s), p95: num(r.ttft_p95_s), p99: num(r.ttft_p99_s) },
        tpot_s: { p50: num(r.tpot_p50_s), p95: num(r.tpot_p95_s), p99: num(r.tpot_p99_s) },
        queue: num(r.queue), prefix_hit_rate: num(r.prefix_hit_rate),
      };
      const per = obj(r.models);
      return {
        t: num(r.start_s) ?? i, models: Object.fromEntries(names.map((n) => [n, per[n] ? { ...fig, ...obj(per[n]) } : fig])),
        extra: { gpus_reserved: num(r.gpus_reserved), utilisation: num(r.utilisation) },
      };
    });
  }
  // the simulator's shift records (at_s, finished_s, succeeded, phases_s, migrated by
  // method, started / stopped) or shift log entries; resource events as context marks
  const methods = { kv: "kv_moved", recompute: "recomputed", rerun: "rerun", finished: "finished_in_place" };
  const shifts = list(d.shifts ?? d.shift_log).map((e) => {
    const x = obj(e);
    const at = parseTime(x.at_s ?? x.at ?? x.t);
    const fin = parseTime(x.finished_s ?? x.finished_at);
    const migrated = Object.fromEntries(Object.entries(obj(x.migrated)).map(([k, v]) => [methods[k] ?? k, v]));
    const moved = list(x.stopped).length || list(x.started).length
      ? `${list(x.stopped).join(", ") || "∅"} → ${list(x.started).join(", ") || "∅"}` : undefined;
    return {
      ...x, kind: x.kind ?? "shift", at,
      outcome: x.outcome ?? (x.succeeded === true ? "succeeded" : x.succeeded === false ? "failed" : undefined),
      error: x.error ?? (x.why_failed || undefined), phases: x.phases ?? x.phases_s, migrated,
      from_to: x.from_to ?? moved,
      duration_s: num(x.duration_s) ?? (at !== null && fin !== null ? fin - at : null),
    };
  });
  for (const r of list(d.resource_events)) {
    const x = obj(r);
    shifts.push({ kind: "resources", at: num(x.at_s), trigger: x.kind, outcome: "noted",
      reason: x.why ?? `${x.gpu ?? ""} ${x.kind ?? ""}`, notes: [JSON.stringify(x)] });
  }
  shifts.sort((a, b) => (a.at ?? 0) - (b.at ?? 0));
  shifts.forEach((e, i) => { if (e.id === undefined) e.id = i + 1; });
  return {
    source: "report",
    at_s: num(d.end_s) ?? num(d.duration_s) ?? 0,
    duration_s: num(d.duration_s),
    time_scale: 1,
    models,
    series,
    extra_charts: series.length && series[0].extra ? [{ title: "GPUs reserved", key: "gpus_reserved" }, { title: "utilisation", key: "utilisation" }] : [],
    instances: list(d.instances).map((i) => {
      const x = obj(i), gone = num(x.released_s) !== null && x.released_s >= 0 && x.released_s < (num(d.end_s) ?? Infinity);
      return { ...x, url: x.url ?? "", state: x.state ?? (x.died ? "gone" : gone ? "gone" : "active") };
    }),
    cluster: d.cluster && list(obj(d.cluster).nodes).length ? d.cluster : occupancyMap(d),
    shifts,
    controller: null,
    title: `${d.scenario ?? "report"} · policy ${d.policy ?? "?"} · seed ${d.seed ?? "?"} · ${fmt(d.duration_s, 0)} s`,
  };
}

// the report's GPU occupancy (per GPU, who held it when) as a map of the run's end
function occupancyMap(d) {
  const gpus = list(d.gpu_occupancy);
  if (!gpus.length) return null;
  const nodes = new Map();
  const gears = Object.fromEntries(list(d.instances).map((i) => [obj(i).name, obj(i).gear]));
  for (const g of gpus.map(obj)) {
    // who held it last: the segment that ends latest (ours before a tenant's on a tie)
    const segs = list(g.segments).map(obj).sort((a, b) =>
      (num(a.end_s) ?? 0) - (num(b.end_s) ?? 0) || (a.model ? 1 : 0) - (b.model ? 1 : 0));
    const last = segs.length ? segs[segs.length - 1] : null;
    const ours = last && last.model;
    if (!nodes.has(g.node)) nodes.set(g.node, []);
    nodes.get(g.node).push({
      id: g.gpu, type: g.type, instance: ours ? last.holder : null, model: ours ? last.model : null,
      gear: ours ? gears[last.holder] ?? last.holder : null, state: ours ? "active" : null,
      owner: last && !ours ? last.holder : null,
    });
  }
  return { name: `${d.scenario ?? "report"} (at the end of the run)`,
    nodes: [...nodes].map(([name, g]) => ({ name, gpus: g, links: [] })), node_links: [] };
}

function openReport(doc, label) {
  if (state.events) { state.events.close(); state.events = null; }
  state.source = { kind: "report" };
  state.view = fromReport(doc);
  setStatus("report", "report");
  $("source").textContent = `${label}: ${state.view.title}`;
  $("live-button").hidden = false;
  banner("");
  render();
}

function init() {
  renderLegend();
  $("report-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    try { openReport(JSON.parse(await file.text()), file.name); }
    catch (err) { banner(`cannot read ${file.name}: ${err.message}`); }
  });
  $("live-button").addEventListener("click", () => {
    $("live-button").hidden = true;
    state.view = null;
    history.replaceState(null, "", state.everyShift ? "/ui?shifts=all" : "/ui");
    connect();
  });
  state.everyShift = new URLSearchParams(location.search).get("shifts") === "all";
  $("shifts-all").checked = state.everyShift;
  $("shifts-all").addEventListener("change", () => {
    state.everyShift = $("shifts-all").checked;
    history.replaceState(null, "", state.everyShift ? "/ui?shifts=all" : "/ui");
    state.view = null;  // the new stream starts with the whole view
    connect();
  });
  $("token-form").addEventListener("submit", (ev) => ev.preventDefault());
  $("admin-token").value = sessionStorage.getItem("flexpipe-admin-token") || "";
  $("admin-token").addEventListener("change", () => {
    sessionStorage.setItem("flexpipe-admin-token", $("admin-token").value.trim());
    render();
  });
  document.addEventListener("click", (ev) => {
    const t = ev.target.closest("[data-shift-id],[data-shift],[data-drain]");
    if (!t) return;
    if (t.dataset.drain) drain(t.dataset.drain);
    else showShift(t.dataset.shiftId ?? t.dataset.shift);
  });
  const report = new URLSearchParams(location.search).get("report");
  if (report) {
    fetch(report).then((r) => {
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      return r.json();
    }).then((doc) => openReport(doc, report)).catch((err) => {
      setStatus("offline", "no report");
      banner(`cannot load the report ${report}: ${err.message}`);
    });
  } else {
    connect();
  }
}

init();
