// The tab's Web Worker: a device of the volunteer that speaks the agent's protocol (agent/PROTOCOL.md).
//
// The loop reads as the agent's runtime does: connect (the device token offered as a subprotocol) ->
// hello -> welcome -> heartbeats; ask for a lease -> no_lease (say why, wait) | lease -> graph ->
// parameters -> samples (and the lease's `prefetch` shards fetched ahead) -> gradient; then the lease's
// report (upload each slice -> done -> done_ack) goes on in the background while the loop asks for the
// next lease and computes it (pipeline.js: one report in flight at a time). The page owns what a worker
// cannot see (localStorage, visibility, the Pause button) and tells the worker in messages:
//
//   page -> worker  {type: "start", config, token, webgpu,   config: the page's json_script; flopsPerS: what
//                    flopsPerS}                              this browser trained at on its last visit (0: never)
//                   {type: "pause", why, closing?}           a lease being prepared or computed is given back
//                   {type: "resume"}                         at once; a report in flight finishes, unless the
//                                                            tab is closing: then its lease goes back too
//                   {type: "gradient", ...}                  one gradient, nothing else (tests, benchmarks)
//   worker -> page  {type: "status", ...}                    what it does, why it waits, samples/s, credit
//                   {type: "token_refused", code, why}       the page forgets the token and says so
//                   {type: "stopped", why}                   nothing more will happen in this tab

import { Cancelled, ComputeError, GradientComputer, createSession } from "./compute.js";
import { COMPUTE_THREAD, ComputeThread, importOrt, serveComputeThread } from "./compute_thread.js";
import {
  backoffS,
  Channel,
  closeVerdict,
  helloFor,
  LEASE_WAIT_S,
  LeaseRequests,
  leaseRefusal,
  memoryRefusal,
  plausibleFlops,
  scheduleAllows,
  subprotocolsFor,
  TOKEN_REFUSED,
  whyNoLease,
} from "./control.js";
import { sha256Hex } from "./deltas.js";
import { ErrorFeedback } from "./feedback.js";
import { done as doneMessage, heartbeat, leaseRequest, negotiatedMinor, release } from "./messages.js";
import { FetchError, HeldParams, limitedFetch, Shards } from "./params.js";
import { Doing, HeldLeases, Reports } from "./pipeline.js";
import { gatherSamples } from "./samples.js";
import { encodeSlice, Uploader } from "./upload.js";

const FLOPS_PER_CREDIT = 1e9; // crowdtrain_agent.credit: one credit is one GFLOP of accepted work
const WELCOME_TIMEOUT_S = 30;
const DONE_TIMEOUT_S = 30;
const PROGRESS_EVERY_MS = 250; // how often the page hears how far a lease's compute has got

const state = {
  config: null,
  token: "",
  webgpu: false,
  paused: false,
  pauseWhy: "",
  stopped: false,
  controls: null,
  held: new HeldLeases(), // the leases held now: one being prepared or computed, one computed or reporting
  doing: new Doing(), // what the page shows: the loop's lease; the report in flight
  reports: new Reports({ onError: (error) => stop(`stopped by an error this tab did not expect: ${error.message}`) }),
  computing: false, // a lease's gradient is being computed (the next lease is then asked for ahead)
  downAhead: 0, // bytes fetched ahead (shards of the next leases), reported with the next done
  channel: null,
  wake: null, // resolves a wait early (resume, a new version)
  leasesDone: 0,
  samplesDone: 0,
  credit: 0,
  samplesPerS: null,
  flopsPerS: 0, // training FLOP/s measured on the leases computed (the hello says it; the site sizes first leases by it)
  ort: null, // onnxruntime in this thread: for one gradient alone (tests, benchmarks); leases compute in `compute`
  compute: null, // the compute worker (compute_thread.js), started with the first lease
  progressShownAt: -Infinity, // when the page last heard a lease's progress (performance.now())
  fellBack: "", // why WebGPU gave way to wasm for the campaign's graph, once it did
};
const held = new HeldParams();
const feedback = new ErrorFeedback();
let network = null; // fetch, held to the volunteer's download limit
let shards = null;
let uploader = null;

