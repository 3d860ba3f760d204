// The gradient in a worker of its own, so that the tab's loop never waits for a microbatch to answer.
//
// onnxruntime-web's wasm run holds its thread for a whole microbatch (30-50 ms on W1). When the loop and
// the compute shared one thread, every step of a report and of the next lease's download (the fetch's
// answer, its body, its sha256, the upload's receipt, the site's next lease) waited for the microbatch in
// progress: a W1 step's report, commit and next download took 0.3-0.5 s of such waits, longer than the
// lease computing beside them, and the worker stood idle 40% of the time (its thread's CPU time over a
// 13.5 s window: 8.2 s). The loop (worker.js) now answers at once and the compute runs here, in a nested
// dedicated worker started from the same bundle (its name tells it apart), holding onnxruntime and the
// campaign's sessions.
//
//   loop -> compute  {type: "setup", ortUrl, webgpu}
//                    {type: "graph", sha256, bytes}            once per graph (bytes checked by the loop)
//                    {type: "forget", sha256}                  a graph no lease used lately: its bytes and sessions go
//                    {type: "compute", id, main, single, wide, wideBatch, manifest, paramCount, flat, samples}
//                    {type: "cancel", id}                      the lease was given back: stop between microbatches
//   compute -> loop  {type: "progress", id, done, total}
//                    {type: "result", id, result, runtime, fellBack}   result.grad transferred
//                    {type: "failed", id, error: {name, message}}

import { Cancelled, ComputeError, GradientComputer, createSession } from "./compute.js";

export const COMPUTE_THREAD = "crowdtrain-compute";
// Graphs the compute worker holds at most (each with its sessions): a campaign needs up to three (its
// microbatch's, batch 1's and the wide one), and a tab that lives through model changes would otherwise keep
// every graph it ever ran.
export const MOST_GRAPHS = 4;

/** onnxruntime-web from the site's copy in `dir`, the WebGPU build or the wasm one, set for a worker. */
export async function importOrt(dir, webgpu) {
  const ort = await import(/* webpackIgnore: true */ `${dir}${webgpu ? "ort.webgpu.min.mjs" : "ort.wasm.min.mjs"}`);
  ort.env.wasm.wasmPaths = dir;
  ort.env.wasm.numThreads = 1; // two threads were slower than one on 2 cores (issue 36)
  ort.env.wasm.proxy = false; // this is already a worker
  return ort;
}

/** The loop's side: a compute worker and the calls in flight to it. */
export class ComputeThread {
  /**
   * @param {{ortUrl: string, webgpu: boolean, WorkerImpl?: typeof Worker, url?: string}} options
   *   `url`: the bundle to start (this worker's own script).
   */
  constructor({ ortUrl, webgpu, WorkerImpl = globalThis.Worker, url = globalThis.location?.href }) {
    this.worker = new WorkerImpl(url, { type: "module", name: COMPUTE_THREAD });
    this.calls = new Map(); // id -> {resolve, reject, onProgress, cancelled}
    this.graphs = new Map(); // sha256 of graphs the compute worker holds -> true, least recently used first
    this.nextId = 1;
    this.broken = null; // the error that ended the compute worker: a new one is started for the next lease
    this.worker.onmessage = (event) => this.answer(event.data ?? {});
    this.worker.onerror = (event) => {
      const error = new ComputeError(`the compute worker failed: ${event.message || "see the browser console"}`);
      this.broken = error;
      for (const call of this.calls.values()) call.reject(error);
      this.calls.clear();
    };
    this.worker.postMessage({ type: "setup", ortUrl, webgpu });
  }

  /**
   * Send a graph's bytes once, read by `loadBytes(graph)` only when not sent before; later computes name it
   * by its sha256.
   */
  async ensureGraph(graph, loadBytes) {
    if (this.graphs.has(graph.sha256)) return;
    const bytes = await loadBytes(graph);
    if (this.graphs.has(graph.sha256)) return; // another lease sent it while these were read
    this.worker.postMessage({ type: "graph", sha256: graph.sha256, bytes });
    this.graphs.set(graph.sha256, true);
    for (const oldest of this.graphs.keys()) {
      if (this.graphs.size <= MOST_GRAPHS) break;
      this.graphs.delete(oldest);
      this.worker.postMessage({ type: "forget", sha256: oldest });
    }
  }

  /** Mark graphs as just used, so that forgetting takes others first. */
  touch(...sha256s) {
    for (const sha256 of sha256s) {
      if (sha256 && this.graphs.delete(sha256)) this.graphs.set(sha256, true);
    }
  }

  /**
   * A computer with GradientComputer's `compute(flat, samples, hooks)` that runs in the compute worker.
   * @param {{main: string, single: string | null, wide?: string | null, wideBatch?: number, manifest: object,
   *   paramCount: number}} graphs (by sha256)
   * @param {(result: {runtime: string, fellBack: string}) => void} onRuntime told what computed each lease
   */
  computer(graphs, onRuntime = () => {}) {
    return {
      compute: (flat, samples, { cancelled = () => false, onProgress = () => {} } = {}) => {
        const id = this.nextId++;
        if (this.broken) return Promise.reject(this.broken);
        this.touch(graphs.main, graphs.single, graphs.wide);
        return new Promise((resolve, reject) => {
          this.calls.set(id, { resolve, reject, cancelled, onProgress, sentCancel: false, onRuntime });
          // a copy of the parameters (the loop keeps its own as the base of the next delta)
          this.worker.postMessage({ type: "compute", id, ...graphs, flat, samples });
        });
      },
    };
  }

