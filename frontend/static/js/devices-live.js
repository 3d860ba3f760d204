// My devices updates in place: the list's data-feed URL (/devices/status) returns each device's state now,
// speed, samples and recent leases, already worded by the site; polled every 5 s while the tab is visible.
// A failed poll (the site restarting, the network gone) is tried again with a growing pause; a 403 means the
// session ended, and polling stops until the page is reloaded.
(function () {
  "use strict";
  const list = document.querySelector(".device-list[data-feed]");
  if (!list) return;
  const feedState = document.querySelector("[data-live=feed-state]");
  const EVERY_MS = 5000;
  const MAX_PAUSE_MS = 60000;
  let failures = 0;
  let timer = null;
  let busy = false; // a poll is on its way: coming back to the tab must not start a second
  let stopped = false;

  function say(text) {
    if (feedState && feedState.textContent !== text) feedState.textContent = text;
  }

  function setText(section, name, text) {
    const el = section.querySelector(`[data-live="${name}"]`);
    if (el && el.textContent !== text) el.textContent = text;
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    return td;
  }

  function renderLeases(section, leases) {
    const body = section.querySelector("[data-live=leases]");
    const table = section.querySelector("[data-live=lease-table]");
    const none = section.querySelector("[data-live=no-leases]");
    if (!body) return;
    const rows = leases.map((lease) => {
      const tr = document.createElement("tr");
      tr.append(
        cell(String(lease.id)), cell(lease.campaign.name), cell(lease.samples_text, "num"),
        cell(lease.state), cell(lease.finished), cell(lease.compute_text, "num"),
      );
      return tr;
    });
    body.replaceChildren(...rows);
    if (table) table.hidden = rows.length === 0;
    if (none) none.hidden = rows.length > 0;
  }

  function render(feed) {
    for (const device of feed.devices) {
      const section = list.querySelector(`[data-device="${device.id}"]`);
      if (!section) continue; // added since the page loaded: a reload shows it with its forms
      const badge = section.querySelector("[data-live=badge]");
      if (badge && !device.revoked) {
        badge.textContent = device.online ? "online now" : "offline";
        badge.className = device.online ? "badge badge-online" : "badge badge-offline";
      }
      setText(section, "now", device.now_text);
      setText(section, "wait", device.wait_text);
      setText(section, "speed", device.speed.text);
      setText(section, "samples", device.samples_accepted_text);
      setText(section, "last-seen", device.last_seen_text);
      renderLeases(section, device.leases);
    }
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = document.visibilityState === "visible" && !stopped ? setTimeout(poll, ms) : null;
  }

  async function poll() {
    timer = null;
    if (busy) return;
    busy = true;
    try {
      const response = await fetch(list.dataset.feed, {
        headers: {Accept: "application/json"}, credentials: "same-origin", cache: "no-store",
      });
      if (response.status === 403) {
        say("You are signed out: sign in again and reload this page to see your devices live.");
        stopped = true; // every further poll would be refused the same way
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      failures = 0;
      say("This page updates itself every few seconds.");
      schedule(EVERY_MS);
    } catch (e) {
      failures += 1;
      const pause = Math.min(MAX_PAUSE_MS, EVERY_MS * 2 ** Math.min(failures, 4));
      say(`Cannot reach the site (${e.message || e}); trying again in ${Math.round(pause / 1000)} s.`);
      schedule(pause);
    } finally {
      busy = false;
    }
  }

  // Hidden tabs cost the site nothing; coming back shows the news at once.
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") schedule(0);
    else { clearTimeout(timer); timer = null; }
  });
  schedule(EVERY_MS);
})();