function post(message) {
  self.postMessage(message);
}

/** Say what the loop does now (`text`): the lease computing, or why nothing computes. */
function status(text, extra = {}) {
  state.doing.loop = text;
  show(extra);
}

/**
 * Say what the next lease's request and downloads do: beside the compute while a lease computes, else
 * as what the loop does (it waits for them).
 */
function aheadStatus(text, extra = {}) {
  if (state.computing) {
    state.doing.ahead = text;
    show(extra);
  } else status(text, extra);
}

/** The compute ended: what the next lease does is now what the loop waits for. */
function aheadToLoop() {
  if (state.doing.ahead) {
    state.doing.loop = state.doing.ahead;
    state.doing.ahead = "";
    show();
  }
}

/** Say what the report in flight does now ("" once it is over), beside what the loop does. */
function reportStatus(text) {
  state.doing.report = text;
  show();
}

function show(extra = {}) {
  const ids = state.held.ids();
  post({
    type: "status",
    text: state.doing.text(),
    paused: state.paused,
    samplesPerS: state.samplesPerS,
    flopsPerS: state.flopsPerS,
    leasesDone: state.leasesDone,
    samplesDone: state.samplesDone,
    credit: state.credit,
    leaseId: ids[0] ?? null, // the oldest lease held: the one reporting while the next computes
    leaseIds: ids,
    ...extra,
  });
}

/** Wait `seconds`, or less when woken (resume, pause, a version published). */
function rest(seconds) {
  return new Promise((resolve) => {
    const timer = setTimeout(done, seconds * 1000);
    function done() {
      clearTimeout(timer);
      if (state.wake === done) state.wake = null;
      resolve();
    }
    state.wake = done;
  });
}

function wakeUp() {
  state.wake?.();
}

// ------------------------------------------------------------------ page messages

function onPageMessage(event) {
  const message = event.data ?? {};
  if (message.type === "start" && state.config === null) {
    state.config = message.config;
    state.token = message.token;
    state.webgpu = Boolean(message.webgpu);
    state.flopsPerS = plausibleFlops(message.flopsPerS);
    network = limitedFetch(fetch.bind(self), () => state.controls?.download_kbps ?? null);
    shards = new Shards({ fetchFn: network, url: state.config.shard_url, token: state.token, caches: self.caches ?? null });
    uploader = new Uploader({ uploadKbps: () => state.controls?.upload_kbps ?? null });
    run().catch((error) => stop(`stopped by an error this tab did not expect: ${error.message}`));
  } else if (message.type === "pause") {
    state.paused = true;
    state.pauseWhy = message.why || "paused";
    giveBack(Boolean(message.closing));
    wakeUp();
    status(`paused: ${state.pauseWhy}`);
  } else if (message.type === "resume") {
    state.paused = false;
    wakeUp();
    status("resuming");
  } else if (message.type === "gradient") {
    oneGradient(message).then(
      (answer) => post({ type: "gradient", ...answer }, [answer.grad.buffer]),
      (error) => post({ type: "gradient", error: `${error.name}: ${error.message}` }),
    );
  }
};

/**
 * Give leases back now, so their samples go to another device at once: on a pause (or a minute hidden)
 * the lease being prepared or computed; a computed one still gets reported, its work is done. A closing
 * tab gives back every lease it has not reported: its uploads will not finish.
 */
function giveBack(closing = false) {
  for (const job of state.held.toGiveBack(closing)) {
    try {
      state.channel?.send(release(job.lease.lease_id));
    } catch {
      // closed: the site releases a lease whose connection is gone when its deadline passes
    }
    // `given`: the lease's own steps stop at their next check and send nothing more of it
  }
}

function stop(why) {
  state.stopped = true;
  state.channel?.ws.close(1000);
  uploader?.close();
  state.compute?.close();
  status(why);
  post({ type: "stopped", why });
}

// ------------------------------------------------------------------ the loop

