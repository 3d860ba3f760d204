// The campaign list (campaigns/index.html): each card's loss by step, drawn with the chart bundle from the
// series the page embeds (the monitor's downsampled one: training loss per step, validation loss as dots),
// then kept current from the card's progress feed every few seconds: the figures and the chart change in
// place, and the page never reloads (a reader's place and the charts stay put).
(function () {
  "use strict";

  const REFRESH_MS = 5000;
  const Charts = window.CrowdtrainCharts;

  function draw(chart, series) {
    if (!chart) return;
    const [xs, ys] = Charts.joinOnX([
      [series.step, series.loss],
      [series.val_step, series.val_loss],
    ]);
    chart.setData(xs, ys);
  }

  function show(card, chart, p) {
    const set = (name, text) => {
      const node = card.querySelector(`[data-field="${name}"]`);
      if (node) node.textContent = text;
    };
    set("state", p.state);
    set("committed_steps", String(p.committed_steps));
    set("version", String(p.version));
    set("samples", String(p.samples));
    set("samples_per_s", Number(p.samples_per_s).toFixed(1));
    set("contributors", String(p.contributors));
    const losses = card.querySelector('[data-field="losses"]');
    if (losses && p.losses.length) {
      const first = p.losses[0].toFixed(3);
      const last = p.losses[p.losses.length - 1].toFixed(3);
      losses.textContent = `training loss ${first} \u2192 ${last}`;
      losses.hidden = false;
    }
    draw(chart, p.series);
    card.dataset.updatedAt = String(Date.now());
  }

  for (const card of document.querySelectorAll("[data-progress-url]")) {
    const box = card.querySelector("[data-series]");
    const source = box && document.getElementById(box.dataset.series);
    let chart = null;
    if (Charts && source) {
      chart = Charts.timeChart(box, {
        title: "Loss by step",
        x: { label: "Step", time: false },
        left: { label: "Loss", unit: "nats" },
        series: [
          { label: "Training loss", digits: 3 },
          { label: "Validation loss", digits: 3, dots: true },
        ],
        emptyText: "No step yet: the curve starts with the first committed step.",
      });
      draw(chart, JSON.parse(source.textContent));
    }
    const refresh = async () => {
      try {
        const response = await fetch(card.dataset.progressUrl, { headers: { Accept: "application/json" } });
        if (response.ok) show(card, chart, await response.json());
      } catch (error) {
        // Offline for a moment: the figures stay as they were, and the next round tries again.
      }
      setTimeout(refresh, REFRESH_MS);
    };
    setTimeout(refresh, REFRESH_MS);
  }
})();
