// The tab worker's protocol steps (frontend/src/tab/control.js, params.js, upload.js, compute.js), each on
// its own under Node with fakes for the network: run by test_tab_steps.py (`node --test`).

import assert from "node:assert/strict";
import { test } from "node:test";

import { addInto, Cancelled, ComputeError, GradientComputer, layoutOf, RuntimeFailure, yieldToEvents } from "../../frontend/src/tab/compute.js";
import {
  backoffS,
  Channel,
  closeVerdict,
  helloFor,
  LeaseRequests,
  leaseRefusal,
  memoryRefusal,
  MOST_TAB_FLOPS,
  plausibleFlops,
  scheduleAllows,
  subprotocolsFor,
  whyNoLease,
} from "../../frontend/src/tab/control.js";
import { sha256Hex } from "../../frontend/src/tab/deltas.js";
import { ErrorFeedback } from "../../frontend/src/tab/feedback.js";
import { ComputeThread, MOST_GRAPHS } from "../../frontend/src/tab/compute_thread.js";
import { DeltaChoice, FetchError, fetchSlice, HeldParams, limitedFetch, Shards } from "../../frontend/src/tab/params.js";
import { Doing, HeldLeases, Reports } from "../../frontend/src/tab/pipeline.js";
import { encodeSlice, ticketIsCheck, Uploader, UploadError } from "../../frontend/src/tab/upload.js";

const TOKEN = "ctd_" + "a".repeat(43);

test("a microbatch's gradient adds into the lease's sum at every length, the last partial group of four too", () => {
  for (let n = 0; n <= 9; n++) {
    const into = Float32Array.from({ length: n }, (_, i) => i + 0.5);
    const g = Float32Array.from({ length: n }, (_, i) => 10 * (i + 1));
    addInto(into, g);
    assert.deepEqual([...into], Array.from({ length: n }, (_, i) => i + 0.5 + 10 * (i + 1)), `length ${n}`);
  }
  const into = new Float32Array(8);
  addInto(into.subarray(2, 7), Float32Array.of(1, 2, 3, 4, 5)); // a parameter's view of the flat sum
  assert.deepEqual([...into], [0, 0, 1, 2, 3, 4, 5, 0]);
});

test("the tab offers its minors and then its token, and refuses a malformed token", () => {
  assert.deepEqual(subprotocolsFor(TOKEN), ["crowdtrain.2.10", "crowdtrain.2.9", `crowdtrain.bearer.${TOKEN}`]);
  assert.throws(() => subprotocolsFor("ctd_short"), /malformed; reload the page/);
  assert.throws(() => subprotocolsFor("ctd_" + "a".repeat(42) + " "), /malformed/);
});

test("4001 and 4003 stop the tab for good; other closes reconnect with a bounded backoff", () => {
  assert.equal(closeVerdict(4001).stop, true);
  assert.match(closeVerdict(4003).why, /revoked/);
  assert.equal(closeVerdict(1006).stop, false);
  assert.equal(backoffS(0, () => 0), 1);
  assert.equal(backoffS(3, () => 0), 8);
  assert.equal(backoffS(50, () => 1), 72);
});

test("hello says browser and what computes; a 2.9 site is not sent the runtime", () => {
  const nav = { userAgentData: { brands: [{ brand: "Chromium", version: "156" }, { brand: "Google Chrome", version: "156" }], platform: "Linux" }, deviceMemory: 8 };
  const message = JSON.parse(helloFor(nav, { webgpu: true }));
  assert.equal(message.kind, "hello");
  assert.deepEqual(message.device, {
    kind: "browser",
    name: "Google Chrome 156 on Linux (tab)",
    memory_bytes: 8 * 2 ** 30,
    threads: 1,
    torch_version: "",
    flops_per_s: 0,
    runtime: "onnxruntime-web 1.30.0 webgpu",
  });
  const old = JSON.parse(helloFor({ userAgent: "Mozilla/5.0 (X11; Linux x86_64) Firefox/140" }, { minor: 9 }));
  assert.equal(old.device.name, "Firefox 140 on Linux (tab)");
  assert.equal(old.device.memory_bytes, 0);
  assert.equal("runtime" in old.device, false);
});