async function run() {
  for (let attempt = 0; !state.stopped; attempt++) {
    await untilAllowed();
    let connected = false;
    try {
      const ws = new WebSocket(state.config.ws_url, subprotocolsFor(state.token));
      const channel = new Channel(ws, { onEvent, onUnknown: () => {} });
      state.channel = channel;
      await new Promise((resolve, reject) => {
        ws.onopen = resolve;
        ws.addEventListener("close", (event) => reject(Object.assign(new Error(closeVerdict(event.code).why), { code: event.code })));
      });
      const minor = negotiatedMinor(ws.protocol);
      status("connected; introducing this tab to the site");
      channel.send(helloFor(self.navigator, { webgpu: state.webgpu, flopsPerS: state.flopsPerS, minor }));
      const welcome = await channel.next(["welcome"], WELCOME_TIMEOUT_S);
      connected = true;
      attempt = 0;
      const beat = setInterval(() => {
        try {
          channel.send(heartbeat());
        } catch {
          clearInterval(beat);
        }
      }, Math.max(1, welcome.heartbeat_s) * 1000);
      try {
        await work(channel, welcome);
      } finally {
        clearInterval(beat);
      }
    } catch (error) {
      if (Object.hasOwn(TOKEN_REFUSED, error.code)) {
        post({ type: "token_refused", code: error.code, why: TOKEN_REFUSED[error.code] });
        stop(`${TOKEN_REFUSED[error.code]}; reload the page to register this tab again`);
        return;
      }
      if (state.stopped) return;
      const wait = backoffS(connected ? 0 : attempt);
      status(`${error.message}; connecting again in ${Math.round(wait)} s`);
      state.channel?.ws.close();
      await rest(wait);
    }
  }
}

function onEvent(message) {
  if (message.kind === "controls") {
    state.controls = message.controls;
    wakeUp();
  } else if (message.kind === "version" || message.kind === "closed") {
    wakeUp(); // a step committed: a lease may be free now; or the socket closed: reconnect now
  }
}

/** Resolve once the tab may work: not paused, inside the volunteer's schedule. */
async function untilAllowed() {
  for (;;) {
    if (state.stopped) return;
    const schedule = scheduleAllows(state.controls?.schedule ?? "");
    if (!state.paused && schedule.allowed) return;
    status(state.paused ? `paused: ${state.pauseWhy}` : `waiting: ${schedule.why}`);
    await rest(state.paused ? 3600 : 60);
  }
}

async function work(channel, welcome) {
  status(`connected as ${welcome.device_name}`);
  const requests = new LeaseRequests();
  let following = null; // the next lease: asked for and downloaded while this one computes
  try {
    while (!state.stopped) {
      const waitFrom = performance.now();
      const prepared = await (following ?? nextLease(channel, requests));
      following = null;
      if (prepared === null) return; // stopped (the campaign finished, a refusal for good)
      // Of the downloads, only what the loop waited for is the network's fault (the agent's METER.waited).
      prepared.cost.networkS = Math.min(prepared.cost.networkS, (performance.now() - waitFrom) / 1000);
      // Ask for the next lease now: its request and downloads overlap this compute (runtime._work).
      following = nextLease(channel, requests);
      following.catch(() => {}); // its failure is met where it is awaited
      const computed = await compute(channel, prepared);
      if (computed === null) continue;
      const { job } = computed;
      if (state.reports.busy) status(`lease ${job.lease.lease_id}: computed; its upload waits for the one before`);
      // Waits for the report in flight to end (one at a time, pipeline.js), then lets this one run while
      // the loop computes the next lease.
      await state.reports.start(() => report(channel, computed));
    }
  } finally {
    // Leaving (a reconnect, a stop): a lease prepared ahead goes back rather than wait for its deadline.
    following?.then((ahead) => ahead && giveBackJob(channel, ahead.job), () => {});
  }
}

/** Send a release for `job` unless it was given back already. */
function giveBackJob(channel, job) {
  if (!job.given) {
    job.given = true;
    try {
      channel.send(release(job.lease.lease_id));
    } catch {
      // the socket closed: the site releases the lease when its deadline passes
    }
  }
  state.held.drop(job);
}

