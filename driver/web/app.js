// The unbroken dashboard's page logic: poll /api/state every ~0.5 s and redraw.
// Plain browser JavaScript (no build step, no libraries): tables by DOM, charts on canvas.
"use strict";

const POLL_MS = 500;
const TIMEOUT_MS = 4000;
const MAX_EVENTS = 200;
const token = new URLSearchParams(location.search).get("token") || "";
const events = []; // newest last, at most MAX_EVENTS
let lastSeq = 0;
let source = ""; // driver id + role the events came from; a change refetches them
let updates = 0;
// the curves' points the page holds; the driver sends the ones after the newest only
const curve = { t: [], step: [], loss: [], step_ms: [], step_ms_max: [] };

const FAULTS = new Set(["node_lost", "worker_failed", "hang_suspected", "log_alert", "loss_spike",
  "node_refused", "node_evicted"]);
const RECOVERY = new Set(["recovery_transition", "training_paused", "training_resumed",
  "restore_started", "restore_finished", "spare_assigned", "world_resized", "rollback",
  "diagnosis_round", "diagnosis_verdict", "operator_action"]);

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "-";
  return typeof x === "number" ? x.toFixed(digits) : String(x);
}

function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function clock(ms) { return new Date(ms).toLocaleTimeString([], { hour12: false }); }

// phases in which no step is trained: the header says so in a colour and a banner
const RECOVERING = ["suspected", "paused", "diagnosed", "reshaped", "restoring"];

function banner(text, cls) {
  const b = $("banner");
  b.hidden = !text;
  b.textContent = text || "";
  b.className = cls || "";
}

// ------------------------------------------------------------------ header, nodes, ckpts
function renderHeader(s) {
  $("job").textContent = `job ${s.job_id}`;
  $("role").textContent = `${s.driver_id} · ${s.role}`;
  $("role").className = `pill ${s.role}`;
  $("phase").textContent = `phase ${s.phase}`;
  $("phase").className = `pill phase-${s.phase}`;
  $("step").textContent = `step ${s.live_step || s.step}`;
  const g = s.goodput;
  $("goodput").textContent = g && g.ratio >= 0 ? `goodput ${g.ratio.toFixed(3)}` : "goodput -";
  const bad = Object.entries((g && g.badput_s) || {}).filter(([, v]) => v >= 0.05);
  $("goodput").title = bad.length
    ? `lost: ${bad.map(([k, v]) => `${k} ${v.toFixed(1)} s`).join(", ")}`
    : "share of wall time since training began not lost to incidents";
  $("badput").textContent = bad.length
    ? `lost ${bad.map(([k, v]) => `${k} ${v.toFixed(1)} s`).join(" · ")}` : "";
  $("seq").textContent = `seq ${s.last_seq}`;
  const c = s.counts;
  $("counts").replaceChildren(...["alive", "active", "spare", "lost", "evicted"]
    .filter((k) => c[k]).map((k) => el("span", { class: `state ${k}` }, `${c[k]} ${k}`)));
  $("updated").textContent = `updated ${clock(s.now)}`;
  const inc = s.incident || {};
  const lg = s.event_log || {};
  if (s.error) banner(s.error, "");
  else if (lg.failing_s > 0) {
    banner(`${lg.full ? "etcd is FULL" : "The event log is unavailable"}: the driver's writes ` +
      `have been refused for ${Math.round(lg.failing_s)} s (${lg.error}).` +
      (lg.faults_unrecorded ? ` ${lg.faults_unrecorded} fault(s) wait to be recorded: the ` +
        "counts below miss them." : "") + " Free etcd space, then `etcdctl alarm disarm`.",
      "failed");
  } else if (s.mass_silence && s.mass_silence[0]) {
    const [n, held, unheard] = s.mass_silence;
    banner(`${n} nodes went silent at once: their NodeLost is held back (${Math.round(held)} s` +
      (unheard >= 1 ? `; no node heard for ${Math.round(unheard)} s: this driver overloaded ` +
        "or cut off from the nodes?" : "") + ").", "failed");
  } else if (s.phase === "failed") {
    banner(`The job FAILED at step ${s.step}: ${s.finished_reason || inc.cause || "see the events"}. ` +
      "Its workers are stopped. Fix the cause, then run `unbroken resume` " +
      "(a new incident with a fresh restore budget).", "failed");
  } else if (s.awaiting_nodes) {
    banner(`Training is stopped, waiting for nodes (incident ${inc.id || "?"}): ` +
      `${s.awaiting_nodes}. It goes on once lost nodes come back or nodes or spares join; ` +
      "the job fails after --await-nodes-s.", "recovering");
  } else if (RECOVERING.includes(s.phase)) {
    banner(`Training is stopped: recovering (${s.phase}) from incident ${inc.id || "?"}: ` +
      `${inc.cause || "?"}` + (inc.failed_restores ? `; ${inc.failed_restores} restore(s) failed` : ""),
      "recovering");
  } else if (s.role === "standby") {
    banner(`This driver is a standby: the job state below is replayed from the event log; ` +
      `live heartbeats, curves and the heatmap are on the leader (gRPC ` +
      `${s.leader_address || "address unknown yet"}).`, "standby");
  } else banner("", "");
}