test("a kept FLOP/s that is garbage or tampered reaches the hello as 0, never past the protocol's bound", () => {
  const nav = { userAgent: "Mozilla/5.0 (X11; Linux x86_64) Chrome/156" };
  const said = (kept) => JSON.parse(helloFor(nav, { flopsPerS: plausibleFlops(kept) })).device.flops_per_s;
  assert.equal(said("4500000000"), 4.5e9); // localStorage keeps text
  assert.equal(said(4.5e9), 4.5e9);
  for (const kept of ["", " ", "abc", "-5", "0", "NaN", "Infinity", "1e30", "1e16", null, undefined, {}, [7]]) {
    assert.equal(said(kept), 0, `kept ${JSON.stringify(kept)}`);
  }
  assert.equal(said(String(MOST_TAB_FLOPS)), MOST_TAB_FLOPS);
  // helloFor bounds it on its own too: a measured figure from a huge flops_per_sample cannot break the hello
  assert.equal(JSON.parse(helloFor(nav, { flopsPerS: 1e25 })).device.flops_per_s, 0);
});

test("a model too large for a tab is refused in words, with what it needs and what a tab may use", () => {
  assert.equal(memoryRefusal(1.5e9, undefined), "");
  assert.equal(
    memoryRefusal(3e9, 8),
    "this campaign's model needs about 3.0 GB; a tab may use 2.1 GB; run the Python agent instead",
  );
  assert.match(memoryRefusal(1.5e9, 2), /a tab may use 1\.1 GB/); // half of 2 GiB of device memory
  assert.equal(memoryRefusal(1e9, 4), "");
});