/**
 * Ask the site for a lease until it gives one, and prepare it (graph, parameters, samples). Resolves to
 * the prepared lease, or null once the tab stops. While a lease computes, this runs ahead of it.
 */
async function nextLease(channel, requests) {
  while (!state.stopped) {
    await untilAllowed();
    if (state.stopped) break;
    if (channel.closed) throw Object.assign(new Error(closeVerdict(channel.closed.code).why), { code: channel.closed.code });
    aheadStatus("asking the site for work");
    channel.send(
      leaseRequest({
        campaign_id: state.config.campaign_id,
        samples_per_s: state.samplesPerS,
        request_id: requests.id(),
        wait_s: LEASE_WAIT_S,
      }),
    );
    let reply;
    try {
      reply = await channel.next(["lease", "no_lease"], LEASE_WAIT_S + 30);
    } catch (error) {
      if (error.timeout) continue; // asked again with the same request_id: the site answers it once
      throw error;
    }
    requests.answered();
    if (reply.kind === "no_lease") {
      aheadStatus(`waiting: ${whyNoLease(reply)}; asking again in ${Math.round(reply.retry_after_s)} s`, { noLease: reply.reason });
      if (reply.reason === "campaign_finished") {
        await state.reports.drain(); // the last lease's report still counts
        stop("the campaign has finished; thank you");
        return null;
      }
      await rest(reply.retry_after_s);
      continue;
    }
    const prepared = await prepare(channel, reply);
    if (prepared !== null) return prepared;
  }
  return null;
}

/**
 * Prepare one lease: the graph, its parameters and samples, the shards the next leases read fetched
 * ahead. Resolves to what its compute needs, or null when the lease was given back (a refusal, a pause,
 * a download that failed: said in the page).
 */
async function prepare(channel, lease) {
  const job = state.held.add(lease);
  const giveBackWith = async (why, restS = 0) => {
    giveBackJob(channel, job);
    aheadStatus(why);
    if (restS) await rest(restS);
    return null;
  };
  const refusal = leaseRefusal(lease);
  if (refusal) return giveBackWith(refusal, 30);
  if (state.paused) return giveBackWith(`paused: ${state.pauseWhy}`);
  try {
    const cost = { down: 0, networkS: 0 };
    // graph: the site's gated ONNX graph for this campaign, from the Cache API when this tab has it
    aheadStatus(`lease ${lease.lease_id}: loading the model's gradient graph`);
    const computer = await computerFor(lease);
    if (computer.refusal) return giveBackWith(computer.refusal, computer.restS);
    // parameters and samples
    const started = performance.now();
    aheadStatus(`lease ${lease.lease_id}: downloading parameters of version ${lease.base_version}`);
    const { flat } = await held.fetchAll({ fetchFn: network, lease, meter: (n) => (cost.down += n) });
    if (job.given) throw new Cancelled();
    aheadStatus(`lease ${lease.lease_id}: reading ${lease.num_samples} samples`);
    const { readers } = await shards.readersFor(lease, (n) => (cost.down += n));
    const samples = gatherSamples(lease.ranges, readers, lease.data, lease.base_version);
    cost.networkS = (performance.now() - started) / 1000;
    if (job.given) throw new Cancelled();
    // the next leases' shards, fetched while this one computes
    shards.prefetch(lease, undefined, (n) => (state.downAhead += n));
    aheadStatus(`lease ${lease.lease_id}: ready`);
    return { job, computer, flat, samples, cost };
  } catch (error) {
    if (error instanceof Cancelled) return giveBackWith(`paused: ${state.pauseWhy}; lease ${lease.lease_id} given back`);
    if (error instanceof FetchError || error instanceof ComputeError || error?.name === "SampleError" || error?.name === "ProtocolError") {
      return giveBackWith(`lease ${lease.lease_id}: ${error.message}; giving the lease back`, 5);
    }
    state.held.drop(job);
    throw error; // the connection: run() reconnects
  }
}