function renderNodes(s) {
  const rows = s.nodes.map((n) => el("tr", { "data-node": n.id, "data-state": n.state },
    el("td", { title: `${n.hostname} ${n.ip} epoch ${n.epoch}` }, n.id),
    el("td", {}, el("span", { class: `state ${n.state}` }, n.state)),
    el("td", {}, n.ranks.length ? n.ranks.join(",") : "-"),
    el("td", { class: "num" }, n.step),
    el("td", { class: "num" }, fmt(n.loss, 4)),
    el("td", { class: "num" }, fmt(n.step_ms, 1)),
    el("td", { class: "num" }, fmt(n.silent_ms, 0)),
    el("td", { class: "num" }, n.failures)));
  $("nodes").tBodies[0].replaceChildren(...rows);
  $("nodes-more").textContent = s.nodes_total > s.nodes.length
    ? `${s.nodes_total - s.nodes.length} more nodes not shown` : "";
}

function renderCheckpoints(s) {
  const cks = s.checkpoints;
  const ver = s.verified_steps || [];
  $("ckpt-summary").textContent = (cks.length
    ? `newest committed step ${cks[0].step} (${cks.length} kept in the job state)`
    : "none committed yet") +
    (ver.length ? `; newest verified step ${ver[ver.length - 1]}` : "") +
    (s.sdc_suspected ? `; SDC suspected ${s.sdc_suspected}x` : "");
  $("checkpoints").tBodies[0].replaceChildren(...cks.slice(0, 8).map((c) => el("tr", {},
    el("td", { class: "num" }, c.step), el("td", {}, c.verified ? "yes" : "-"),
    el("td", { class: "num" }, bytes(c.bytes)),
    el("td", { class: "num" }, c.seq), el("td", { title: c.uri }, c.uri.split("/").slice(-2).join("/")))));
  const inc = s.incident;
  $("incident").textContent = inc.id
    ? `${inc.id}: ${inc.cause || "?"}; suspects ${inc.suspects.join(", ") || "-"}; ` +
      `to evict ${inc.bad_nodes.join(", ") || "-"}`
    : `none (world dp${s.world.dp}×pp${s.world.pp}×tp${s.world.tp}: ${s.world.nodes.join(", ") || "-"})`;
}

