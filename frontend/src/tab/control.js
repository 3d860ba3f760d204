// The tab's control channel to the site (/ws/agent/), as plain steps: what to offer, what to say, when to
// wait, when to stop. The worker strings them together; each is testable in Node on its own.

import { hello, noLeaseWhy, offeredSubprotocols, parseMessage, PROTOCOL_MINOR, SITE_TO_TAB } from "./messages.js";

export const ORT_VERSION = "1.30.0";
export const TAB_VERSION = "tab-1"; // agent_version of a tab: the page's build, not the Python agent's
export const LEASE_WAIT_S = 10; // how long the site may hold a lease_request (the agent's LEASE_WAIT_S)
export const HIDDEN_RELEASE_S = 60; // a tab hidden this long gives its lease back
export const GiB = 2 ** 30;
const TOKEN = /^ctd_[A-Za-z0-9_-]{43}$/;

/** Close codes after which reconnecting cannot help: the token is unknown (4001) or the device revoked (4003). */
export const TOKEN_REFUSED = Object.freeze({ 4001: "the site does not know this tab's device token", 4003: "this tab's device was revoked on My devices" });

/**
 * The subprotocols a tab offers: its minors, then its device token (a browser WebSocket cannot set an
 * Authorization header; the site reads the token from this offer and never selects it).
 * @throws {Error} for a token that is not one the site issues (it would not be a valid subprotocol).
 */
export function subprotocolsFor(token) {
  if (!TOKEN.test(token ?? "")) throw new Error("this tab's device token is malformed; reload the page to get a new one");
  return [...offeredSubprotocols(), `crowdtrain.bearer.${token}`];
}

/** What a close of the control socket means: stop for good (token refused) or reconnect. */
export function closeVerdict(code) {
  return Object.hasOwn(TOKEN_REFUSED, code) ? { stop: true, why: TOKEN_REFUSED[code] } : { stop: false, why: `the connection closed (code ${code})` };
}

/** Seconds before reconnect attempt `attempt` (0-based): 1, 2, 4 ... 60, with up to 20% jitter. */
export function backoffS(attempt, random = Math.random) {
  const base = Math.min(60, 2 ** Math.min(attempt, 6));
  return base * (1 + 0.2 * random());
}

/** The runtime string of `hello` (2.10): what computes, as torch_version says it for an agent. */
export function runtimeName(webgpu) {
  return `onnxruntime-web ${ORT_VERSION} ${webgpu ? "webgpu" : "wasm"}`;
}

// Above any browser's training FLOP/s by far (a data-centre GPU trains at ~1e14 in fp32): a figure above it
// came from a tampered or corrupt localStorage, and a hello carrying it past the protocol's bound would be refused.
export const MOST_TAB_FLOPS = 1e15;

/** `value` as a FLOP/s figure a hello may carry: finite, positive and at most MOST_TAB_FLOPS, else 0 (unknown). */
export function plausibleFlops(value) {
  const flops = typeof value === "string" ? Number(value.trim() || NaN) : value;
  return typeof flops === "number" && Number.isFinite(flops) && flops > 0 && flops <= MOST_TAB_FLOPS ? flops : 0;
}

/**
 * The `hello` of this tab (messages.js describes the fields).
 * @param {{userAgent?: string, userAgentData?: object, deviceMemory?: number}} nav the worker's navigator.
 */
export function helloFor(nav, { webgpu = false, flopsPerS = 0, minor = PROTOCOL_MINOR } = {}) {
  const brand = nav.userAgentData?.brands?.find((b) => !/not.?a.?brand/i.test(b.brand) && b.brand !== "Chromium") ?? nav.userAgentData?.brands?.[0];
  const os = nav.userAgentData?.platform || (/(Windows|Mac OS X|Android|Linux|iPhone|iPad)/.exec(nav.userAgent ?? "")?.[1] ?? "unknown OS");
  const browser = brand ? `${brand.brand} ${brand.version}` : ((/(Firefox|Edg|Chrome|Safari)\/(\d+)/.exec(nav.userAgent ?? "") ?? []).slice(1).join(" ") || "browser");
  return hello({
    agentVersion: TAB_VERSION,
    device: {
      name: `${browser} on ${os} (tab)`.slice(0, 200),
      memory_bytes: nav.deviceMemory ? Math.round(nav.deviceMemory * GiB) : 0,
      threads: 1,
      torch_version: "",
      flops_per_s: plausibleFlops(flopsPerS),
      runtime: runtimeName(webgpu),
    },
  }, minor);
}