  answer(message) {
    const call = this.calls.get(message.id);
    if (call === undefined) return;
    if (message.type === "progress") {
      call.onProgress(message.done, message.total);
      if (!call.sentCancel && call.cancelled()) {
        call.sentCancel = true;
        this.worker.postMessage({ type: "cancel", id: message.id });
      }
      return;
    }
    this.calls.delete(message.id);
    if (message.type === "result") {
      call.onRuntime({ runtime: message.runtime, fellBack: message.fellBack });
      call.resolve(message.result);
    } else {
      call.reject(rebuilt(message.error));
    }
  }

  close() {
    this.worker.terminate();
  }
}

/** An error from the compute worker as the class the loop handles it by. */
export function rebuilt({ name = "Error", message = "" } = {}) {
  if (name === "Cancelled") return new Cancelled(message);
  if (name === "ComputeError" || name === "RuntimeFailure") return new ComputeError(message);
  return new Error(message);
}

/** The compute worker's side: onnxruntime, the campaign's sessions, one lease's gradient at a time. */
export function serveComputeThread(scope = self) {
  const held = { ort: null, ortUrl: "", webgpu: false, bytes: new Map(), sessions: new Map(), wasmOnly: new Set() };
  const cancelled = new Set();
  let queue = Promise.resolve(); // one step after another, in the order sent

  async function ort() {
    held.ort ??= await importOrt(held.ortUrl, held.webgpu);
    return held.ort;
  }

  async function session(sha256, webgpu) {
    const key = `${sha256}:${webgpu ? "webgpu" : "wasm"}`;
    if (!held.sessions.has(key)) {
      const bytes = held.bytes.get(sha256);
      if (bytes === undefined) throw new ComputeError(`the compute worker was not sent graph ${sha256.slice(0, 12)}`);
      held.sessions.set(key, await createSession(await ort(), bytes, { webgpu }));
    }
    return held.sessions.get(key);
  }

  async function compute(m) {
    if (cancelled.has(m.id)) throw new Cancelled("given back before it started");
    const onGpu = held.webgpu && !held.wasmOnly.has(m.main);
    const sessions = async (gpu) => ({
      session: await session(m.main, gpu),
      single: m.single ? await session(m.single, gpu) : null,
      wide: m.wide ? await session(m.wide, gpu) : null,
    });
    const computer = new GradientComputer(await ort(), {
      ...(await sessions(onGpu)),
      wideBatch: m.wideBatch ?? 0,
      manifest: m.manifest,
      paramCount: m.paramCount,
      runtime: onGpu ? "webgpu" : "wasm",
      fallback: onGpu
        ? async () => {
            held.wasmOnly.add(m.main);
            return sessions(false);
          }
        : null,
    });
    const result = await computer.compute(m.flat, m.samples, {
      cancelled: () => cancelled.has(m.id),
      onProgress: (done, total) => scope.postMessage({ type: "progress", id: m.id, done, total }),
    });
    scope.postMessage({ type: "result", id: m.id, result, runtime: computer.runtime, fellBack: computer.fellBack }, [result.grad.buffer]);
  }

  async function forget(sha256) {
    held.bytes.delete(sha256);
    held.wasmOnly.delete(sha256);
    for (const key of [`${sha256}:wasm`, `${sha256}:webgpu`]) {
      const gone = held.sessions.get(key);
      held.sessions.delete(key);
      await gone?.release?.().catch(() => {}); // its wasm memory goes back to the runtime
    }
  }

  // Graphs, forgets and computes run in the order sent: a forget queued behind a lease's compute waits for
  // it, and a graph sent again after a forget is not dropped by it.
  const inOrder = (step) => {
    queue = queue.then(step).catch((error) => console.error("crowdtrain compute worker:", error)); // the next step still runs
  };
  scope.onmessage = (event) => {
    const m = event.data ?? {};
    if (m.type === "setup") {
      held.ortUrl = m.ortUrl;
      held.webgpu = Boolean(m.webgpu);
    } else if (m.type === "cancel") {
      cancelled.add(m.id); // at once: a lease waiting in the queue is then never started
    } else if (m.type === "graph") {
      inOrder(() => held.bytes.set(m.sha256, m.bytes));
    } else if (m.type === "forget") {
      inOrder(() => forget(m.sha256));
    } else if (m.type === "compute") {
      inOrder(() =>
        compute(m)
          .catch((error) => scope.postMessage({ type: "failed", id: m.id, error: { name: error?.name ?? "Error", message: error?.message ?? String(error) } }))
          .finally(() => cancelled.delete(m.id)),
      );
    }
  };
  return held;
}