// ------------------------------------------------------------------ events
function renderEvents(s) {
  const key = `${s.driver_id}/${s.role}`;
  if (key !== source || s.last_seq < lastSeq) {
    // another driver, role or log: drop what we have; the next poll asks for its whole ring
    const first = !source;
    events.length = 0; lastSeq = 0; source = key;
    if (!first) return;
  }
  for (const e of s.events) if (e.seq > lastSeq) { events.push(e); lastSeq = e.seq; }
  if (events.length > MAX_EVENTS) events.splice(0, events.length - MAX_EVENTS);
  const items = [];
  for (let i = events.length - 1; i >= 0; i--) {
    const e = events[i];
    const cls = FAULTS.has(e.kind) ? "fault" : RECOVERY.has(e.kind) ? "recovery"
      : e.kind === "checkpoint_committed" ? "checkpoint" : "info";
    // a run of checkpoint commits (one per step) is one line: "steps 33-45 (13)"
    let j = i;
    while (cls === "checkpoint" && j > 0 && events[j - 1].kind === e.kind) j--;
    const step = (x) => (x.detail.match(/^step: (\d+)/) || [])[1];
    const detail = j < i ? `steps ${step(events[j])}–${step(e)} (${i - j + 1} commits)` : e.detail;
    items.push(el("li", { class: cls, "data-kind": e.kind, "data-seq": e.seq },
      el("span", { class: "seq" }, j < i ? `#${events[j].seq}–${e.seq}` : `#${e.seq}`),
      el("span", { class: "time" }, clock(e.t)),
      el("span", { class: "kind" }, e.kind), el("span", { class: "detail" }, detail)));
    i = j;
  }
  $("events").replaceChildren(...items);
}

// ------------------------------------------------------------------ charts
function setupCanvas(c, cssH) {
  const dpr = window.devicePixelRatio || 1;
  c.style.height = `${cssH}px`;
  const W = Math.round((c.clientWidth || 640) * dpr), H = Math.round(cssH * dpr);
  if (c.width !== W) c.width = W;
  if (c.height !== H) c.height = H;
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, W, H);
  ctx.font = `${11 * dpr}px system-ui, sans-serif`;
  return { ctx, w: W, h: H, dpr };
}

function lineChart(canvas, xs, lines, empty) {
  const { ctx, w, h, dpr } = setupCanvas(canvas, 180);
  const pts = lines.flatMap((l) => l.ys).filter((y) => y !== null);
  if (xs.length < 2 || pts.length < 2) {
    ctx.fillStyle = "#8a94a6";
    ctx.fillText(empty, 12 * dpr, h / 2);
    return;
  }
  const left = 56 * dpr, right = 10 * dpr, top = 10 * dpr, bottom = 20 * dpr;
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...pts), y1 = Math.max(...pts);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = (x) => left + ((x - x0) / Math.max(1e-9, x1 - x0)) * (w - left - right);
  const Y = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
  ctx.strokeStyle = "#2b3442"; ctx.fillStyle = "#8a94a6"; ctx.lineWidth = dpr;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, Y(y)); ctx.lineTo(w - right, Y(y)); ctx.stroke();
    ctx.fillText(y.toPrecision(4), 4 * dpr, Y(y) + 4 * dpr);
  }
  ctx.fillText(`step ${x0}`, left, h - 5 * dpr);
  const lbl = `step ${x1}`;
  ctx.fillText(lbl, w - right - ctx.measureText(lbl).width, h - 5 * dpr);
  let lx = left + 90 * dpr;
  for (const l of lines) {
    ctx.strokeStyle = l.color; ctx.lineWidth = 1.5 * dpr; ctx.beginPath();
    let pen = false;
    xs.forEach((x, i) => {
      const y = l.ys[i];
      if (y === null) { pen = false; return; }
      if (pen) ctx.lineTo(X(x), Y(y)); else { ctx.moveTo(X(x), Y(y)); pen = true; }
    });
    ctx.stroke();
    ctx.fillStyle = l.color; ctx.fillText(l.label, lx, h - 5 * dpr);
    lx += ctx.measureText(l.label).width + 16 * dpr;
  }
}

function heatColor(ratio) {
  // 1.0 (as fast as its peers) is blue-green; 2.0 and beyond is red
  const t = Math.max(0, Math.min(1, (ratio - 0.8) / 1.2));
  return `hsl(${Math.round(200 - 200 * t)}, 70%, ${Math.round(32 + 18 * t)}%)`;
}