/** The memory a tab may use: 2 GiB, or half of what the browser says the device has, whichever is less. */
export function tabMemoryBytes(deviceMemoryGiB) {
  return deviceMemoryGiB ? Math.min(2 * GiB, (deviceMemoryGiB / 2) * GiB) : 2 * GiB;
}

/** "" when the campaign's graph fits a tab; else why not, in words for the page. */
export function memoryRefusal(memoryBytes, deviceMemoryGiB) {
  const may = tabMemoryBytes(deviceMemoryGiB);
  if (!(memoryBytes > may)) return "";
  const gb = (n) => (n / 1e9).toFixed(n < 1e10 ? 1 : 0);
  return `this campaign's model needs about ${gb(memoryBytes)} GB; a tab may use ${gb(may)} GB; run the Python agent instead`;
}

/** Why the site gave no lease, in words for the page (the agent's status says the same). */
export const NO_LEASE_WORDS = Object.freeze({
  no_campaign: "no campaign has work for this tab right now",
  campaign_paused: "the campaign is paused",
  step_full: "this step has all the volunteers it needs; waiting for the next one",
  epoch_done: "every sample of this epoch is handed out; waiting for the next epoch",
  campaign_finished: "the campaign has finished",
  quarantined: "this device's results are held for review",
});

export function whyNoLease(message) {
  const words = NO_LEASE_WORDS[message.reason] ?? noLeaseWhy(message.reason, "");
  return message.detail ? `${words} (${message.detail})` : words;
}

/** "" when the tab may take this lease; else why it gives it back. Tabs do synchronous leases only. */
export function leaseRefusal(lease) {
  if (lease.mode === "local") {
    return `lease ${lease.lease_id} trains in local steps (DiLoCo), which tabs do not do; run the Python agent for this campaign`;
  }
  return "";
}

const DAYS = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/**
 * Whether the volunteer's schedule allows work at `when` (controls.parse_schedule and Window.allows):
 * "mon-fri 18:00-08:00; sat,sun 00:00-24:00", no days meaning every day; "" allows any time.
 * A schedule this tab cannot read allows nothing, and says so.
 * @returns {{allowed: boolean, why: string}}
 */
export function scheduleAllows(schedule, when = new Date()) {
  if (!schedule || !schedule.trim()) return { allowed: true, why: "" };
  const minute = when.getHours() * 60 + when.getMinutes();
  const day = (when.getDay() + 6) % 7; // Monday 0, as Python's weekday()
  for (const part of schedule.toLowerCase().split(";").map((p) => p.trim()).filter(Boolean)) {
    const match = /^([a-z]{3}(?:-[a-z]{3})?(?:,[a-z]{3}(?:-[a-z]{3})?)*)?\s*(\d{1,2}):(\d{2})-(\d{1,2}):(\d{2})$/.exec(part);
    if (!match) return { allowed: false, why: `your schedule part "${part}" cannot be read; fix it on My devices` };
    const days = new Set();
    for (const item of (match[1] ?? "mon-sun").split(",")) {
      const [a, b = a] = item.split("-").map((d) => DAYS.indexOf(d));
      if (a < 0 || b < 0) return { allowed: false, why: `your schedule part "${part}" names an unknown day; fix it on My devices` };
      for (let d = a; ; d = (d + 1) % 7) {
        days.add(d);
        if (d === b) break;
      }
    }
    const start = Number(match[2]) * 60 + Number(match[3]);
    const end = Number(match[4]) * 60 + Number(match[5]);
    const inside = start < end ? days.has(day) && start <= minute && minute < end : (days.has(day) && minute >= start) || (days.has((day + 6) % 7) && minute < end);
    if (inside) return { allowed: true, why: "" };
  }
  return { allowed: false, why: "outside your schedule (My devices)" };
}

/** The request_id of lease requests: the same on a resend, a new one once the site answered. */
export class LeaseRequests {
  constructor(newId = () => crypto.randomUUID().replaceAll("-", "")) {
    this.newId = newId;
    this.current = newId();
  }