/** Said beside "computing" once WebGPU gave way to wasm. */
const onCpu = () => (state.fellBack ? " on the CPU (WebGPU cannot run this model's graph)" : "");

/** Compute a prepared lease's gradient. Resolves to what its report needs, or null when it was given back. */
async function compute(channel, { job, computer, flat, samples, cost }) {
  const lease = job.lease;
  state.computing = true;
  status(`lease ${lease.lease_id}: computing`);
  try {
    if (job.given) throw new Cancelled(); // paused while it waited its turn
    job.phase = "computing";
    const result = await computer.gradient.compute(flat, samples, {
      cancelled: () => job.given,
      onProgress: (n, total) => {
        // A few times a second, not per microbatch: each status redraws the page, and the page's drawing
        // shares the machine with the compute.
        if (n < total && performance.now() - state.progressShownAt < PROGRESS_EVERY_MS) return;
        state.progressShownAt = performance.now();
        status(`lease ${lease.lease_id}: computing${onCpu()}, ${n} of ${total} samples`);
      },
    });
    state.samplesPerS = result.numSamples / Math.max(result.computeS, 1e-6);
    if (computer.flopsPerSample > 0) state.flopsPerS = state.samplesPerS * computer.flopsPerSample;
    job.phase = "computed"; // its gradient is done: a pause lets it be reported
    return { job, result, cost, flopsPerSample: computer.flopsPerSample };
  } catch (error) {
    if (error instanceof Cancelled) {
      giveBackJob(channel, job);
      status(`paused: ${state.pauseWhy}; lease ${lease.lease_id} given back`);
      return null;
    }
    if (error instanceof ComputeError) {
      giveBackJob(channel, job);
      status(`lease ${lease.lease_id}: ${error.message}; giving the lease back`);
      await rest(5);
      return null;
    }
    state.held.drop(job);
    throw error;
  } finally {
    state.computing = false;
    aheadToLoop();
  }
}

/**
 * Report a computed lease, in the background of the loop: each slice encoded (with the int8 error
 * feedback) and uploaded to its aggregator, `done` with the receipts, then the site's `done_ack`.
 * Handles its own failures: the lease goes back, or expires with a connection that dropped.
 */
async function report(channel, { job, result, cost, flopsPerSample }) {
  const lease = job.lease;
  try {
    if (job.given) return; // the tab closed while it waited for the report before it
    job.phase = "reporting";
    reportStatus(`lease ${lease.lease_id}: uploading the gradient`);
    let up = 0;
    // each slice to the aggregator that owns it, all at once
    const receipts = await Promise.all(
      lease.slices.map(async (route) => {
        const payload = encodeSlice(lease, route, result.grad, feedback);
        const { token, bytesUp } = await uploader.upload(route.upload_url, {
          ticket: lease.ticket,
          sliceIndex: route.index,
          codec: lease.codec,
          codecBlockSize: lease.codec_block_size,
          payload,
          numElements: route.end - route.start,
        });
        up += bytesUp;
        return { slice_index: route.index, token };
      }),
    );
    if (job.given) return; // released while it uploaded (the tab is closing): nothing more of it is sent
    // the receipts prove the aggregators hold this lease's gradient
    reportStatus(`lease ${lease.lease_id}: reporting to the site`);
    const down = cost.down + state.downAhead;
    state.downAhead = 0;
    channel.send(
      doneMessage({
        lease_id: lease.lease_id,
        receipts,
        num_samples: result.numSamples,
        loss_sum: result.lossSum,
        compute_s: result.computeS,
        bytes_up: up,
        bytes_down: down,
        network_s: Math.min(cost.networkS, 1e6),
      }),
    );
    job.phase = "reported"; // the site has it: nothing left to give back
    const ack = await channel.next(["done_ack"], DONE_TIMEOUT_S, (m) => m.lease_id === lease.lease_id);
    note(lease, result, ack, flopsPerSample);
  } catch (error) {
    // An upload refused or cut, the site's refusal or silence, a closed connection: the loop goes on
    // (and reconnects if the connection is gone); this lease goes back unless the site already has it.
    if (job.phase === "reported") {
      reportStatus(`lease ${lease.lease_id}: the site did not confirm its report (${error.message})`);
      return;
    }
    if (!job.given) {
      job.given = true;
      try {
        channel.send(release(lease.lease_id));
      } catch {
        // the socket closed: the lease expires at its deadline
      }
    }
    reportStatus(`lease ${lease.lease_id}: ${error.message}; the lease was given back`);
  } finally {
    state.held.drop(job);
    show();
  }
}

