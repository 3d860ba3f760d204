// The campaign list (campaigns/index.html): each card's loss by step, drawn with the chart bundle from the
// series the page embeds (the monitor's downsampled one: training loss per step, validation loss as dots).
(function () {
  "use strict";

  const Charts = window.CrowdtrainCharts;
  if (!Charts) return; // the bundle failed to load: the numbers above the chart still say how it goes

  for (const box of document.querySelectorAll("[data-series]")) {
    const source = document.getElementById(box.dataset.series);
    if (!source) continue;
    const series = JSON.parse(source.textContent);
    const chart = Charts.timeChart(box, {
      title: "Loss by step",
      x: { label: "Step", time: false },
      left: { label: "Loss", unit: "nats" },
      series: [
        { label: "Training loss", digits: 3 },
        { label: "Validation loss", digits: 3, dots: true },
      ],
      emptyText: "No step yet: the curve starts with the first committed step.",
    });
    const [xs, ys] = Charts.joinOnX([
      [series.step, series.loss],
      [series.val_step, series.val_loss],
    ]);
    chart.setData(xs, ys);
  }
})();
