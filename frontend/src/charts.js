// Crowdtrain's time-series charts: uPlot with the site's defaults, bundled by esbuild (npm run build)
// into static/build/charts.js as the global CrowdtrainCharts.
//
// Why uPlot: time series are all we draw, and it draws a week of per-minute points from
// typed arrays in a few milliseconds at ~50 kB minified, with no dependencies; it is
// maintained (MIT, regular releases). Chart.js is larger and slower on long series.
//
// What the wrapper adds: axis labels that carry their unit, an honest empty state
// ("No data yet" instead of a blank box), and updates in place (setData / append) so a
// live page never rebuilds its charts.
import uPlot from "uplot";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];

function axisLabel(label, unit) {
  return unit ? `${label} (${unit})` : label;
}

function formatValue(value, digits) {
  if (value == null || !Number.isFinite(value)) return "–";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return value.toExponential(2);
  return value.toFixed(digits);
}

/**
 * One time-series chart in `container`.
 *
 * options:
 *   title      heading drawn above the plot
 *   series     [{label, unit, axis: "left" | "right", digits, color, dots}]  (dots: points, no line)
 *   x          {label, unit, time}  the x axis (default: time in Unix seconds, labelled "Time (UTC)");
 *              time: false for a plain number such as a step
 *   left       {label, unit}  the left y axis (required)
 *   right      {label, unit}  an optional right y axis for series with axis: "right"
 *   emptyText  shown while there is no point yet (default "No data yet")
 *   height     pixels (default 220)
 */
export class TimeChart {
  constructor(container, options) {
    this.container = container;
    this.options = options;
    this.xs = [];
    this.ys = options.series.map(() => []);
    container.classList.add("ct-chart");

    this.empty = document.createElement("p");
    this.empty.className = "ct-chart-empty";
    this.empty.textContent = options.emptyText || "No data yet";
    this.empty.setAttribute("data-testid", "chart-empty");

    this.plotBox = document.createElement("div");
    this.plotBox.className = "ct-chart-plot";
    container.append(this.plotBox, this.empty);

    const x = options.x || { label: "Time (UTC)", time: true };
    const scales = { x: { time: x.time !== false }, left: { auto: true } };
    const axes = [
      { label: axisLabel(x.label, x.unit), labelSize: 18, stroke: "#374151", grid: { stroke: "#e5e7eb" } },
      {
        scale: "left",
        label: axisLabel(options.left.label, options.left.unit),
        labelSize: 18,
        size: 60,
        stroke: "#374151",
        grid: { stroke: "#e5e7eb" },
      },
    ];
    if (options.right) {
      scales.right = { auto: true };
      axes.push({
        scale: "right",
        side: 1,
        label: axisLabel(options.right.label, options.right.unit),
        labelSize: 18,
        size: 60,
        stroke: "#374151",
        grid: { show: false },
      });
    }
    const series = [
      { label: x.label || "Time" },
      ...options.series.map((s, i) => {
        const color = s.color || PALETTE[i % PALETTE.length];
        const one = {
          label: axisLabel(s.label, s.unit),
          scale: s.axis === "right" ? "right" : "left",
          stroke: color,
          width: 2,
          spanGaps: true,
          // uPlot's default: dots only while points are sparse, so a lone first minute still shows.
          value: (u, v) => formatValue(v, s.digits == null ? 2 : s.digits),
        };
        if (s.dots) {
          // Occasional measurements (a validation loss every N steps): dots, never a line between them.
          one.paths = () => null;
          one.points = { show: true, size: 7, fill: color, stroke: color };
        }
        return one;
      }),
    ];
    this.plot = new uPlot(
      {
        title: options.title,
        width: this.width(),
        height: options.height || 220,
        scales,
        axes,
        series,
        legend: { live: true },
        cursor: { drag: { x: false, y: false } },
      },
      [this.xs, ...this.ys],
      this.plotBox,
    );
    this.showEmpty();
    // Charts follow their box's width (a phone, a resized window) without rebuilding.
    if (typeof ResizeObserver !== "undefined") {
      this.resizer = new ResizeObserver(() => this.plot.setSize({ width: this.width(), height: options.height || 220 }));
      this.resizer.observe(container);
    }
  }

  width() {
    return Math.max(240, this.container.clientWidth || 600);
  }

  /** Number of x values drawn now (tests and the page's counters read it). */
  get length() {
    return this.xs.length;
  }

  showEmpty() {
    const hasPoint = this.ys.some((ys) => ys.some((v) => v != null));
    this.empty.hidden = hasPoint;
    this.plotBox.classList.toggle("ct-chart-plot-empty", !hasPoint);
    this.container.dataset.points = String(hasPoint ? this.xs.length : 0);
  }

  /** Replace every point: `xs` in Unix seconds, `ys` one array per series (null: a gap). */
  setData(xs, ys) {
    this.xs = xs.slice();
    this.ys = this.options.series.map((_, i) => (ys[i] || []).slice());
    this.plot.setData([this.xs, ...this.ys]);
    this.showEmpty();
  }

  /** Add one point at the end (or replace the last one if `x` is the same time). */
  append(x, values) {
    const last = this.xs.length - 1;
    if (last >= 0 && this.xs[last] === x) {
      this.ys.forEach((ys, i) => (ys[last] = values[i]));
    } else {
      this.xs.push(x);
      this.ys.forEach((ys, i) => ys.push(values[i]));
    }
    this.plot.setData([this.xs, ...this.ys]);
    this.showEmpty();
  }

  destroy() {
    if (this.resizer) this.resizer.disconnect();
    this.plot.destroy();
    this.container.replaceChildren();
  }
}

export function timeChart(container, options) {
  return new TimeChart(container, options);
}

/**
 * Series measured at different x values (training loss every step, validation loss every tenth) on one
 * x axis: `tables` is [[xs, ys], ...] with each xs ascending; returns [xs, ys1, ys2, ...] with nulls
 * where a series has no point, ready for setData(xs, ys).
 */
export function joinOnX(tables) {
  const joined = uPlot.join(tables.map(([xs, ys]) => [xs, ys]));
  return [Array.from(joined[0]), joined.slice(1).map((ys) => Array.from(ys))];
}

export { uPlot };