function renderHeatmap(s) {
  const hm = s.heatmap;
  const canvas = $("heatmap");
  const rows = hm.ranks.length, cols = hm.t.length;
  const { ctx, w, h, dpr } = setupCanvas(canvas, Math.max(60, Math.min(400, rows * 18 + 20)));
  $("heat-window").textContent = cols > 1 ? Math.round(hm.t[cols - 1] - hm.t[0]) : 0;
  if (!rows || !cols) {
    ctx.fillStyle = "#8a94a6";
    ctx.fillText(s.role === "standby" ? "no heartbeats on a standby" : "no step times yet",
      12 * dpr, h / 2);
    $("heat-legend").textContent = "";
    return;
  }
  const left = 92 * dpr, top = 4 * dpr, bottom = 16 * dpr;
  const cw = (w - left - 4 * dpr) / cols, rh = (h - top - bottom) / rows;
  const meds = hm.median; // over every rank, not only the rows shown
  const stragglers = hm.stragglers || {};
  hm.ranks.forEach((rank, i) => {
    const slow = hm.slow.includes(rank);
    const node = (hm.nodes || [])[i] || "";
    const named = node in stragglers; // the driver's straggler detector named its node
    ctx.fillStyle = named ? "#d29922" : slow ? "#f85149" : "#8a94a6";
    const label = `${named ? "⚑ " : ""}rank ${rank} ${hm.ratio[i].toFixed(2)}×`;
    ctx.fillText(label, 4 * dpr, top + rh * i + rh / 2 + 4 * dpr);
    for (let j = 0; j < cols; j++) {
      const v = hm.ms[i][j];
      if (v === null || !meds[j]) continue;
      ctx.fillStyle = heatColor(v / meds[j]);
      ctx.fillRect(left + cw * j, top + rh * i, Math.ceil(cw), Math.max(1, rh - dpr));
    }
  });
  ctx.fillStyle = "#8a94a6";
  ctx.fillText(`${clock(hm.t[0] * 1000)}`, left, h - 3 * dpr);
  const end = clock(hm.t[cols - 1] * 1000);
  ctx.fillText(end, w - 4 * dpr - ctx.measureText(end).width, h - 3 * dpr);
  $("heat-legend").replaceChildren(
    el("span", {}, "colour: step time / median of all ranks at that moment (blue ≈ 1×, red ≥ 2×). "),
    el("span", { id: "slow-ranks", "data-slow": hm.slow.join(",") },
      hm.slow.length ? `slow: rank ${hm.slow.join(", ")}` : "no slow rank"),
    el("span", { id: "straggler-nodes", "data-nodes": Object.keys(stragglers).join(",") },
      Object.keys(stragglers).length
        ? ` · ⚑ straggler (StragglerSuspected): ` +
          Object.entries(stragglers).map(([n, x]) => `${n} ${x.toFixed(2)}×`).join(", ")
        : ""));
}

function mergeCurves(got) {
  for (const k of Object.keys(curve)) {
    if (got.full) curve[k] = got[k].slice();
    else curve[k].push(...got[k]);
    if (curve[k].length > got.max_points) curve[k].splice(0, curve[k].length - got.max_points);
  }
}

function renderCharts(s) {
  mergeCurves(s.curves);
  const c = curve;
  const empty = s.role === "standby" ? "no heartbeats on a standby" : "no steps reported yet";
  lineChart($("loss"), c.step, [{ ys: c.loss, color: "#58a6ff", label: "loss" }], empty);
  lineChart($("steptime"), c.step, [
    { ys: c.step_ms, color: "#3fb950", label: "median" },
    { ys: c.step_ms_max, color: "#f85149", label: "max" },
  ], empty);
  renderHeatmap(s);
}

// ------------------------------------------------------------------ polling
async function poll() {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), TIMEOUT_MS);
  try {
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const after = curve.t.length ? `&curves_after=${curve.t[curve.t.length - 1]}` : "";
    const url = `api/state?since=${lastSeq}${after}`;
    const r = await fetch(url, { headers, signal: ctl.signal, cache: "no-store" });
    if (r.status === 401) { banner(await r.text(), ""); return; }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const s = await r.json();
    renderHeader(s);
    renderNodes(s);
    renderCheckpoints(s);
    renderEvents(s);
    renderCharts(s);
    document.body.dataset.updates = String(++updates);
    document.body.dataset.role = s.role;
  } catch (err) {
    banner(`The driver does not answer (${err.name === "AbortError" ? "timeout" : err.message}); ` +
      "retrying. If it died, a standby driver's dashboard shows the job.", "");
    document.body.dataset.error = String(err);
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}

poll();
