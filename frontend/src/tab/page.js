// The "Compute in this tab" page: checks the browser can do it, gets the tab a device token, starts the
// worker and shows what it does. Everything slow runs in the worker (worker.js); this page stays responsive.

import { HIDDEN_RELEASE_S, memoryRefusal } from "./control.js";

// (module (func (result v128) v128.const i32x4 0 0 0 0)): valid only where WebAssembly SIMD is.
const SIMD_PROBE = new Uint8Array([
  0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 22, 1, 20, 0, 253, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 11,
]);

/** Whether this browser runs WebAssembly with SIMD, which onnxruntime-web's wasm build needs. */
export function hasWasmSimd() {
  try {
    return typeof WebAssembly === "object" && WebAssembly.validate(SIMD_PROBE);
  } catch {
    return false;
  }
}

const tokenKey = (config) => `crowdtrain.tab.token.${config.user_id ?? "me"}`;
// The training FLOP/s this browser reached on its last visit: the next hello says it, so the site sizes the
// first lease from the tab's own speed rather than the smallest lease.
const FLOPS_KEY = "crowdtrain.tab.flops";

function csrfToken() {
  return document.cookie.split("; ").find((c) => c.startsWith("csrftoken="))?.slice("csrftoken=".length) ?? "";
}

/** The tab's device token: from localStorage, or a new device of the volunteer (POST /devices/tab/). */
async function deviceToken(config) {
  const kept = localStorage.getItem(tokenKey(config));
  if (kept) return kept;
  const answer = await fetch(config.tab_device_url, {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
    body: JSON.stringify({ campaign_id: config.campaign_id }),
  });
  let body = {};
  try {
    body = await answer.json();
  } catch {
    // an HTML error page: the status says enough
  }
  if (answer.status !== 201 || typeof body.token !== "string") {
    throw new Error(body.error || body.detail || `the site could not register this tab as a device (HTTP ${answer.status}); reload the page to try again`);
  }
  localStorage.setItem(tokenKey(config), body.token);
  return body.token;
}

function main() {
  const config = JSON.parse(document.getElementById("tab-config").textContent);
  const $ = (id) => document.getElementById(id);
  const show = (id, text) => {
    const el = $(id);
    if (el) el.textContent = text;
  };
  const button = $("tab-pause");
  const panel = document.querySelector("[data-testid=\"tab-panel\"]") ?? document.body;
  const say = (text) => show("tab-status", text);
  const refuse = (text) => {
    say(text);
    $("tab-problem").textContent = text;
    $("tab-problem").hidden = false;
    button.disabled = true;
  };

  if (!hasWasmSimd()) {
    refuse("This browser cannot compute here: it lacks WebAssembly SIMD. Update it (Chrome 91+, Firefox 89+, Safari 16.4+) or run the Python agent.");
    return;
  }
  if (typeof Worker !== "function") {
    refuse("This browser cannot compute here: it has no Web Workers. Run the Python agent instead.");
    return;
  }

  let worker = null;
  let userPaused = false;
  let keptText = localStorage.getItem(FLOPS_KEY) ?? ""; // the worker checks it (plausibleFlops)
  let hiddenTimer = null;

  const onWorker = (event) => {
    const m = event.data;
    if (m.type === "status") {
      say(m.text);
      show("tab-speed", m.samplesPerS ? `${m.samplesPerS.toFixed(1)} samples/s` : "not measured yet");
      show("tab-leases", String(m.leasesDone));
      show("tab-credit", m.credit ? m.credit.toFixed(1) : `${m.samplesDone} samples counted`);
      const flops = m.flopsPerS > 0 ? String(Math.round(m.flopsPerS)) : "";
      if (flops && flops !== keptText) localStorage.setItem(FLOPS_KEY, (keptText = flops)); // once a lease, not per status
      // The leases in hand, for whoever inspects the page (and the test that closes the tab mid-lease):
      // data-lease the oldest (the one reporting while the next computes), data-leases all, oldest first.
      panel.dataset.lease = m.leaseId === null || m.leaseId === undefined ? "" : String(m.leaseId);
      panel.dataset.leases = (m.leaseIds ?? []).join(" ");
    } else if (m.type === "token_refused") {
      localStorage.removeItem(tokenKey(config));
      refuse(`The site refused this tab: ${m.why}. Reload the page to register it again as a new device.`);
    } else if (m.type === "stopped") {
      say(m.why);
      button.disabled = true;
    }
  };

  async function start() {
    say("checking what this campaign's model needs");
    const info = await fetch(config.browser_api_url, { credentials: "same-origin" }).then((a) => (a.ok ? a.json() : null)).catch(() => null);
    if (info?.status === "refused") return refuse(`Browser compute is not offered for this campaign: ${info.reason}`);
    const tooBig = info ? memoryRefusal(info.memory_bytes, navigator.deviceMemory) : "";
    if (tooBig) return refuse(`${tooBig[0].toUpperCase()}${tooBig.slice(1)}.`);
    say("registering this tab as one of your devices");
    const token = await deviceToken(config);
    const webgpu = Boolean(config.webgpu && navigator.gpu && (await navigator.gpu.requestAdapter().catch(() => null)));
    worker = new Worker(config.worker_url, { type: "module", name: "crowdtrain-tab" });
    worker.onmessage = onWorker;
    worker.onerror = (event) => refuse(`The tab's worker failed to start: ${event.message || "see the browser console"}.`);
    worker.postMessage({ type: "start", config, token, webgpu, flopsPerS: keptText });
    button.disabled = false;
  }

  button.addEventListener("click", () => {
    userPaused = !userPaused;
    worker?.postMessage(userPaused ? { type: "pause", why: "you paused this tab" } : { type: "resume" });
    button.textContent = userPaused ? "Resume" : "Pause";
  });
  // A tab in the background is throttled and may be discarded: after a minute hidden its lease goes back.
  document.addEventListener("visibilitychange", () => {
    clearTimeout(hiddenTimer);
    if (document.visibilityState === "hidden") {
      hiddenTimer = setTimeout(() => worker?.postMessage({ type: "pause", why: "the tab was hidden for more than a minute" }), HIDDEN_RELEASE_S * 1000);
    } else if (!userPaused) {
      worker?.postMessage({ type: "resume" });
    }
  });
  // Closing the tab: its leases are given back at once rather than at their deadline, the one whose
  // gradient is uploading too (the upload will not finish once the tab is gone).
  window.addEventListener("pagehide", () => worker?.postMessage({ type: "pause", why: "the tab is closing", closing: true }));

  start().catch((error) => refuse(error.message));
}

if (typeof document !== "undefined" && document.getElementById("tab-config")) main();
