// dflash monitor page: one EventSource per selected run; `init` carries everything, `update` what is new.
// Plain JS, no dependency, no network besides this server. Untrusted text goes in via textContent only.
"use strict";

const $ = (id) => document.getElementById(id);
const CURVES = ["loss", "eal", "lr"];
const MAX_POINTS = 20000; // per curve in the page; beyond that min/max decimation halves it
const LOG_KEEP = 1000;
let source = null;
let runId = null;
let curves = { loss: [], eal: [], lr: [] };
let tauCurve = []; // [[step, τ], ...]: one point per eval event (status.tau_curve)
let lastStatus = null;
let autoScroll = true;

// ---------------------------------------------------------------- formatting
function fmtNum(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "string") return v; // "nan", "inf"
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits);
}
function fmtTick(t) {
  if (Math.abs(t) < 1e-12) return "0";
  if (Math.abs(t) < 1e-3 || Math.abs(t) >= 1e6) return t.toExponential(1);
  return String(Number(t.toPrecision(4)));
}
function fmtInt(v) { return v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"); }
function fmtDur(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (d) return `${d}d ${h}h ${String(m).padStart(2, "0")}m`;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}
function fmtAgo(t, now) { return t ? `${fmtDur(now - t)} ago` : "–"; }
function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${u[i]}`;
}
function fmtTime(t) { return t ? new Date(t * 1000).toLocaleString() : "–"; }
function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }

// ---------------------------------------------------------------- curves
function decimate(points, target) {
  // keep each bucket's min and max (in step order): spikes survive, memory stays bounded
  const n = points.length, buckets = Math.max(1, Math.floor(target / 2)), out = [];
  for (let b = 0; b < buckets; b++) {
    const lo = Math.floor(b * n / buckets), hi = Math.floor((b + 1) * n / buckets);
    if (lo >= hi) continue;
    let iMin = lo, iMax = lo;
    for (let i = lo; i < hi; i++) {
      if (points[i][1] < points[iMin][1]) iMin = i;
      if (points[i][1] > points[iMax][1]) iMax = i;
    }
    if (iMin === iMax) out.push(points[iMin]);
    else if (iMin < iMax) out.push(points[iMin], points[iMax]);
    else out.push(points[iMax], points[iMin]);
  }
  if (out.length && out[out.length - 1] !== points[n - 1]) out.push(points[n - 1]);
  return out;
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(v);
  return ticks;
}

function drawChart(canvas, points, color) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  const L = 56, R = 10, T = 8, B = 22, pw = w - L - R, ph = h - T - B;
  if (!points.length) {
    ctx.fillStyle = "#6b7686"; ctx.fillText("no data yet", L + 8, T + ph / 2); return;
  }
  let x0 = points[0][0], x1 = points[points.length - 1][0];
  let y0 = Infinity, y1 = -Infinity;
  for (const p of points) { if (p[1] < y0) y0 = p[1]; if (p[1] > y1) y1 = p[1]; }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const X = (x) => L + (x - x0) / (x1 - x0) * pw, Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * ph;
  // grid and labels
  ctx.strokeStyle = "#e9edf2"; ctx.fillStyle = "#6b7686"; ctx.lineWidth = 1;
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const t of niceTicks(y0, y1, 4)) {
    const y = Math.round(Y(t)) + 0.5;
    ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(L + pw, y); ctx.stroke();
    ctx.fillText(fmtTick(t), L - 6, y);
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (const t of niceTicks(x0, x1, 5)) {
    if (t < x0 || t > x1) continue;
    ctx.fillText(fmtInt(t), X(t), T + ph + 6);
  }
  ctx.strokeStyle = "#c9d1dc"; ctx.beginPath(); ctx.moveTo(L, T + ph + 0.5); ctx.lineTo(L + pw, T + ph + 0.5); ctx.stroke();
  // the line: per pixel column, the min and the max of its points (nothing hidden)
  ctx.strokeStyle = color; ctx.lineWidth = 1.6; ctx.lineJoin = "round"; ctx.beginPath();
  let col = null, cMin = 0, cMax = 0, cFirst = 0, cLast = 0, started = false;
  const flush = () => {
    if (col === null) return;
    if (!started) { ctx.moveTo(col, Y(cFirst)); started = true; } else ctx.lineTo(col, Y(cFirst));
    ctx.lineTo(col, Y(cMin)); ctx.lineTo(col, Y(cMax)); ctx.lineTo(col, Y(cLast));
  };
  for (const [x, y] of points) {
    const c = Math.round(X(x));
    if (c !== col) { flush(); col = c; cMin = cMax = cFirst = cLast = y; }
    else { if (y < cMin) cMin = y; if (y > cMax) cMax = y; cLast = y; }
  }
  flush(); ctx.stroke();
  if (points.length === 1) { ctx.fillStyle = color; ctx.beginPath(); ctx.arc(X(x0), Y(points[0][1]), 3, 0, 7); ctx.fill(); }
}

const COLORS = { loss: "#2f6fde", eal: "#1f9d55", lr: "#8a5cd6", tau: "#d9822b" };
let drawPending = false;
function redraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    for (const k of CURVES) drawChart($(`chart-${k}`), curves[k], COLORS[k]);
    drawChart($("chart-tau"), tauCurve, COLORS.tau);
  });
}

// ---------------------------------------------------------------- panels
function renderAlerts(alerts) {
  const box = $("alerts");
  box.replaceChildren(...alerts.map((a) => {
    const div = document.createElement("div");
    div.className = `alert ${a.level || "warn"}`;
    div.dataset.kind = a.kind;
    const k = document.createElement("span"); k.className = "kind"; k.textContent = a.kind.replace("_", " ");
    const m = document.createElement("span"); m.textContent = a.message;
    div.append(k, m);
    return div;
  }));
}

function renderPosAcc(acc) {
  const box = $("posacc");
  if (!acc || !acc.length) { box.replaceChildren(); box.textContent = "–"; return; }
  box.replaceChildren(...acc.map((v, i) => {
    const col = document.createElement("div"); col.className = "col";
    const val = document.createElement("div"); val.className = "v";
    const ok = typeof v === "number" && isFinite(v);
    val.textContent = ok ? v.toFixed(2) : "–";
    const fill = document.createElement("div"); fill.className = "fill";
    fill.style.height = `${ok ? Math.max(1, v * 100) * 0.7 : 0}%`;
    const k = document.createElement("div"); k.className = "k"; k.textContent = i + 1;
    col.append(val, fill, k);
    return col;
  }));
  box.title = "accuracy of draft positions 1..B-1 at the last step";
}

function renderMachine(s) {
  const box = $("machine"), sys = s.system || {}, parts = [];
  const meter = (cls, frac) => {
    const m = document.createElement("div"); m.className = `meter ${cls}`;
    const f = document.createElement("div"); f.style.width = `${Math.min(100, Math.max(0, frac * 100))}%`;
    m.append(f); return m;
  };
  const line = (label, value, frac, cls = "") => {
    const d = document.createElement("div"); d.className = "gpu";
    const n = document.createElement("div"); n.className = "name";
    const a = document.createElement("span"); a.textContent = label;
    const b = document.createElement("b"); b.textContent = value;
    n.append(a, b); d.append(n);
    if (frac !== null && frac !== undefined) d.append(meter(cls, frac));
    return d;
  };
  if (sys.gpus && sys.gpus.length) {
    for (const g of sys.gpus) {
      parts.push(line(`GPU ${g.index} ${g.name} util`, g.util_percent === null ? "–" : `${g.util_percent}%`, (g.util_percent || 0) / 100));
      parts.push(line("memory", `${fmtBytes(g.mem_used_bytes)} / ${fmtBytes(g.mem_total_bytes)}`,
        g.mem_total_bytes ? g.mem_used_bytes / g.mem_total_bytes : null, "mem"));
    }
  } else {
    parts.push(line(`CPU (${sys.cpu_count || "?"} cores, no GPU seen)`, sys.cpu_percent === undefined ? "–" : `${sys.cpu_percent.toFixed(0)}%`,
      (sys.cpu_percent || 0) / 100));
    parts.push(line("RAM", `${fmtBytes(sys.ram_used_bytes)} / ${fmtBytes(sys.ram_total_bytes)}`,
      sys.ram_total_bytes ? sys.ram_used_bytes / sys.ram_total_bytes : null, "mem"));
  }
  if (s.disk) {
    const used = 1 - s.disk.free_bytes / s.disk.total_bytes;
    const low = s.alerts.some((a) => a.kind === "disk_low");
    parts.push(line("disk of the run dir", `${fmtBytes(s.disk.free_bytes)} free of ${fmtBytes(s.disk.total_bytes)}`, used, low ? "hot" : ""));
  }
  box.replaceChildren(...parts);
}

function renderSummary(s) {
  const box = $("summary"), sum = s.summary;
  if (!sum) { box.hidden = true; return; }
  box.hidden = false;
  box.className = `card summary ${sum.status}`;
  const rows = [
    ["status", sum.status], ["steps", `${fmtInt(sum.step)} / ${fmtInt(sum.total_steps)}`], ["tokens", fmtInt(sum.tokens)],
    ["loss", `${fmtNum(sum.loss_first)} → ${fmtNum(sum.loss_last)}`],
    ["eal", `${fmtNum(sum.eal_first, 3)} → ${fmtNum(sum.eal_last, 3)}`],
    ["tokens/s", fmtNum(sum.tokens_per_s, 0)],
    ["wall time", fmtDur(sum.wall_s)], ["starts", String(sum.starts)],
    ["last checkpoint", sum.last_checkpoint || "–"], ["checkpoints", String(sum.checkpoints.length)],
    ["last eval τ", fmtNum(sum.last_eval_tau, 3)], ["warnings", String(sum.warnings.length)],
  ];
  if (s.end && s.end.error) rows.push(["error", s.end.error]);
  const body = $("summary-body");
  body.replaceChildren(...rows.flatMap(([k, v]) => {
    const l = document.createElement("label"); l.textContent = k;
    const b = document.createElement("b"); b.textContent = v;
    return [l, b];
  }));
  body.dataset.status = sum.status;
}

function badgeFor(s) {
  if (s.alerts.some((a) => a.kind === "process_gone")) return ["gone", "process gone"];
  if (s.alerts.some((a) => a.kind === "stall")) return ["stalled", "stalled"];
  return [s.status, s.status];
}

function renderStatus(s) {
  lastStatus = s;
  const [cls, label] = badgeFor(s);
  const badge = $("status-badge"); badge.className = `badge ${cls}`; badge.textContent = label;
  setText("run-id", s.run_id || "");
  const pct = s.progress === null ? null : Math.min(100, s.progress * 100);
  setText("step-text", s.budget_s ? `step ${fmtInt(s.step)} · budget ${fmtDur(s.budget_spent_s)} of ${fmtDur(s.budget_s)}` :
    (s.total_steps ? `step ${fmtInt(s.step)} / ${fmtInt(s.total_steps)}` : (s.events ? `step ${fmtInt(s.step)}` : "waiting for the run to start")));
  setText("pct", pct === null ? "" : `${pct.toFixed(1)}%`);
  const bar = $("progress-bar");
  bar.setAttribute("aria-valuenow", pct === null ? "0" : pct.toFixed(2));
  bar.dataset.step = String(s.step);
  bar.classList.toggle("done", s.status === "completed");
  $("progress-fill").style.width = `${pct || 0}%`;
  setText("tokens-text", `tokens ${fmtInt(s.tokens)}` + (s.total_tokens ? ` / ${fmtInt(s.total_tokens)} budget` : ""));
  setText("tpct", s.token_progress === null ? "" : `${(s.token_progress * 100).toFixed(1)}%`);
  $("tokens-fill").style.width = `${Math.min(100, (s.token_progress || 0) * 100)}%`;
  setText("elapsed", fmtDur(s.elapsed_s));
  const stalled = s.alerts.some((a) => a.kind === "stall" || a.kind === "process_gone");
  setText("eta", s.finished ? "done" : (stalled ? "stalled" : fmtDur(s.eta_s)));
  setText("finish-at", s.finished ? fmtTime(s.end && s.end.time) : (s.eta_s === null ? "–" :
    new Date((s.now + s.eta_s) * 1000).toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" })));
  setText("tps", s.tokens_per_s === null ? "–" : fmtInt(s.tokens_per_s));
  setText("sps", s.seconds_per_step === null ? "–" : `${s.seconds_per_step.toFixed(s.seconds_per_step < 10 ? 2 : 0)}s`);
  setText("last-step-age", fmtAgo(s.last_step_time, s.now));
  $("hs-wait-tile").hidden = s.hs_wait_share === null;  // target.source vllm only
  setText("hs-wait", s.hs_wait_share === null ? "–" : `${(s.hs_wait_share * 100).toFixed(1)}% of step`);
  $("nodes-tile").hidden = !s.nodes;  // a multi-node run: each node's step and last step time
  setText("nodes", !s.nodes ? "–" : s.nodes.map((n) => `${n.node} ${n.host}: step ${fmtInt(n.step)}` +
    (n.step_s === undefined ? "" : ` (${n.step_s.toFixed(2)}s)`)).join(" · "));
  setText("loss", fmtNum(s.loss)); setText("eal", fmtNum(s.eal, 3)); setText("lr", fmtNum(s.lr));
  setText("gnorm", fmtNum(s.grad_norm, 3));
  renderPosAcc(s.position_acc);
  const c = s.last_checkpoint;
  setText("ckpt-name", c ? c.name : "–");
  setText("ckpt-when", c ? `${fmtAgo(c.time, s.now)} (step ${fmtInt(c.step)})` : "–");
  setText("ckpt-size", c ? fmtBytes(c.size_bytes) : "–");
  setText("ckpt-count", String(s.checkpoints));
  const ev = s.last_eval;
  const trees = ev && ev.tree_tau ? Object.entries(ev.tree_tau).map(([b, t]) => ` · tree ${b}: ${fmtNum(t, 3)}`).join("") : "";
  setText("eval-tau", ev && ev.tau !== undefined ? `${fmtNum(ev.tau, 3)} (step ${fmtInt(ev.step)})${trees}` : "–");
  const tc = s.tau_curve || [];
  if (JSON.stringify(tc) !== JSON.stringify(tauCurve)) { tauCurve = tc; redraw(); }
  $("chart-tau").dataset.points = String(tauCurve.length);
  setText("run-status", s.status + (s.alive === false ? " (process gone)" : ""));
  setText("run-started", fmtTime(s.started_at));
  setText("run-starts", String(s.starts));
  const lay = s.layout;
  setText("run-layout", lay ? `world ${lay.world_size} on ${lay.device}, ${lay.precision}` : "–");
  setText("run-pid", s.pid ? String(s.pid) : "–");
  setText("run-warnings", s.warnings.length ? s.warnings[s.warnings.length - 1].message || s.warnings[s.warnings.length - 1].kind : "none");
  setText("clock", new Date(s.now * 1000).toLocaleTimeString());
  renderAlerts(s.alerts);
  renderMachine(s);
  renderSummary(s);
  document.title = `${s.total_steps ? Math.floor((s.progress || 0) * 100) + "% · " : ""}${s.status} · dflash monitor`;
}

function appendLog(lines, replace) {
  const pre = $("log");
  if (replace) pre.replaceChildren();
  const frag = document.createDocumentFragment();
  for (const line of lines) {
    const span = document.createElement("span");
    if (/\bWARNING\b/.test(line)) span.className = "w";
    if (/\b(ERROR|failed|Traceback)\b/.test(line)) span.className = "e";
    span.textContent = line + "\n";
    frag.append(span);
  }
  pre.append(frag);
  while (pre.childNodes.length > LOG_KEEP) pre.removeChild(pre.firstChild);
  if (autoScroll) pre.scrollTop = pre.scrollHeight;
  setText("log-info", `(last ${pre.childNodes.length} lines)`);
}

function renderRuns(runs, current) {
  const sel = $("run-select");
  const key = runs.map((r) => `${r.run}:${r.status}`).join("|");
  if (sel.dataset.key === key) return;
  sel.dataset.key = key;
  sel.replaceChildren(...runs.map((r) => {
    const o = document.createElement("option");
    o.value = r.run; o.textContent = `${r.run === "." ? "(this folder)" : r.run} · ${r.status}`;
    o.selected = r.run === current;
    return o;
  }));
}

// ---------------------------------------------------------------- live connection
function connect(run) {
  if (source) source.close();
  runId = run;
  const url = "/api/stream" + (run ? `?run=${encodeURIComponent(run)}` : "");
  source = new EventSource(url);
  source.addEventListener("open", () => $("conn").classList.add("live"));
  source.addEventListener("error", () => {
    $("conn").classList.remove("live");
    if (source.readyState === EventSource.CLOSED) {
      // refused (the run is gone from the list): pick again from the runs there are now
      setTimeout(() => fetch("/api/runs").then((r) => r.json()).then((d) => {
        const there = d.runs.some((r) => r.run === runId);
        connect(there ? runId : d.default);
      }).catch(() => connect(runId)), 2000);
    }
  });
  source.addEventListener("init", (e) => {
    const m = JSON.parse(e.data);
    runId = m.status.run;
    curves = m.curves;
    renderRuns(m.runs, runId);
    appendLog(m.log, true);
    renderStatus(m.status);
    redraw();
    const u = new URL(location.href);
    if (u.searchParams.get("run") !== runId) { u.searchParams.set("run", runId); history.replaceState(null, "", u); }
  });
  source.addEventListener("update", (e) => {
    const m = JSON.parse(e.data);
    if (m.points) {
      let grew = false;
      for (const k of CURVES) {
        if (!m.points[k] || !m.points[k].length) continue;
        curves[k].push(...m.points[k]);
        if (curves[k].length > MAX_POINTS) curves[k] = decimate(curves[k], MAX_POINTS / 2);
        grew = true;
      }
      if (grew) redraw();
    }
    if (m.log && m.log.length) appendLog(m.log, false);
    if (m.runs) renderRuns(m.runs, runId);
    renderStatus(m.status);
  });
}

window.addEventListener("DOMContentLoaded", () => {
  const pre = $("log");
  pre.addEventListener("scroll", () => { autoScroll = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4; });
  $("run-select").addEventListener("change", (e) => {
    const u = new URL(location.href); u.searchParams.set("run", e.target.value); history.replaceState(null, "", u);
    connect(e.target.value);
  });
  window.addEventListener("resize", redraw);
  const wanted = new URL(location.href).searchParams.get("run");
  fetch("/api/runs").then((r) => r.json()).then((d) => {
    renderRuns(d.runs, d.default);
    connect(d.runs.some((r) => r.run === wanted) ? wanted : d.default);
  }).catch(() => connect(null));
});
