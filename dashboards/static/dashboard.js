// tailspec dashboard: polls the read-only JSON API every second and renders the page.
// Text from the cluster state is only ever set with textContent (never innerHTML).
"use strict";
(() => {
  const STATES = ["generating", "drained", "lent", "reclaiming", "unknown"];
  const STATE_LABEL = {
    generating: "generating", drained: "idle (drained)", lent: "training (lent)",
    reclaiming: "reclaiming", unknown: "unknown",
  };
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                   "#ff9da7", "#9c755f", "#bab0ac"];
  // ?refresh=MS polls faster or slower (at least 200 ms); the only thing the page reads from its URL.
  const REFRESH_MS = Math.max(200, Number(new URLSearchParams(location.search).get("refresh")) || 1000);
  const INT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // integer x ticks
  const $ = (id) => document.getElementById(id);
  const SVG_NS = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null) continue;
      if (k === "class") e.className = v;
      else if (k === "style") e.style.cssText = v;  // CSSOM, allowed by the page's CSP (attributes are not)
      else e.setAttribute(k, v);
    }
    for (const c of children) {
      if (c == null) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  const fmtNum = (x, d = 2) => (x == null || !isFinite(x) ? "–" : Number(x).toFixed(d));
  function fmtGpuSeconds(s) {
    if (s == null) return "–";
    if (s >= 7200) return (s / 3600).toFixed(2) + " GPU·h";
    if (s >= 120) return (s / 60).toFixed(1) + " GPU·min";
    return s.toFixed(1) + " GPU·s";
  }
  function fmtBytes(b) {
    if (b == null) return "–";
    const gib = b / 2 ** 30;
    return gib >= 1 ? gib.toFixed(1) + " GiB" : (b / 2 ** 20).toFixed(0) + " MiB";
  }
  function fmtAgo(ts, now) {
    if (ts == null) return "–";
    const s = Math.max(0, now - ts);
    if (s < 120) return s.toFixed(1) + " s ago";
    if (s < 7200) return (s / 60).toFixed(1) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }
  function stateBadge(state) {
    return el("span", {class: "state state-" + state, "data-state": state}, STATE_LABEL[state] || state);
  }
  function fillTable(tbodyParent, rows, emptyText, columns) {
    const tbody = tbodyParent.querySelector("tbody");
    tbody.replaceChildren();
    if (!rows.length) {
      tbody.append(el("tr", {}, el("td", {class: "empty", colspan: String(columns)}, emptyText)));
      return;
    }
    for (const r of rows) tbody.append(r);
  }

  // ---- charts (uPlot) ---------------------------------------------------------------------------
  const charts = {};
  function chart(name, container, makeOpts, data, shapeKey, emptyText) {
    const c = charts[name];
    const hasData = data && data.length > 1 && data[0].length > 0;
    if (!hasData) {
      if (c) { c.plot.destroy(); delete charts[name]; }
      container.replaceChildren(el("div", {class: "empty"}, emptyText));
      return;
    }
    const width = Math.max(300, container.clientWidth || 500);
    if (c && c.shapeKey === shapeKey && c.width === width) {
      c.plot.setData(data);
      return;
    }
    if (c) c.plot.destroy();
    container.replaceChildren();
    const plot = new uPlot({width, height: 220, ...makeOpts()}, data, container);
    charts[name] = {plot, shapeKey, width};
  }
  function lineSeries(labels, opts = {}) {
    return labels.map((label, i) => ({label, stroke: PALETTE[i % PALETTE.length], width: 1.5,
                                      spanGaps: true, points: {show: false}, ...opts}));
  }
  // Align several [xs, ys] tables on the union of their xs (uPlot.join).
  function joined(tables) {
    if (!tables.length) return null;
    return uPlot.join(tables.map((t) => [t[0], t[1]]));
  }

  function renderTelemetryCharts(tl) {
    const series = tl.telemetry;
    const labels = series.map((s) => s.id + (s.simulated ? " (simulated)" : ""));
    const key = labels.join("|");
    const util = joined(series.map((s) => [s.ts, s.util]));
    chart("util", $("chart-util"), () => ({
      series: [{}, ...lineSeries(labels)],
      scales: {y: {range: [0, 100]}},
    }), util, key, "no telemetry in this window");
    const mem = joined(series.map((s) => [s.ts, s.mem_used.map((b) => b / 2 ** 30)]));
    chart("mem", $("chart-mem"), () => ({
      series: [{}, ...lineSeries(labels)],
      scales: {y: {range: (u, min, max) => [0, Math.max(max * 1.1, 0.001)]}},
    }), mem, key, "no telemetry in this window");
  }

  function renderVersionChart(st) {
    const versions = [...st.drafter_versions].sort((a, b) => a.version - b.version);
    const xs = [], promoted = [], rejected = [], baseline = [];
    for (const v of versions) {
      if (xs.length && xs[xs.length - 1] === v.version) continue;
      xs.push(v.version);
      promoted.push(v.promoted ? v.acceptance_length : null);
      rejected.push(v.promoted ? null : v.acceptance_length);
      baseline.push(v.baseline_acceptance_length);
    }
    const data = xs.length ? [xs, promoted, rejected, baseline] : null;
    chart("versions", $("chart-versions"), () => ({
      scales: {x: {time: false}},
      axes: [{label: "drafter version", incrs: INT_INCRS}, {}],
      series: [
        {label: "version"},
        {label: "promoted", stroke: "#59a14f", width: 2, spanGaps: true, points: {show: true, size: 7}},
        {label: "rejected", stroke: "#e15759", width: 0, points: {show: true, size: 7}},
        {label: "version then current (same samples)", stroke: "#bab0ac", width: 1, dash: [4, 4], spanGaps: true,
         points: {show: false}},
      ],
    }), data, "versions", "no drafter versions yet");
  }

  // Per-worker series over RL steps of one figure of the rollout stats.
  function stepTables(points, field) {
    const byWorker = new Map();
    for (const p of points) {
      if (p[field] == null) continue;
      if (!byWorker.has(p.worker)) byWorker.set(p.worker, new Map());
      byWorker.get(p.worker).set(p.step, p[field]);  // newest report of a step wins
    }
    const workers = [...byWorker.keys()].sort();
    const tables = workers.map((w) => {
      const steps = [...byWorker.get(w).keys()].sort((a, b) => a - b);
      return [steps, steps.map((s) => byWorker.get(w).get(s))];
    });
    return {workers, data: joined(tables)};
  }

  function renderHealth(st) {
    const hs = st.drafter_health;
    const data = hs.length ? [hs.map((h) => h.ts), hs.map((h) => h.acceptance_length), hs.map((h) => h.at_promotion)] : null;
    chart("health", $("chart-health"), () => ({
      series: [{},
        {label: "now (newest samples, current policy)", stroke: "#4e79a7", width: 2, points: {show: true, size: 5}},
        {label: "at promotion", stroke: "#bab0ac", width: 1, dash: [4, 4], spanGaps: true}],
    }), data, "health", "no staleness records yet");
    const scored = st.drafter_versions.filter((v) => v.baseline_version != null).reverse().slice(0, 12);
    fillTable($("decision-table"), scored.map((v) => el("tr", {"data-version": v.version},
      el("td", {}, "v" + v.version),
      el("td", {}, "v" + v.baseline_version),
      el("td", {}, v.promoted ? "yes" : "no"),
      el("td", {class: "num"}, fmtNum(v.gain_mean, 3)),
      el("td", {class: "num"}, fmtNum(v.gain_lcb, 3)),
      el("td", {class: "num"}, v.pairs == null ? "–" : v.pairs),
      el("td", {}, v.decision || "–"),
    )), "no candidate scored yet", 7);
  }

  function renderStepCharts(st) {
    const acc = stepTables(st.rollout, "acceptance_length");
    chart("steps", $("chart-steps"), () => ({
      scales: {x: {time: false}},
      axes: [{label: "RL step", incrs: INT_INCRS}, {}],
      series: [{label: "step"}, ...lineSeries(acc.workers, {points: {show: true, size: 5}})],
    }), acc.data, acc.workers.join("|"), "no rollout figures yet");
    const sp = stepTables(st.rollout, "speedup");
    const emptySpeedup = st.rollout.length
      ? "workers report no plain-decoding baseline (baseline_tokens_per_s), so no speedup to show"
      : "no rollout figures yet";
    chart("speedup", $("chart-speedup"), () => ({
      scales: {x: {time: false}},
      axes: [{label: "RL step", incrs: INT_INCRS}, {}],
      series: [{label: "step"}, ...lineSeries(sp.workers, {points: {show: true, size: 5}})],
    }), sp.data, sp.workers.join("|"), emptySpeedup);
  }

  // ---- timeline (SVG, drawn here: one lane per GPU, one rect per state segment) ------------------
  function renderTimeline(tl) {
    const box = $("timeline");
    const W = Math.max(400, box.clientWidth || 800);
    const labelW = 120, laneH = 20, gap = 4, axisH = 20, right = 10;
    const H = axisH + tl.gpus.length * (laneH + gap) + gap;
    const x = (t) => labelW + ((t - tl.start) / tl.window_s) * (W - labelW - right);
    const root = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
                             "aria-label": "per-GPU state timeline"});
    const axis = svg("g", {class: "axis"});
    // Ticks every `step` seconds back from now, step chosen for about 6-8 ticks.
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400];
    const step = steps.find((s) => s >= tl.window_s / 8) || steps[steps.length - 1];
    for (let ago = 0; ago <= tl.window_s + 1e-6; ago += step) {
      const t = tl.now - ago;
      axis.append(svg("line", {x1: x(t), x2: x(t), y1: axisH - 4, y2: H}));
      const label = svg("text", {x: x(t), y: axisH - 7, "text-anchor": ago === 0 ? "end" : "middle"});
      label.textContent = ago === 0 ? "now" : (step >= 60 ? "-" + ago / 60 + " min" : "-" + ago + " s");
      axis.append(label);
    }
    root.append(axis);
    tl.gpus.forEach((lane, i) => {
      const y = axisH + gap + i * (laneH + gap);
      const current = lane.segments.length ? lane.segments[lane.segments.length - 1].state : "unknown";
      const g = svg("g", {class: "lane", "data-gpu-id": lane.id, "data-state": current});
      g.append(svg("rect", {x: labelW, y, width: W - labelW - right, height: laneH, class: "lane-bg"}));
      const label = svg("text", {x: 4, y: y + laneH - 6});
      label.textContent = lane.id;
      g.append(label);
      for (const s of lane.segments) {
        const x0 = x(s.start), x1 = x(s.end);
        const r = svg("rect", {x: x0, y, width: Math.max(1, x1 - x0), height: laneH,
                               class: "seg seg-" + s.state, "data-state": s.state});
        const title = svg("title", {});
        title.textContent = `${lane.id}: ${STATE_LABEL[s.state] || s.state}, ${(s.end - s.start).toFixed(1)} s` +
          (s.open ? " (now)" : "");
        r.append(title);
        g.append(r);
      }
      root.append(g);
    });
    if (!tl.gpus.length) {
      box.replaceChildren(el("div", {class: "empty"}, "no GPUs known yet (no telemetry or scheduler state)"));
    } else {
      box.replaceChildren(root);
    }
    box.dataset.rendered = String(tl.gpus.length);
    box.dataset.now = String(tl.now);
  }

  // ---- state → tables and cards -----------------------------------------------------------------
  // Workers whose latest drafter health-guard verdict tripped decode without speculation (outputs stay exact,
  // rollouts run slower) until another version loads and is judged healthy: say so above everything else.
  function renderGuard(st) {
    const off = (st.drafter_guard || []).filter((g) => g.tripped);
    const banner = $("guard-banner");
    banner.hidden = !off.length;
    banner.dataset.workers = off.map((g) => g.worker).join(",");
    if (!off.length) return;
    banner.textContent = `Drafter health guard: speculation off on ${off.length} rollout worker` +
      (off.length > 1 ? "s" : "") + " — " + off.map((g) =>
        `${g.worker}: drafter ${g.version == null ? "" : "v" + g.version} after ${g.event}, ` +
        `${fmtNum(g.live)} tokens/forward` + (g.validated == null ? "" : ` (validated ${fmtNum(g.validated)})`) +
        `, ${fmtAgo(g.ts, st.now)}`).join("; ") +
      ". Outputs stay exact; speculation comes back when a healthy version loads.";
  }

  function renderState(st) {
    $("cluster").textContent = "cluster " + st.cluster;
    $("phase").textContent = st.phase
      ? `${st.phase.phase} · RL step ${st.phase.step} · policy v${st.phase.policy_version}`
      : "no RL phase reported";
    $("simulated-badge").hidden = !st.simulated;
    const hb = $("heartbeat");
    if (st.scheduler_heartbeat_age_s == null) {
      hb.textContent = "no scheduler heartbeat";
      hb.className = "pill bad";
    } else {
      hb.textContent = "scheduler " + st.scheduler_heartbeat_age_s.toFixed(1) + " s ago";
      hb.className = st.scheduler_heartbeat_age_s > 10 ? "pill bad" : "pill";
    }

    renderGuard(st);
    const c = st.counters;
    $("idle-seconds").textContent = fmtGpuSeconds(c.idle_gpu_seconds);
    $("lent-seconds").textContent = fmtGpuSeconds(c.lent_gpu_seconds);
    $("reclaimed-share").textContent = c.reclaimed_share == null ? "–" : (100 * c.reclaimed_share).toFixed(1) + " %";
    $("session-counts").textContent = `${c.sessions_started} / ${c.sessions_stopped} / ${c.sessions_preempted} / ${c.sessions_declined}`;
    const cur = st.drafter_current;
    $("drafter-current").textContent = cur ? `v${cur.version} (${fmtNum(cur.acceptance_length)})` : "none";
    $("lineage-head").textContent = st.lineage ? `${st.lineage.steps} / ${st.lineage.merges}` : "–";
    $("sample-stream").textContent = st.samples
      ? `${st.samples.length}` + (st.samples.newest_policy_version == null ? "" :
        ` (v${st.samples.oldest_policy_version}–v${st.samples.newest_policy_version})`) : "–";
    const withSpeedup = st.rollout.filter((p) => p.speedup != null);
    $("speedup-latest").textContent = withSpeedup.length
      ? fmtNum(withSpeedup[withSpeedup.length - 1].speedup) + "×" : "–";

    fillTable($("gpu-table"), st.gpus.map((g) => el("tr", {"data-gpu-id": g.id, "data-state": g.state},
      el("td", {}, g.id),
      el("td", {}, stateBadge(g.state)),
      el("td", {}, fmtAgo(g.state_since, st.now)),
      el("td", {class: "num"}, g.util == null ? "–" : g.util.toFixed(0) + " %"),
      el("td", {class: "num"}, g.mem_used == null ? "–" : `${fmtBytes(g.mem_used)} / ${fmtBytes(g.mem_total)}`),
      el("td", {}, g.worker || "–"),
      el("td", {}, g.session_id || "–"),
      el("td", {}, g.simulated == null ? "none" : (g.error ? "error: " + g.error : (g.simulated ? "simulated" : "NVML"))
        + (g.device ? ` (share of ${g.device}; device NVML ${g.device_util == null ? "–" : g.device_util.toFixed(0) + " %"}`
           + `, ${g.device_mem_used == null ? "–" : fmtBytes(g.device_mem_used)})` : "")),
    )), "no GPUs known yet", 8);

    $("sessions-total").textContent = st.sessions_total > st.sessions.length
      ? `(latest ${st.sessions.length} of ${st.sessions_total})` : `(${st.sessions_total})`;
    fillTable($("session-table"), st.sessions.map((s) => el("tr", {"data-session-id": s.session_id},
      el("td", {}, s.session_id),
      el("td", {}, `${s.node}:${s.gpu}`),
      el("td", {}, s.status),
      el("td", {class: "num"}, s.step),
      el("td", {class: "num"}, fmtNum(s.loss, 4)),
      el("td", {class: "num"}, s.tokens),
      el("td", {}, fmtAgo(s.started_at, st.now)),
      el("td", {}, s.stop_reason || "–"),
      el("td", {class: "num"}, s.stop_latency_s == null ? "–" : s.stop_latency_s.toFixed(3) + " s"),
    )), "no training sessions yet", 9);

    fillTable($("dropped-table"), Object.entries(st.dropped).map(([reason, n]) =>
      el("tr", {}, el("td", {}, reason), el("td", {class: "num"}, n))), "nothing dropped", 2);

    const events = $("events");
    events.replaceChildren(...st.events.map((e) => el("li", {},
      el("span", {class: "t"}, fmtAgo(e.ts, st.now)),
      e.kind + (e.node != null ? ` ${e.node}:${e.gpu}` : "") +
        (Object.keys(e.detail).length ? " " + JSON.stringify(e.detail) : ""))));
    if (!st.events.length) events.append(el("li", {class: "empty"}, "no events yet"));

    const latest = new Map();
    for (const p of st.rollout) latest.set(p.worker, p);
    const mix = $("strategy-mix");
    if (!latest.size) {
      mix.replaceChildren(el("div", {class: "empty"}, "no rollout figures yet"));
    } else {
      const table = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "worker"), el("th", {}, "step"),
        el("th", {}, "k"), el("th", {}, "share"), el("th", {}, ""))));
      const body = el("tbody", {});
      for (const [w, p] of [...latest.entries()].sort()) {
        const total = Object.values(p.strategy_mix).reduce((a, b) => a + b, 0);
        const ks = Object.keys(p.strategy_mix).sort((a, b) => Number(a) - Number(b));
        for (const k of ks) {
          const share = total ? p.strategy_mix[k] / total : 0;
          body.append(el("tr", {}, el("td", {}, w), el("td", {class: "num"}, p.step),
            el("td", {class: "num"}, k === "0" ? "0 (plain)" : k),
            el("td", {class: "num"}, (100 * share).toFixed(1) + " %"),
            el("td", {}, el("span", {class: "bar", style: `width:${Math.round(share * 200)}px`}))));
        }
      }
      table.append(body);
      mix.replaceChildren(table);
    }
    renderVersionChart(st);
    renderHealth(st);
    renderStepCharts(st);
  }

  function renderLegend() {
    $("legend").replaceChildren(...STATES.map((s) => el("span", {},
      el("span", {class: "swatch seg-bg-" + s, style: `background: var(--${s})`}), STATE_LABEL[s])));
  }

  async function getJSON(url) {
    const resp = await fetch(url, {cache: "no-store"});
    let body = null;
    try { body = await resp.json(); } catch (e) { /* not JSON */ }
    if (!resp.ok) throw new Error((body && body.error) || `${url}: HTTP ${resp.status}`);
    return body;
  }

  let ticks = 0;
  async function tick() {
    const win = $("window").value;
    try {
      const [st, tl] = await Promise.all([getJSON("/api/state"), getJSON("/api/timeline?window=" + win)]);
      renderState(st);
      renderTimeline(tl);
      renderTelemetryCharts(tl);
      $("error").hidden = true;
      $("updated").textContent = "updated " + new Date(st.now * 1000).toLocaleTimeString();
      ticks += 1;
      document.body.dataset.ticks = String(ticks);
    } catch (e) {
      $("error").textContent = "cannot read the cluster state: " + e.message;
      $("error").hidden = false;
    }
    setTimeout(tick, REFRESH_MS);
  }

  renderLegend();
  $("refresh-every").textContent = (REFRESH_MS / 1000).toFixed(REFRESH_MS % 1000 ? 2 : 0) + " s";
  $("window").addEventListener("change", () => { for (const k of Object.keys(charts)) { charts[k].plot.destroy(); delete charts[k]; } });
  tick();
})();
