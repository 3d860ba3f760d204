// Loss charts: <svg class="loss-chart" data-losses="a,b,c" data-val-losses="step:loss,..."> draws the
// training loss per step as a line and the held-out validation loss as dots. Used by the public
// campaign list and the organizer's campaign page (which redraws it from the progress feed).
(function () {
  "use strict";

  const SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }

  // Validation points come as numbers (one per entry), [step, loss] pairs or {step|version, loss} objects.
  function normalizeValidation(points) {
    return (points || []).map((p, i) => {
      if (typeof p === "number") return [i + 1, p];
      if (Array.isArray(p)) return [Number(p[0]), Number(p[1])];
      return [Number(p.step ?? p.version ?? i + 1), Number(p.loss ?? p.val_loss)];
    }).filter(([s, l]) => Number.isFinite(s) && Number.isFinite(l));
  }

  function draw(svg, losses, validation) {
    svg.replaceChildren();
    const val = normalizeValidation(validation);
    const all = losses.concat(val.map((p) => p[1]));
    if (!all.length) return;
    const lo = Math.min(...all), hi = Math.max(...all);
    const steps = Math.max(losses.length, ...val.map((p) => p[0]), 2);
    const x = (step) => 10 + 580 * (step - 1) / (steps - 1);
    const y = (loss) => 150 - 140 * (loss - lo) / ((hi - lo) || 1);
    if (losses.length) {
      const pts = losses.map((l, i) => `${x(i + 1)},${y(l)}`);
      svg.appendChild(el("polyline", {points: pts.join(" "), fill: "none", stroke: "#2a6fdb", "stroke-width": 2}));
    }
    for (const [step, loss] of val) {
      const dot = el("circle", {cx: x(step), cy: y(loss), r: 3.5, fill: "#c0392b", class: "val-point"});
      const title = el("title", {});
      title.textContent = `validation loss ${loss.toFixed(3)} at step ${step}`;
      dot.appendChild(title);
      svg.appendChild(dot);
    }
    // Axis labels: the loss at the top and bottom of the chart, and the step count.
    const label = (lx, ly, text, anchor) => {
      const t = el("text", {x: lx, y: ly, "font-size": 11, fill: "#666", "text-anchor": anchor});
      t.textContent = text;
      svg.appendChild(t);
    };
    label(596, 12, `loss ${hi.toFixed(2)}`, "end");
    label(596, 136, `${lo.toFixed(2)}`, "end");
    label(12, 156, "step 1", "start");
    label(596, 156, `step ${steps}`, "end");
  }

  function parseAttr(text) {
    if (!text) return [];
    return text.split(",").map((part) => part.includes(":") ? part.split(":").map(Number) : Number(part));
  }

  window.crowdtrainLossChart = {draw};
  for (const svg of document.querySelectorAll("svg.loss-chart")) {
    draw(svg, parseAttr(svg.dataset.losses), parseAttr(svg.dataset.valLosses));
  }
})();