test("no_lease reasons are shown in words, and local-mode leases are given back", () => {
  assert.equal(whyNoLease({ reason: "step_full", detail: "" }), "this step has all the volunteers it needs; waiting for the next one");
  assert.match(whyNoLease({ reason: "campaign_paused", detail: "browser compute is not offered for campaign 3: dropout" }), /paused \(browser compute is not offered/);
  assert.match(leaseRefusal({ lease_id: 4, mode: "local" }), /local steps .* run the Python agent/);
  assert.equal(leaseRefusal({ lease_id: 4, mode: "sync" }), "");
});

test("the schedule reads as the agent's: days, windows past midnight, and a part it cannot read", () => {
  const at = (day, hh, mm = 0) => new Date(2026, 10, 23 + day, hh, mm); // 2026-11-23 is a Monday
  assert.equal(scheduleAllows("", at(0, 3)).allowed, true);
  assert.equal(scheduleAllows("mon-fri 18:00-08:00", at(0, 19)).allowed, true);
  assert.equal(scheduleAllows("mon-fri 18:00-08:00", at(1, 7, 59)).allowed, true); // Tuesday's small hours: Monday's window
  assert.equal(scheduleAllows("mon-fri 18:00-08:00", at(0, 12)).allowed, false);
  assert.equal(scheduleAllows("mon-fri 18:00-08:00", at(5, 3)).allowed, true); // Saturday 03:00 belongs to Friday
  assert.equal(scheduleAllows("mon-fri 18:00-08:00", at(6, 3)).allowed, false);
  assert.equal(scheduleAllows("sat,sun 00:00-24:00", at(6, 23, 59)).allowed, true);
  assert.equal(scheduleAllows("fri-mon 10:00-11:00", at(0, 10, 30)).allowed, true); // wraps the week
  assert.match(scheduleAllows("weekdays 9-5", at(0, 10)).why, /cannot be read/);
  assert.match(scheduleAllows("xyz 10:00-11:00", at(0, 10)).why, /unknown day/);
});

test("a lease request keeps its request_id until the site answers it", () => {
  let n = 0;
  const requests = new LeaseRequests(() => `r${++n}`);
  assert.equal(requests.id(), "r1");
  assert.equal(requests.id(), "r1"); // resent after a timeout: the same id, the site answers it once
  requests.answered();
  assert.equal(requests.id(), "r2");
});

class FakeSocket {
  constructor() {
    this.readyState = 1;
    this.sent = [];
  }
  send(data) {
    this.sent.push(data);
  }
  receive(message) {
    this.onmessage({ data: JSON.stringify(message) });
  }
  close(code = 1000) {
    this.readyState = 3;
    this.onclose?.({ code, reason: "" });
  }
}

const WELCOME = { kind: "welcome", device_id: 1, device_name: "tab", volunteer: "vera", heartbeat_s: 20, gone_after_s: 60 };

test("the control channel hands each answer to its waiter, controls to the page, and a close to everyone", async () => {
  const ws = new FakeSocket();
  const events = [];
  const channel = new Channel(ws, { onEvent: (e) => events.push(e) });
  const welcome = channel.next(["welcome"], 5);
  ws.receive({ ...WELCOME, controls: { schedule: "mon 10:00-11:00" } });
  assert.equal((await welcome).device_name, "tab");
  assert.equal(events[0].controls.schedule, "mon 10:00-11:00");
  ws.receive({ kind: "version", campaign_id: 1, version: 3 });
  assert.equal(events[1].kind, "version");
  ws.receive({ kind: "no_lease", reason: "epoch_done", detail: "", retry_after_s: 5 });
  assert.equal((await channel.next(["lease", "no_lease"], 5)).reason, "epoch_done"); // queued before it was asked
  const refused = channel.next(["lease"], 5);
  ws.receive({ kind: "error", code: "bad_request", detail: "nope" });
  await assert.rejects(refused, /refused a message: bad_request/);
  const pending = channel.next(["done_ack"], 5);
  ws.close(4003);
  await assert.rejects(pending, (e) => e.code === 4003);
  await assert.rejects(channel.next(["lease"], 5), (e) => e.code === 4003);
});

test("a lease's report and the request for the next lease wait at once, each for its own answer", async () => {
  const ws = new FakeSocket();
  const channel = new Channel(ws);
  const reports = new Reports();
  let acked = null;
  // lease 11's report: done sent, its done_ack awaited in the background
  await reports.start(async () => {
    ws.send(JSON.stringify({ kind: "done", lease_id: 11 }));
    acked = await channel.next(["done_ack"], 5, (m) => m.lease_id === 11);
  });
  assert.equal(reports.busy, true);
  // meanwhile the loop asks for lease 12: both are in flight before the site answers either
  ws.send(JSON.stringify({ kind: "lease_request" }));
  const asked = channel.next(["lease", "no_lease"], 5);
  assert.deepEqual(ws.sent.map((m) => JSON.parse(m).kind), ["done", "lease_request"]);
  // the site answers in any order; a done_ack of another lease is not this report's
  ws.receive({ kind: "done_ack", lease_id: 9, accepted: false, reason: "lease expired: deadline passed" });
  ws.receive({ kind: "no_lease", reason: "step_full", detail: "", retry_after_s: 1 });
  assert.equal((await asked).reason, "step_full");
  assert.equal(acked, null);
  ws.receive({ kind: "done_ack", lease_id: 11, accepted: true, step: 4 });
  await reports.drain();
  assert.equal(acked.lease_id, 11);
  assert.equal(reports.busy, false);
  assert.equal((await channel.next(["done_ack"], 5)).lease_id, 9); // kept for whoever asks for it
});

test("an error from the site fails every waiter: it does not say which message it refused", async () => {
  const ws = new FakeSocket();
  const channel = new Channel(ws);
  const ack = channel.next(["done_ack"], 5, (m) => m.lease_id === 3);
  const lease = channel.next(["lease", "no_lease"], 5);
  ws.receive({ kind: "error", code: "bad message", detail: "nope" });
  await assert.rejects(ack, /refused a message: bad message/);
  await assert.rejects(lease, /refused a message/);
  // a waiter that timed out leaves the others waiting
  const short = channel.next(["done_ack"], 0.01);
  const long = channel.next(["lease", "no_lease"], 5);
  await assert.rejects(short, (e) => e.timeout === true);
  ws.receive({ kind: "no_lease", reason: "epoch_done", detail: "", retry_after_s: 1 });
  assert.equal((await long).reason, "epoch_done");
});

test("one report at a time: a second computed gradient waits for the first report to end", async () => {
  const reports = new Reports();
  const order = [];
  let finishFirst;
  await reports.start(async () => {
    order.push("first started");
    await new Promise((resolve) => (finishFirst = resolve));
    order.push("first ended");
  });
  const second = reports.start(async () => order.push("second started"));
  await new Promise((resolve) => setTimeout(resolve, 10));
  assert.deepEqual(order, ["first started"]);
  finishFirst();
  await second;
  await reports.drain();
  assert.deepEqual(order, ["first started", "first ended", "second started"]);
  const errors = [];
  const failing = new Reports({ onError: (e) => errors.push(e.message) });
  await failing.start(async () => {
    throw new Error("a bug");
  });
  await failing.drain();
  assert.deepEqual(errors, ["a bug"]);
});

test("a pause gives back the leases being prepared or computed and lets the report finish; closing gives back all", () => {
  const held = new HeldLeases();
  const reporting = held.add({ lease_id: 11 });
  reporting.phase = "reporting";
  const computing = held.add({ lease_id: 12 });
  computing.phase = "computing";
  const ahead = held.add({ lease_id: 14 }); // asked for and downloading while 12 computes
  assert.deepEqual(held.ids(), [11, 12, 14]);
  assert.deepEqual(held.toGiveBack(false).map((j) => j.lease.lease_id), [12, 14]);
  assert.deepEqual(held.ids(), [11]);
  assert.deepEqual(held.toGiveBack(true).map((j) => j.lease.lease_id), [11]);
  const reported = held.add({ lease_id: 13 });
  reported.phase = "reported"; // done sent: the site has it, there is nothing to give back
  assert.deepEqual(held.toGiveBack(true), []);
  const doing = new Doing();
  doing.loop = "lease 12: computing, 512 of 1024 samples";
  doing.report = "lease 11: uploading the gradient";
  assert.equal(doing.text(), "lease 12: computing, 512 of 1024 samples; lease 11: uploading the gradient");
  doing.ahead = "lease 13: downloading parameters of version 7";
  assert.equal(doing.text(), "lease 12: computing, 512 of 1024 samples; lease 13: downloading parameters of version 7; lease 11: uploading the gradient");
});

test("a lease's prefetch shards are fetched ahead once, and the lease that needs one waits for that fetch", async () => {
  const shard = new Uint8Array(4 * 8).fill(7);
  const sha = await sha256Hex(shard);
  const other = "f".repeat(64);
  const asked = [];
  let answer;
  const fetchFn = async (url) => {
    asked.push(url);
    if (url.endsWith(other)) return response(404, new Uint8Array());
    await new Promise((resolve) => (answer = resolve));
    return response(200, shard);
  };
  const shards = new Shards({ fetchFn, url: "http://site/api/shards/", token: TOKEN });
  const data = { kind: "text", sample_len: 4 };
  let ahead = 0;
  const fetchingAhead = shards.prefetch({ data, prefetch: [sha, other] }, 2, (n) => (ahead += n));
  await new Promise((resolve) => setTimeout(resolve, 0));
  let down = 0;
  const needing = shards.readersFor({ data, ranges: [{ shard: sha }] }, (n) => (down += n));
  await new Promise((resolve) => setTimeout(resolve, 0));
  answer();
  const { readers } = await needing;
  assert.equal(await fetchingAhead, shard.length); // a shard the site cannot give is left to the lease that needs it
  assert.ok(readers.get(sha));
  assert.deepEqual(asked, [`http://site/api/shards/${sha}`, `http://site/api/shards/${other}`]);
  assert.equal(ahead, shard.length); // counted once, by the fetch ahead
  assert.equal(down, 0);
  await shards.prefetch({ data, prefetch: [sha] });
  assert.equal(asked.length, 2); // held: not fetched again
});

test("a malformed message from the site closes the channel instead of being guessed at", async () => {
  const ws = new FakeSocket();
  const channel = new Channel(ws);
  const waiting = channel.next(["lease"], 5);
  ws.receive({ kind: "lease", lease_id: -1 });
  await assert.rejects(waiting, /Lease/);
  assert.equal(ws.readyState, 3);
});

function response(status, body, headers = {}) {
  return {
    ok: status >= 200 && status < 300,
    status,
    headers: new Headers(headers),
    arrayBuffer: async () => body.slice().buffer,
  };
}

const route = { index: 0, start: 0, end: 4, params_url: "http://agg/params/1/0/" };

test("a slice not published yet is asked for again; a full slice is checked against its sha256", async () => {
  const values = new Float32Array([1, 2, 3, 4]);
  const body = new Uint8Array(values.buffer);
  const sha = await sha256Hex(body);
  const asked = [];
  const fetchFn = async (url, init) => {
    asked.push([url, init.headers.Authorization]);
    return asked.length < 3 ? response(404, new Uint8Array()) : response(200, body, { "X-Crowdtrain-Sha256": sha, ETag: '"v5"' });
  };
  const got = await fetchSlice({ fetchFn, route, version: 5, ticket: "tkt", held: null });
  assert.deepEqual(Array.from(got.params), [1, 2, 3, 4]);
  assert.equal(got.etag, '"v5"');
  assert.deepEqual(asked[0], ["http://agg/params/1/0/5", "Bearer tkt"]); // the ticket, never the device token

  const damaged = async () => response(200, body, { "X-Crowdtrain-Sha256": "0".repeat(64) });
  await assert.rejects(fetchSlice({ fetchFn: damaged, route, version: 5, ticket: "t" }), (e) => e instanceof FetchError && /sha256/.test(e.message));
  const gone = async () => response(403, new Uint8Array());
  await assert.rejects(fetchSlice({ fetchFn: gone, route, version: 5, ticket: "t" }), /HTTP 403/);
});

test("a delta that cannot be used is replaced by a full download, and a large slice comes in parts", async () => {
  const values = new Float32Array([5, 6, 7, 8]);
  const body = new Uint8Array(values.buffer);
  const sha = await sha256Hex(body);
  const asked = [];
  const fetchFn = async (url, init) => {
    asked.push([url, init.headers.Range]);
    if (url.includes("?from=")) return response(200, new Uint8Array([1, 2, 3]), { "X-Crowdtrain-Delta-From": "4", "X-Crowdtrain-Delta-Encoding": "xor-shuffle4-zstd", "X-Crowdtrain-Sha256": sha });
    const [first, last] = init.headers.Range.slice(6).split("-").map(Number);
    const part = body.subarray(first, Math.min(last + 1, body.length));
    return response(206, part, { "Content-Range": `bytes ${first}-${first + part.length - 1}/${body.length}`, "X-Crowdtrain-Sha256": sha });
  };
  const held = { version: 4, params: new Float32Array(4) };
  const got = await fetchSlice({ fetchFn, route, version: 5, ticket: "t", held, partBytes: 8 });
  assert.deepEqual(Array.from(got.params), [5, 6, 7, 8]);
  assert.deepEqual(asked, [
    ["http://agg/params/1/0/5?from=4", "bytes=0-7"],
    ["http://agg/params/1/0/5", "bytes=0-7"],
    ["http://agg/params/1/0/5", "bytes=8-15"],
  ]);
});

test("held parameters are the next delta's base and are dropped for another campaign", async () => {
  const body = new Uint8Array(new Float32Array([1, 2, 3, 4]).buffer);
  const sha = await sha256Hex(body);
  const asked = [];
  const fetchFn = async (url) => (asked.push(url), response(200, body, { "X-Crowdtrain-Sha256": sha }));
  const held = new HeldParams();
  const lease = { campaign_id: 1, param_count: 4, base_version: 5, ticket: "t", slices: [route] };
  await held.fetchAll({ fetchFn, lease });
  await held.fetchAll({ fetchFn, lease }); // the same version: nothing downloaded
  await held.fetchAll({ fetchFn, lease: { ...lease, base_version: 6 } });
  await held.fetchAll({ fetchFn, lease: { ...lease, campaign_id: 2, base_version: 7 } });
  // An aggregator that no longer keeps version 5 answers version 6 whole; another campaign starts afresh.
  assert.deepEqual(asked, ["http://agg/params/1/0/5", "http://agg/params/1/0/6?from=5", "http://agg/params/1/0/7"]);
  await assert.rejects(held.fetchAll({ fetchFn, lease: { ...lease, slices: [{ ...route, end: 9 }] } }), /outside the model's 4 values/);
});

class FakeAggregator {
  constructor(url, protocols) {
    FakeAggregator.opened.push({ url, protocols });
    this.protocol = "crowdtrain.2.10";
    this.readyState = 0;
    this.bufferedAmount = 0;
    this.sent = [];
    setTimeout(() => ((this.readyState = 1), this.onopen()), 0);
  }
  send(data) {
    this.sent.push(data);
    if (typeof data !== "string") {
      const view = new DataView(data.buffer, data.byteOffset);
      if (view.getUint32(4) === view.getUint32(8) - 1) setTimeout(() => this.onmessage({ data: FakeAggregator.reply(JSON.parse(this.sent[0])) }), 0);
    }
  }
  close() {
    this.readyState = 3;
  }
}
FakeAggregator.opened = [];

test("a slice goes out as header and chunks on one kept socket, and its receipt or rejection comes back", async () => {
  FakeAggregator.reply = (begin) => JSON.stringify({ kind: "receipt", lease_id: 1, slice_index: begin.slice_index, token: "rcpt" });
  const uploader = new Uploader({ WebSocketImpl: FakeAggregator });
  const payload = new Uint8Array(16);
  const args = { ticket: "t", sliceIndex: 2, codec: "fp32", codecBlockSize: 256, payload, numElements: 4 };
  assert.deepEqual(await uploader.upload("ws://agg/upload", args), { token: "rcpt", bytesUp: 32 });
  await uploader.upload("ws://agg/upload", args);
  assert.equal(FakeAggregator.opened.length, 1);
  assert.deepEqual(FakeAggregator.opened[0].protocols, ["crowdtrain.2.10", "crowdtrain.2.9"]); // no token for an aggregator
  FakeAggregator.reply = (begin) => JSON.stringify({ kind: "upload_rejected", lease_id: 1, slice_index: begin.slice_index, code: "stale", detail: "step moved on" });
  await assert.rejects(uploader.upload("ws://agg/upload", args), (e) => e instanceof UploadError && e.code === "stale" && /rejected slice 2: stale/.test(e.message));
});

test("int8 keeps its rounding error for the next upload, except for a verification copy", () => {
  const ticket = (payload) => `${Buffer.from(JSON.stringify(payload)).toString("base64url")}.sig`;
  assert.equal(ticketIsCheck(ticket({ campaign_id: 1, check: true })), true);
  assert.equal(ticketIsCheck(ticket({ campaign_id: 1 })), false);
  assert.equal(ticketIsCheck("garbage"), false);
  const grad = Float32Array.from({ length: 64 }, (_, i) => Math.sin(i) / 3);
  const lease = { campaign_id: 1, param_count: 64, codec: "int8", codec_block_size: 32 };
  const feedback = new ErrorFeedback();
  encodeSlice({ ...lease, ticket: ticket({ check: true }) }, { start: 0, end: 64 }, grad, feedback);
  assert.equal(feedback.residuals.size, 0);
  encodeSlice({ ...lease, ticket: ticket({}) }, { start: 0, end: 64 }, grad, feedback);
  assert.equal(feedback.residuals.size, 1);
});

// A fake onnxruntime: the "graph" answers loss = sum(x) and grad w = count * w, so sums are easy to check.
const fakeOrt = {
  Tensor: class {
    constructor(type, data, dims) {
      Object.assign(this, { type, data, dims });
    }
  },
};
const session = (runs) => ({
  async run(feeds) {
    runs.push(feeds.x.dims[0]);
    const n = feeds.x.dims[0];
    return {
      loss: { data: new Float32Array([feeds.x.data.reduce((a, b) => a + b, 0)]) },
      "w.grad": { data: feeds.w.data.map((v) => v * n) },
      "b.grad": { data: new Float32Array([n]) },
    };
  },
});
const manifest = {
  microbatch_size: 2,
  inputs: [
    { name: "w", shape: [2, 1], dtype: "float32" },
    { name: "b", shape: [1], dtype: "float32" },
    { name: "x", shape: [2, 1], dtype: "float32" },
    { name: "y", shape: [2], dtype: "int64" },
  ],
  outputs: [{ name: "loss" }, { name: "w.grad" }, { name: "b.grad" }],
};
const samples = (n) => ({
  x: { type: "float32", data: Float32Array.from({ length: n }, (_, i) => i + 1), dims: [n, 1] },
  y: { type: "int64", data: new BigInt64Array(n), dims: [n] },
});

test("a lease's gradient is the sum over whole microbatches and its leftover samples, one at a time", async () => {
  const runs = [];
  const computer = new GradientComputer(fakeOrt, { session: session(runs), single: session(runs), manifest, paramCount: 3 });
  const result = await computer.compute(new Float32Array([1, 2, 3]), samples(5));
  assert.deepEqual(runs, [2, 2, 1]);
  assert.equal(result.lossSum, 15);
  assert.deepEqual(Array.from(result.grad), [5, 10, 5]);
  assert.equal(result.numSamples, 5);
});

test("a wide graph takes whole groups of microbatches, the microbatch graph the rest, and the sum is the same", async () => {
  const runs = [];
  const graphs = { session: session(runs), single: session(runs), wide: session(runs), wideBatch: 4, manifest, paramCount: 3 };
  const result = await new GradientComputer(fakeOrt, graphs).compute(new Float32Array([1, 2, 3]), samples(11));
  assert.deepEqual(runs, [4, 4, 2, 1]);
  assert.equal(result.lossSum, 66);
  assert.deepEqual(Array.from(result.grad), [11, 22, 11]);
  const progress = [];
  await new GradientComputer(fakeOrt, graphs).compute(new Float32Array(3), samples(3), { onProgress: (n) => progress.push(n) });
  assert.deepEqual(progress, [2, 3]); // fewer samples than the wide graph takes: microbatches only
  const noWide = await new GradientComputer(fakeOrt, { ...graphs, wide: null }).compute(new Float32Array([1, 2, 3]), samples(11));
  assert.deepEqual(Array.from(noWide.grad), Array.from(result.grad));
  // a wide graph whose batch is no whole number of microbatches above one is refused, not run (a batch of 0
  // would never advance through the lease)
  for (const wideBatch of [0, 2, 3, 5, 4.5, undefined]) {
    assert.throws(() => new GradientComputer(fakeOrt, { ...graphs, wideBatch }), (e) => e instanceof ComputeError && /not a whole number of microbatches/.test(e.message), String(wideBatch));
  }
});

test("a gradient stops between microbatches when the tab pauses, and a graph of another model is refused", async () => {
  const runs = [];
  const computer = new GradientComputer(fakeOrt, { session: session(runs), single: null, manifest });
  let calls = 0;
  await assert.rejects(computer.compute(new Float32Array(3), samples(6), { cancelled: () => calls++ > 0 }), Cancelled);
  assert.deepEqual(runs, [2]);
  await assert.rejects(computer.compute(new Float32Array(3), samples(3)), /no batch-1 graph/);
  assert.throws(() => layoutOf(manifest, 4), (e) => e instanceof ComputeError && /hold 3 values where the lease's model has 4/.test(e.message));
});

test("a graph WebGPU cannot run computes the whole lease again on wasm; with nothing to fall to, the lease fails in words", async () => {
  const runs = [];
  const broken = { async run() { throw new Error("The Indices output is not supported yet."); } };
  const fellTo = [];
  const fallback = async (failure) => {
    fellTo.push(failure.message);
    return { session: session(runs), single: session(runs) };
  };
  const computer = new GradientComputer(fakeOrt, { session: broken, single: broken, manifest, runtime: "webgpu", fallback });
  const result = await computer.compute(new Float32Array([1, 2, 3]), samples(5));
  assert.deepEqual(runs, [2, 2, 1]); // every sample, from the first, on the fallback's sessions
  assert.deepEqual(Array.from(result.grad), [5, 10, 5]);
  assert.equal(computer.runtime, "wasm");
  assert.match(computer.fellBack, /onnxruntime \(webgpu\) could not run the graph: The Indices output is not supported yet/);
  assert.equal(fellTo.length, 1);
  await computer.compute(new Float32Array([1, 2, 3]), samples(2)); // the next lease goes straight to wasm
  assert.equal(fellTo.length, 1);

  const alone = new GradientComputer(fakeOrt, { session: broken, single: broken, manifest });
  await assert.rejects(alone.compute(new Float32Array(3), samples(2)), (e) => e instanceof RuntimeFailure && e instanceof ComputeError);
});

test("the compute worker's calls: progress, a cancel once the lease is given back, results, errors by class", async () => {
  const sent = [];
  class FakeWorker {
    constructor(url, options) {
      this.options = options;
      workers.push(this);
    }
    postMessage(message) {
      sent.push(message);
    }
    terminate() {}
    answer(message) {
      this.onmessage({ data: message });
    }
  }
  const workers = [];
  const thread = new ComputeThread({ ortUrl: "/ort/", webgpu: false, WorkerImpl: FakeWorker, url: "/w.js" });
  assert.equal(workers[0].options.name, "crowdtrain-compute");
  assert.deepEqual(sent[0], { type: "setup", ortUrl: "/ort/", webgpu: false });
  let reads = 0;
  const loadBytes = async () => {
    reads += 1;
    return new Uint8Array(2);
  };
  await thread.ensureGraph({ sha256: "a".repeat(64) }, loadBytes);
  await thread.ensureGraph({ sha256: "a".repeat(64) }, loadBytes); // once per graph: neither read nor sent again
  assert.equal(sent.filter((m) => m.type === "graph").length, 1);
  assert.equal(reads, 1);

  let given = false;
  const progress = [];
  const runtimes = [];
  const computer = thread.computer({ main: "a".repeat(64), single: null, manifest, paramCount: 3 }, (r) => runtimes.push(r));
  const first = computer.compute(new Float32Array(3), samples(4), { cancelled: () => given, onProgress: (n, t) => progress.push([n, t]) });
  const { id } = sent.at(-1);
  workers[0].answer({ type: "progress", id, done: 2, total: 4 });
  given = true;
  workers[0].answer({ type: "progress", id, done: 4, total: 4 });
  workers[0].answer({ type: "progress", id, done: 4, total: 4 });
  assert.deepEqual(sent.filter((m) => m.type === "cancel"), [{ type: "cancel", id }]); // asked once
  workers[0].answer({ type: "failed", id, error: { name: "Cancelled", message: "stopped" } });
  await assert.rejects(first, Cancelled);
  assert.deepEqual(progress, [[2, 4], [4, 4], [4, 4]]);

  const second = computer.compute(new Float32Array(3), samples(2));
  workers[0].answer({ type: "result", id: sent.at(-1).id, result: { lossSum: 1, numSamples: 2 }, runtime: "wasm", fellBack: "no MaxPool" });
  assert.equal((await second).lossSum, 1);
  assert.deepEqual(runtimes, [{ runtime: "wasm", fellBack: "no MaxPool" }]);

  const third = computer.compute(new Float32Array(3), samples(2));
  workers[0].answer({ type: "failed", id: sent.at(-1).id, error: { name: "RuntimeFailure", message: "onnxruntime (wasm) could not run the graph" } });
  await assert.rejects(third, (e) => e instanceof ComputeError && /could not run the graph/.test(e.message));

  // At most MOST_GRAPHS graphs stay in the compute worker: the one no lease used longest is forgotten.
  const sha = (c) => c.repeat(64);
  for (const c of "bcd") await thread.ensureGraph({ sha256: sha(c) }, loadBytes);
  const onA = computer.compute(new Float32Array(3), samples(2)); // lease on graph a: now the most recently used
  await thread.ensureGraph({ sha256: sha("e") }, loadBytes);
  assert.deepEqual(sent.filter((m) => m.type === "forget"), [{ type: "forget", sha256: sha("b") }]);
  await thread.ensureGraph({ sha256: sha("b") }, loadBytes); // needed again: read and sent again
  assert.equal(reads, 6);
  assert.deepEqual(sent.filter((m) => m.type === "forget").map((m) => m.sha256[0]), ["b", "c"]);
  assert.equal(MOST_GRAPHS, 4);

  const fourth = computer.compute(new Float32Array(3), samples(2));
  workers[0].onerror({ message: "out of memory" });
  await assert.rejects(fourth, /the compute worker failed: out of memory/);
  await assert.rejects(onA, /out of memory/);
  await assert.rejects(computer.compute(new Float32Array(3), samples(2)), /out of memory/); // not posted to a dead worker
  assert.ok(thread.broken);
});

test("downloads are held to the volunteer's download limit, read at each answer", async () => {
  let kbps = null;
  const fetchFn = limitedFetch(async () => response(200, new Uint8Array(2500), { ETag: '"x"' }), () => kbps);
  let started = performance.now();
  await fetchFn("u", {});
  assert.ok(performance.now() - started < 100);
  kbps = 100; // 2500 bytes are 20 kilobits: 200 ms at 100 kbps
  started = performance.now();
  const answer = await fetchFn("u", {});
  assert.ok(performance.now() - started >= 190);
  assert.equal(answer.headers.get("ETag"), '"x"');
  assert.equal((await answer.arrayBuffer()).byteLength, 2500);
});

test("a delta is asked on a slow link and the whole slice on a fast one, with a probe now and then", () => {
  const full = 5_300_000;
  const slow = new DeltaChoice();
  assert.equal(slow.wantsDelta(), true, "nothing measured yet: a delta, as the agent asks");
  // A home link (2.5 MB/s) and a delta of half the slice that decodes at 25 MB/s: the delta pays.
  slow.note({ bodyBytes: full / 2, fullBytes: full, downloadS: full / 2 / 2.5e6, decodeS: full / 25e6 });
  assert.deepEqual([1, 2, 3].map(() => slow.wantsDelta()), [true, true, true]);

  // Next to the site (500 MB/s), decoding costs more than the bytes it saves: the whole slice.
  const fast = new DeltaChoice();
  fast.note({ bodyBytes: full / 2, fullBytes: full, downloadS: full / 2 / 500e6, decodeS: full / 25e6 });
  const picks = Array.from({ length: 2 * DeltaChoice.PROBE_EVERY }, () => fast.wantsDelta());
  assert.equal(picks.filter(Boolean).length, 2, "only the probes ask a delta");
  // The link slows down (a full download now takes long): deltas come back.
  for (let i = 0; i < 20; i++) fast.note({ bodyBytes: full, fullBytes: full, downloadS: full / 1e6, decodeS: null });
  assert.equal(fast.wantsDelta(), true);
});

test("a microbatch boundary lets queued tasks run, where awaiting a settled run would not", async () => {
  const order = [];
  const socket = new MessageChannel(); // stands for a reply arriving on the site's socket
  socket.port1.onmessage = () => order.push("reply handled");
  socket.port2.postMessage(null);
  await Promise.resolve(); // what awaiting onnxruntime-web's wasm run amounts to: microtasks only
  order.push("next microbatch without a yield");
  await yieldToEvents();
  order.push("next microbatch after the yield");
  socket.port1.close();
  assert.deepEqual(order, ["next microbatch without a yield", "reply handled", "next microbatch after the yield"]);
});