function note(lease, result, ack, flopsPerSample) {
  const perSample = result.lossSum / Math.max(result.numSamples, 1);
  if (!ack.accepted) {
    reportStatus(`lease ${lease.lease_id} was not counted: ${ack.reason || "no reason given"}`);
    return;
  }
  state.leasesDone += 1;
  let granted;
  if (ack.verification === "check") {
    granted = "a copy to verify another volunteer's work (copies are not credited)";
  } else {
    state.samplesDone += result.numSamples;
    state.credit += flopsPerSample ? (result.numSamples * flopsPerSample) / FLOPS_PER_CREDIT : 0;
    granted = ack.verification === "pending" ? `counted in step ${ack.step}, pending verification` : `counted in step ${ack.step}`;
  }
  reportStatus(`lease ${lease.lease_id} done: ${result.numSamples} samples, loss ${perSample.toFixed(4)}; ${granted}`);
}

// ------------------------------------------------------------------ the graph

let browserInfo = null; // the campaign's /api/campaigns/<id>/browser/ answer
let browserInfoAt = -Infinity; // when it came (performance.now()), reused for BROWSER_INFO_S if it passed
const BROWSER_INFO_S = 60; // not a round trip to the site per lease for an answer that changes with the model only

/** The campaign's graph as a GradientComputer, or why this tab cannot take the lease. */
async function computerFor(lease) {
  if (!(browserInfo?.status === "passed" && performance.now() - browserInfoAt < BROWSER_INFO_S * 1000)) {
    const answer = await fetch(state.config.browser_api_url, { headers: { Authorization: `Bearer ${state.token}` } });
    if (!answer.ok) return { refusal: `the site answered HTTP ${answer.status} for the campaign's browser graph`, restS: 30 };
    browserInfo = await answer.json();
    browserInfoAt = performance.now();
  }
  if (browserInfo.status !== "passed") {
    const why = browserInfo.status === "pending" ? "the site is checking whether browsers can compute this model" : `browser compute is not offered: ${browserInfo.reason}`;
    return { refusal: why, restS: 30 };
  }
  const memory = memoryRefusal(browserInfo.memory_bytes, self.navigator.deviceMemory);
  if (memory) {
    stop(memory);
    return { refusal: memory, restS: 0 };
  }
  const batch = String(browserInfo.microbatch_size);
  const main = browserInfo.graphs?.[batch];
  if (!main) return { refusal: `the site lists no graph for microbatches of ${batch}`, restS: 30 };
  const single = batch === "1" ? null : (browserInfo.graphs["1"] ?? null);
  // the wide graph, where the site gave one: keyed by its batch, a multiple of the microbatch
  const wideBatch = Math.max(0, ...Object.keys(browserInfo.graphs).map(Number).filter((n) => n > Number(batch) && n % Number(batch) === 0));
  const wide = wideBatch ? browserInfo.graphs[String(wideBatch)] : null;
  const thread = await computeThread();
  for (const graph of [main, single, wide]) if (graph) await thread.ensureGraph(graph, graphBytes);
  const graphs = {
    main: main.sha256,
    single: single?.sha256 ?? null,
    wide: wide?.sha256 ?? null,
    wideBatch,
    manifest: browserInfo.manifest,
    paramCount: lease.param_count,
  };
  const gradient = thread.computer(graphs, ({ fellBack }) => {
    if (fellBack && !state.fellBack) state.fellBack = fellBack;
  });
  return { gradient, flopsPerSample: browserInfo.flops_per_sample ?? 0 };
}

