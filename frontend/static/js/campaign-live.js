// The organizer's campaign page: poll the progress feed, update the numbers and redraw the
// loss chart; refresh the export card when a validation adds a version. When the state changes
// (the scheduler finished it, say) reload for the right buttons.
(function () {
  "use strict";

  const page = document.getElementById("campaign-page");
  const chart = document.getElementById("loss-chart");
  if (!page || !chart) return;
  const POLL_MS = 3000;

  function lastValidation(points) {
    if (!points || !points.length) return null;
    const p = points[points.length - 1];
    if (typeof p === "number") return p;
    if (Array.isArray(p)) return Number(p[1]);
    return Number(p.loss ?? p.val_loss);
  }

  function show(progress) {
    const set = (name, text) => {
      for (const node of page.querySelectorAll(`[data-stat="${name}"]`)) node.textContent = text;
    };
    set("committed_steps", progress.committed_steps);
    set("samples", progress.samples);
    set("samples_per_s", Number(progress.samples_per_s || 0).toFixed(1));
    set("contributors", progress.contributors);
    set("active_leases", progress.active_leases);
    const losses = progress.losses || [];
    set("train_loss", losses.length ? losses[losses.length - 1].toFixed(3) : "–");
    const val = lastValidation(progress.val_loss);
    set("val_loss", val === null || !Number.isFinite(val) ? "–" : val.toFixed(3));
    window.crowdtrainLossChart.draw(chart, losses, progress.val_loss || []);
  }

  async function poll() {
    try {
      const response = await fetch(page.dataset.progressUrl, {headers: {Accept: "application/json"}});
      if (response.ok) {
        const progress = await response.json();
        if (progress.state !== page.dataset.state) {
          window.location.reload();
          return;
        }
        // The server drew the "waiting for aggregators" note at load; a new step means they are there now.
        if (waiting && progress.committed_steps !== initial.committed_steps) waiting.hidden = true;
        show(progress);
        const validations = (progress.val_loss || []).length;
        if (validations !== shownValidations) {
          shownValidations = validations;
          refreshExports();
        }
      }
    } catch (err) {
      // The site restarting is no reason to stop watching: try again at the next tick.
    }
    window.setTimeout(poll, POLL_MS);
  }

  // A new validation result comes with new weights to export: swap in the server's export card.
  async function refreshExports() {
    try {
      const response = await fetch(window.location.href, {headers: {Accept: "text/html"}});
      if (!response.ok) return;
      const html = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = html.querySelector('[data-testid="export"]');
      const current = document.querySelector('[data-testid="export"]');
      if (fresh && current) current.replaceWith(fresh);
    } catch (err) {
      // the next validation tries again
    }
  }

  const waiting = page.querySelector('[data-testid="waiting"]');
  const initial = JSON.parse(document.getElementById("campaign-progress").textContent);
  let shownValidations = (initial.val_loss || []).length;
  show(initial);
  window.setTimeout(poll, POLL_MS);
})();