  /** The id for the next send: the unanswered request's again, if there is one. */
  id() {
    return this.current;
  }

  /** The site answered (lease or no_lease): the next request is a new one. */
  answered() {
    this.current = this.newId();
  }
}

/** Replies kept for a waiter to come (a no_lease answered before the loop asked again); the oldest go first. */
const QUEUE_LIMIT = 32;

/**
 * One control socket: replies from the site handed to whoever waits for their kind, `controls` and
 * `version` handed to `onEvent` as they come.
 *
 * Two waiters may wait at once (the loop for a `lease`/`no_lease`, the report in the background for its
 * `done_ack`): a reply goes to the oldest waiter that wants its kind and matches it (a `done_ack` to the
 * report of its lease_id), else it is queued for the next `next` that wants it. An `error` says the site
 * refused one of the tab's messages without saying which, so it fails every waiter (each then gives its
 * lease back or reconnects); with nobody waiting it fails the next `next`.
 */
export class Channel {
  constructor(ws, { onEvent = () => {}, onUnknown = () => {} } = {}) {
    this.ws = ws;
    this.queue = [];
    this.waiters = [];
    this.closed = null;
    this.onEvent = onEvent;
    ws.onmessage = (event) => {
      let message;
      try {
        message = parseMessage(event.data, SITE_TO_TAB, onUnknown);
      } catch (error) {
        this.fail(error);
        return;
      }
      if (message.kind === "controls" || message.kind === "version") {
        onEvent(message);
        return;
      }
      if (message.kind === "welcome" && message.controls) onEvent({ kind: "controls", controls: message.controls });
      if (message.kind === "error" && this.waiters.length) {
        for (const w of this.waiters.splice(0)) w.resolve(message);
        return;
      }
      const at = this.waiters.findIndex((w) => w.wants(message));
      if (at >= 0) this.waiters.splice(at, 1)[0].resolve(message);
      else {
        this.queue.push(message);
        if (this.queue.length > QUEUE_LIMIT) this.queue.shift(); // e.g. done_acks of reports that gave up waiting
      }
    };
    ws.onclose = (event) => {
      this.closed = event;
      const error = Object.assign(new Error(closeVerdict(event.code).why), { code: event.code, reason: event.reason });
      for (const w of this.waiters.splice(0)) w.reject(error);
      onEvent({ kind: "closed", code: event.code, reason: event.reason });
    };
  }

  fail(error) {
    for (const w of this.waiters.splice(0)) w.reject(error);
    this.ws.close(4000, "bad message");
  }

  send(text) {
    if (this.ws.readyState !== 1) throw Object.assign(new Error("the site's connection is closed"), { code: this.closed?.code ?? 1006 });
    this.ws.send(text);
  }

  /**
   * The next message of one of `kinds` for which `match` holds (an `error` too: it rejects), within `timeoutS`.
   * @param {string[]} kinds
   * @param {number} timeoutS
   * @param {(message: object) => boolean} [match] e.g. `(m) => m.lease_id === 12` for a done_ack.
   */
  next(kinds, timeoutS, match = () => true) {
    const wants = (m) => kinds.includes(m.kind) && match(m);
    const at = this.queue.findIndex((m) => wants(m) || m.kind === "error");
    if (at >= 0) return settle(this.queue.splice(at, 1)[0]);
    if (this.closed) return Promise.reject(Object.assign(new Error(closeVerdict(this.closed.code).why), { code: this.closed.code }));
    return new Promise((resolve, reject) => {
      const waiter = {
        wants,
        resolve: (m) => (clearTimeout(timer), settle(m).then(resolve, reject)),
        reject: (e) => (clearTimeout(timer), reject(e)),
      };
      const timer = setTimeout(() => {
        const mine = this.waiters.indexOf(waiter);
        if (mine >= 0) this.waiters.splice(mine, 1);
        reject(Object.assign(new Error(`the site did not answer within ${timeoutS} s`), { timeout: true }));
      }, timeoutS * 1000);
      this.waiters.push(waiter);
    });
  }
}

function settle(message) {
  if (message.kind === "error") return Promise.reject(new Error(`the site refused a message: ${message.code} (${message.detail})`));
  return Promise.resolve(message);
}
