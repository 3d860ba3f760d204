// The admin dashboard: one WebSocket (/ws/dashboard/) pushes a snapshot every few seconds;
// every number, table, alert and chart on the page is updated in place from it, never by a
// reload. The charts are the site's bundle (static/build/charts.js, uPlot from npm). A closed
// socket is reopened with exponential backoff and jitter; the page says so meanwhile.
(function () {
  "use strict";

  const root = document.getElementById("dashboard");
  if (!root || !window.CrowdtrainCharts) return;
  const Charts = window.CrowdtrainCharts;
  const charts = {}; // id -> TimeChart, kept across snapshots

  // ------------------------------------------------------------------ small helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function field(name, text) {
    for (const node of root.querySelectorAll(`[data-field="${name}"]`)) node.textContent = text;
  }

  function testid(name) {
    return root.querySelector(`[data-testid="${name}"]`);
  }

  function num(value, digits) {
    if (value == null || !Number.isFinite(value)) return "–";
    return Number(value).toFixed(digits);
  }

  function bytes(value) {
    if (value == null) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let v = value;
    let i = 0;
    while (v >= 1000 && i < units.length - 1) {
      v /= 1000;
      i += 1;
    }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function ago(seconds) {
    if (seconds == null) return "never";
    if (seconds < 90) return `${Math.round(seconds)} s ago`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
    return `${(seconds / 3600).toFixed(1)} h ago`;
  }

  function fillRows(tbody, rows, empty, columns) {
    const cells = rows.map((row) => el("tr", {}, ...columns(row).map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: String(c) })))));
    if (!cells.length) cells.push(el("tr", {}, el("td", { colspan: String(tbody.closest("table").querySelectorAll("th").length), class: "muted", text: empty })));
    tbody.replaceChildren(...cells);
  }

  function chart(id, container, options) {
    if (!charts[id]) charts[id] = Charts.timeChart(container, options);
    return charts[id];
  }

  // ------------------------------------------------------------------ sections

  function showAlerts(snapshot) {
    const list = testid("alerts");
    const items = snapshot.alerts.map((alert) =>
      el(
        "li",
        { class: `dash-alert dash-alert-${alert.severity}`, "data-testid": "alert", "data-code": alert.code },
        el("strong", { text: `${alert.severity === "critical" ? "Critical" : "Warning"}: ${alert.code.replaceAll("_", " ")}` }),
        el("p", { text: alert.message }),
        el("p", { class: "dash-what" }, el("strong", { text: "What to do: " }), alert.what_to_do),
      ),
    );
    list.replaceChildren(...items);
    testid("no-alerts").hidden = items.length > 0;
    // The badge says what is wrong ("aggregator down", "no volunteers"), coloured by how bad it is.
    field("status", snapshot.summary || snapshot.status);
    testid("status").dataset.status = snapshot.status;
  }

  function showSwarm(snapshot) {
    const agents = snapshot.agents;
    field("agents_online", String(agents.online));
    const kinds = Object.entries(agents.by_kind).map(([kind, n]) => `${kind} ${n}`);
    field("by_kind", kinds.length ? kinds.join(", ") : "–");
    const queue = snapshot.celery.queue;
    field("queue_depth", queue.depth == null ? queue.note : `${queue.depth} waiting`);
    testid("queue-depth").classList.toggle("dash-note", queue.depth == null);
    const s = snapshot.series;
    chart("agents", document.getElementById("chart-agents"), {
      title: "Agents online, joins and departures",
      left: { label: "Agents", unit: "count" },
      series: [
        { label: "Online (peak)", digits: 0 },
        { label: "Joined", digits: 0 },
        { label: "Left", digits: 0 },
      ],
    }).setData(s.t, [s.agents, s.joins, s.departures]);
    chart("outcomes", document.getElementById("chart-outcomes"), {
      title: `Lease outcomes (per ${Math.round(s.bucket_s / 60)} min)`,
      left: { label: "Leases", unit: `per ${Math.round(s.bucket_s / 60)} min` },
      series: [
        { label: "Accepted", digits: 0, color: "#16a34a" },
        { label: "Expired", digits: 0, color: "#ea580c" },
        { label: "Released", digits: 0, color: "#4b5563" },
        { label: "Rejected", digits: 0, color: "#dc2626" },
      ],
    }).setData(s.t, [s.outcomes.accepted, s.outcomes.expired, s.outcomes.released, s.outcomes.rejected]);
  }

  function campaignBox(campaign) {
    const box = el(
      "article",
      { class: "card dash-campaign", "data-testid": "campaign", "data-campaign": String(campaign.id) },
      el("h3", { "data-part": "title" }),
      el(
        "dl",
        { class: "dash-stats" },
        el("div", {}, el("dt", { text: "Steps" }), el("dd", { "data-part": "steps", "data-testid": `steps-${campaign.id}` })),
        el("div", {}, el("dt", { text: "Steps per minute" }), el("dd", { "data-part": "steps_per_min" })),
        el("div", {}, el("dt", { text: "Samples per second" }), el("dd", { "data-part": "samples_per_s" })),
        el("div", {}, el("dt", { text: "Training loss" }), el("dd", { "data-part": "training_loss" })),
        el("div", {}, el("dt", { text: "Validation loss" }), el("dd", { "data-part": "validation_loss" })),
      ),
      el(
        "div",
        { class: "dash-charts" },
        el("div", { class: "dash-chart", "data-part": "throughput", "data-testid": `chart-throughput-${campaign.id}` }),
        el("div", { class: "dash-chart", "data-part": "loss", "data-testid": `chart-loss-${campaign.id}` }),
      ),
    );
    return box;
  }

  function showCampaigns(snapshot) {
    const holder = testid("campaigns");
    const seen = new Set();
    for (const campaign of snapshot.campaigns) {
      const key = String(campaign.id);
      seen.add(key);
      let box = holder.querySelector(`[data-campaign="${key}"]`);
      if (!box) {
        box = campaignBox(campaign);
        holder.append(box);
      }
      const part = (name) => box.querySelector(`[data-part="${name}"]`);
      part("title").textContent = `${campaign.name} (#${campaign.id}, ${campaign.state})`;
      part("steps").textContent = String(campaign.committed_steps);
      part("steps_per_min").textContent = num(campaign.steps_per_min, 1);
      part("samples_per_s").textContent = num(campaign.samples_per_s, 1);
      part("training_loss").textContent = num(campaign.training_loss, 4);
      part("validation_loss").textContent = num(campaign.validation_loss, 4);
      const s = snapshot.series;
      const columns = s.campaigns[key] || { steps_per_min: [], samples_per_s: [], loss: [], val_loss: [] };
      chart(`throughput-${key}`, part("throughput"), {
        title: "Throughput",
        left: { label: "Steps", unit: "per min" },
        right: { label: "Samples", unit: "per s" },
        series: [
          { label: "Steps", unit: "per min", digits: 1 },
          { label: "Samples", unit: "per s", axis: "right", digits: 1 },
        ],
      }).setData(s.t, [columns.steps_per_min, columns.samples_per_s]);
      const loss = chart(`loss-${key}`, part("loss"), {
        title: "Loss",
        left: { label: "Loss", unit: "nats per sample" },
        series: [
          { label: "Training", digits: 4 },
          { label: "Validation", digits: 4 },
        ],
      });
      loss.setData(s.t, [columns.loss, columns.val_loss]);
      // What a watcher (and the browser test) can compare between two pushes: the newest point drawn.
      const drawn = columns.loss.filter((v) => v != null);
      part("loss").dataset.signature = `${drawn.length}:${drawn.length ? drawn[drawn.length - 1] : ""}`;
    }
    for (const box of holder.querySelectorAll("[data-campaign]")) {
      if (!seen.has(box.dataset.campaign)) {
        for (const name of ["throughput", "loss"]) {
          const id = `${name}-${box.dataset.campaign}`;
          if (charts[id]) charts[id].destroy();
          delete charts[id];
        }
        box.remove();
      }
    }
    testid("no-campaigns").hidden = snapshot.campaigns.length > 0;
  }

  function showTables(snapshot) {
    fillRows(testid("aggregators"), snapshot.aggregators, "No aggregator has joined yet.", (a) => [
      a.name,
      el("span", { class: a.healthy ? "dash-good" : "dash-bad", text: a.healthy ? "healthy" : a.connected ? "silent" : "disconnected" }),
      a.heartbeat_age_s == null ? "never" : `${num(a.heartbeat_age_s, 1)} s`,
      bytes(a.memory_bytes),
      a.pending_bytes == null ? "–" : `${bytes(a.pending_bytes)} of ${bytes(a.pending_bytes_limit)}`,
      a.ingest_mb_s == null ? "–" : `${num(a.ingest_mb_s, 2)} MB/s`,
      a.versions_held == null ? (a.probe_error || "–") : String(a.versions_held),
      a.slices.join("; ") || "–",
    ]);
    fillRows(testid("lease-reasons"), snapshot.lease_reasons, "No lease ended in the last hour.", (r) => [r.state, r.reason, r.count]);
    fillRows(testid("agents"), snapshot.agents.recent, "No agent has been seen yet.", (a) => [
      a.name,
      a.volunteer,
      a.kind,
      a.samples_per_s == null ? "–" : `${num(a.samples_per_s, 1)} samples/s`,
      a.online ? `online (${ago(a.last_seen_s)})` : ago(a.last_seen_s),
    ]);
    fillRows(testid("errors"), snapshot.errors, "No error in the last hour.", (e) => [
      new Date(e.at * 1000).toISOString().replace("T", " ").slice(0, 19),
      e.logger,
      e.message,
    ]);
    fillRows(testid("task-failures"), snapshot.celery.failures, "No Celery task has failed.", (f) => [f.task, f.count, ago(f.last_s_ago)]);
  }

  function show(snapshot) {
    showAlerts(snapshot);
    showSwarm(snapshot);
    showCampaigns(snapshot);
    showTables(snapshot);
    const when = new Date(snapshot.at * 1000).toISOString().slice(11, 19);
    testid("connection").textContent = `Live, updated ${when} UTC`;
  }

  // ------------------------------------------------------------------ the socket

  let tries = 0;

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${root.dataset.wsPath}`);
    socket.addEventListener("open", () => {
      tries = 0;
    });
    socket.addEventListener("message", (event) => {
      try {
        show(JSON.parse(event.data));
      } catch (error) {
        console.error("dashboard: cannot show a snapshot", error);
      }
    });
    socket.addEventListener("close", (event) => {
      if (event.code === 4003) {
        testid("connection").textContent = "Only admins see the dashboard; log in again as an admin.";
        return;
      }
      tries += 1;
      const delay = Math.min(30000, 1000 * 2 ** Math.min(tries - 1, 5)) * (0.5 + Math.random() / 2);
      testid("connection").textContent = `Disconnected; retrying in ${Math.round(delay / 1000)} s`;
      setTimeout(connect, delay);
    });
  }

  connect();
})();