async function loadOrt() {
  if (state.ort !== null) return state.ort;
  const dir = state.config.ort_url;
  state.webgpu = state.webgpu && (await hasWebGpu());
  state.ort = await importOrt(dir, state.webgpu);
  return state.ort;
}

async function hasWebGpu() {
  try {
    return Boolean(self.navigator.gpu && (await self.navigator.gpu.requestAdapter()));
  } catch {
    return false;
  }
}

/** The compute worker, started (again, if the last one failed) with WebGPU where this browser has it. */
async function computeThread() {
  if (state.compute?.broken) {
    state.compute.close();
    state.compute = null;
  }
  if (state.compute === null) {
    state.webgpu = state.webgpu && (await hasWebGpu());
    state.compute = new ComputeThread({ ortUrl: state.config.ort_url, webgpu: state.webgpu });
  }
  return state.compute;
}

async function graphBytes(graph) {
  const cache = self.caches ? await self.caches.open("crowdtrain-graphs").catch(() => null) : null;
  const cached = cache ? await cache.match(graph.url).catch(() => undefined) : undefined;
  if (cached) {
    const bytes = new Uint8Array(await cached.arrayBuffer());
    if ((await sha256Hex(bytes)) === graph.sha256) return bytes;
    await cache.delete(graph.url);
  }
  const answer = await fetch(graph.url, { headers: { Authorization: `Bearer ${state.token}` } });
  if (!answer.ok) throw new FetchError(`the gradient graph ${graph.sha256.slice(0, 12)}: HTTP ${answer.status}`, answer.status);
  const bytes = new Uint8Array(await answer.arrayBuffer());
  if ((await sha256Hex(bytes)) !== graph.sha256) throw new FetchError(`the gradient graph ${graph.sha256.slice(0, 12)} arrived damaged; it will be downloaded again`);
  await cache?.put(graph.url, new Response(bytes)).catch(() => {});
  return bytes;
}

// ------------------------------------------------------------------ one gradient (tests, benchmarks)

/**
 * One summed gradient through the same path a lease takes, for the Chromium test and the bench:
 * {graphUrl, singleUrl?, wideUrl?, wideBatch?, manifest, params: Float32Array, x: Input, y: Input, ortUrl, webgpu,
 * repeat?}.
 */
async function oneGradient({ graphUrl, singleUrl = null, wideUrl = null, wideBatch = 0, manifest, params, x, y, ortUrl, webgpu = false, repeat = 1 }) {
  state.config ??= { ort_url: ortUrl };
  state.webgpu = webgpu;
  if (webgpu && !(await hasWebGpu())) throw new Error("no WebGPU adapter in this browser");
  const ort = await loadOrt();
  const load = async (url, onGpu) => createSession(ort, new Uint8Array(await (await fetch(url)).arrayBuffer()), { webgpu: onGpu });
  const sessions = async (onGpu) => ({
    session: await load(graphUrl, onGpu),
    single: singleUrl ? await load(singleUrl, onGpu) : null,
    wide: wideUrl ? await load(wideUrl, onGpu) : null,
  });
  const computer = new GradientComputer(ort, {
    ...(await sessions(webgpu)),
    wideBatch,
    manifest,
    runtime: webgpu ? "webgpu" : "wasm",
    fallback: webgpu ? () => sessions(false) : null,
  });
  let result;
  const started = performance.now();
  for (let i = 0; i < repeat; i++) result = await computer.compute(params, { x, y });
  const seconds = (performance.now() - started) / 1000 / repeat;
  return { lossSum: result.lossSum, grad: result.grad, numSamples: result.numSamples, seconds, runtime: computer.runtime, fellBack: computer.fellBack };
}

// One bundle, two workers: the page's (the loop) and the loop's compute worker, told apart by name.
if (self.name === COMPUTE_THREAD) serveComputeThread(self);
else self.onmessage = onPageMessage;
