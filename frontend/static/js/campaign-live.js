// The organizer's campaign page, live: polls the monitor feed (ops/campaign_monitor.py), updates the
// condition, progress, tables and charts in place, and refreshes the export card when a validation
// adds a version. Text comes ready-made from the server, so the page and the feed say the same thing.
// When the state changes (the scheduler finished it, say) the page reloads for the right buttons.
(function () {
  "use strict";

  const page = document.getElementById("campaign-page");
  const Charts = window.CrowdtrainCharts;
  if (!page) return;
  const POLL_MS = 3000;

  const text = (value, digits) =>
    value === null || value === undefined || !Number.isFinite(Number(value)) ? "–" : Number(value).toFixed(digits);

  function field(path, snapshot) {
    return path.split(".").reduce((v, key) => (v == null ? v : v[key]), snapshot);
  }

  function cell(content) {
    const td = document.createElement("td");
    if (content instanceof Node) td.append(content);
    else td.textContent = content;
    return td;
  }

  function shareCell(row) {
    const bar = document.createElement("span");
    bar.className = "share-bar";
    bar.setAttribute("aria-hidden", "true");
    const fill = document.createElement("span");
    fill.style.width = `${row.share_pct}%`;
    bar.append(fill);
    const td = cell(bar);
    td.append(` ${row.share_text}`);
    return td;
  }

  function fillTable(name, rows, columns) {
    const body = page.querySelector(`[data-live-table="${name}"]`);
    if (!body) return;
    body.replaceChildren(
      ...rows.map((row) => {
        const tr = document.createElement("tr");
        tr.append(...columns.map((column) => column(row)));
        return tr;
      }),
    );
  }

  let charts = null;
  function makeCharts() {
    if (!Charts) return null; // the bundle failed to load: the numbers above still update
    const loss = [
      { label: "Training loss", digits: 3 },
      { label: "Validation loss", digits: 3, dots: true },
    ];
    return {
      byStep: Charts.timeChart(document.getElementById("chart-loss-step"), {
        title: "Loss by step",
        x: { label: "Step", time: false },
        left: { label: "Loss", unit: "nats" },
        series: loss,
        emptyText: "No step yet: the curve starts with the first committed step.",
      }),
      byTime: Charts.timeChart(document.getElementById("chart-loss-time"), {
        title: "Loss over time",
        left: { label: "Loss", unit: "nats" },
        series: loss,
        emptyText: "No step yet: the curve starts with the first committed step.",
      }),
      throughput: Charts.timeChart(document.getElementById("chart-throughput"), {
        title: "Throughput",
        left: { label: "Samples", unit: "per s" },
        series: [{ label: "Samples/s, moving average", unit: "per s", digits: 1 }],
        emptyText: "No rate yet: it needs two committed steps.",
      }),
    };
  }

  let shownSeries = null;
  function drawCharts(series) {
    charts = charts || makeCharts();
    if (!charts) return;
    // The series only change with a step; redrawing the same points every poll would reset the cursor.
    const key = `${series.step.length}:${series.step[series.step.length - 1]}:${series.val_step.length}`;
    if (key === shownSeries) return;
    shownSeries = key;
    const [stepXs, stepYs] = Charts.joinOnX([
      [series.step, series.loss],
      [series.val_step, series.val_loss],
    ]);
    charts.byStep.setData(stepXs, stepYs);
    const [timeXs, timeYs] = Charts.joinOnX([
      [series.time, series.loss],
      [series.val_time, series.val_loss],
    ]);
    charts.byTime.setData(timeXs, timeYs);
    charts.throughput.setData(series.time, [series.samples_per_s]);
    const note = page.querySelector('[data-live="series.note"]');
    if (note && series.steps_per_point > 1) {
      note.dataset.averaged = String(series.steps_per_point);
      note.textContent =
        `Each point of the training curves averages ${series.steps_per_point} consecutive steps, so a long run ` +
        "stays readable; validation loss is measured on the held-out split.";
    }
  }

  function show(snapshot) {
    for (const node of page.querySelectorAll("[data-live]")) {
      const value = field(node.dataset.live, snapshot);
      if (value === undefined) continue;
      node.textContent = value == null ? "" : String(value);
      if ("hideEmpty" in node.dataset) node.hidden = !value;
    }
    const condition = page.querySelector('[data-testid="condition"]');
    if (condition) {
      condition.className = `condition condition-${snapshot.condition.level}`;
      condition.dataset.code = snapshot.condition.code;
    }
    // The header's state badge follows the condition's colour (never green beside a red condition).
    const badge = document.querySelector('[data-testid="state"]');
    if (badge) {
      const level = snapshot.condition.level;
      badge.classList.toggle("state-trouble", level === "critical");
      badge.classList.toggle("state-caution", level === "warning");
    }
    const p = snapshot.progress;
    const set = (name, value) => {
      for (const node of page.querySelectorAll(`[data-stat="${name}"]`)) node.textContent = value;
    };
    set("committed_steps", p.committed_steps);
    set("elapsed", p.elapsed_text);
    set("eta", p.eta_text || "–");
    set("samples_per_s", text(p.samples_per_s, 1));
    set("average_samples_per_s", text(p.average_samples_per_s, 1));
    set("checkpoint", p.checkpoint_text);
    set("samples", p.samples);
    set("contributors", snapshot.contributors.count);
    set("active_leases", snapshot.leases.count);
    set("train_loss", text(p.train_loss, 3));
    set("val_loss", text(p.val_loss, 3));
    const bar = page.querySelector("[data-live-progress]");
    if (bar && p.fraction !== null) bar.value = p.fraction;

    fillTable("contributors", snapshot.contributors.top, [
      (r) => cell(String(r.rank)),
      (r) => cell(r.name),
      shareCell,
      (r) => cell(String(r.credit)),
    ]);
    page.querySelector('[data-testid="no-contributors"]').hidden = snapshot.contributors.count > 0;
    fillTable("leases", snapshot.leases.rows, [
      (r) => cell(String(r.id)),
      (r) => cell(r.volunteer),
      (r) => cell(String(r.samples)),
      (r) => cell(r.age_text),
      (r) => cell(r.deadline_text),
    ]);
    page.querySelector('[data-testid="no-leases"]').hidden = snapshot.leases.count > 0;
    drawCharts(snapshot.series);
  }

  // A new validation result comes with new weights to export: swap in the server's export card.
  async function refreshExports() {
    try {
      const response = await fetch(window.location.href, { headers: { Accept: "text/html" } });
      if (!response.ok) return;
      const html = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = html.querySelector('[data-testid="export"]');
      const current = document.querySelector('[data-testid="export"]');
      if (fresh && current) current.replaceWith(fresh);
    } catch (err) {
      // the next validation tries again
    }
  }

  let shownValidations = null;
  async function poll() {
    if (!document.hidden) {
      try {
        const response = await fetch(page.dataset.monitorUrl, { headers: { Accept: "application/json" } });
        if (response.ok) {
          const snapshot = await response.json();
          if (snapshot.state !== page.dataset.state) {
            window.location.reload();
            return;
          }
          show(snapshot);
          const validations = snapshot.series.val_step.length;
          if (validations !== shownValidations) {
            if (shownValidations !== null) refreshExports();
            shownValidations = validations;
          }
        }
      } catch (err) {
        // The site restarting is no reason to stop watching: try again at the next tick.
      }
    }
    window.setTimeout(poll, POLL_MS);
  }

  const initial = JSON.parse(document.getElementById("campaign-live").textContent);
  shownValidations = initial.series.val_step.length;
  show(initial);
  window.setTimeout(poll, POLL_MS);
})();
