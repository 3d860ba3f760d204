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
//                    {type: "compute", id, main, single, manifest, paramCount, flat, samples}
//                    {type: "cancel", id}                      the lease was given back: stop between microbatches
//   compute -> loop  {type: "progress", id, done, total}
//                    {type: "result", id, result, runtime, fellBack}   result.grad transferred
//                    {type: "failed", id, error: {name, message}}

import { Cancelled, ComputeError, GradientComputer, createSession } from "./compute.js";

export const COMPUTE_THREAD = "crowdtrain-compute";

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
    this.graphs = new Set(); // sha256 of graphs sent
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

  /** Send a graph's bytes once; later computes name it by its sha256. */
  sendGraph(graph, bytes) {
    if (this.graphs.has(graph.sha256)) return;
    this.worker.postMessage({ type: "graph", sha256: graph.sha256, bytes });
    this.graphs.add(graph.sha256);
  }

  hasGraph(sha256) {
    return this.graphs.has(sha256);
  }

  /**
   * A computer with GradientComputer's `compute(flat, samples, hooks)` that runs in the compute worker.
   * @param {{main: string, single: string | null, manifest: object, paramCount: number}} graphs
   * @param {(result: {runtime: string, fellBack: string}) => void} onRuntime told what computed each lease
   */
  computer(graphs, onRuntime = () => {}) {
    return {
      compute: (flat, samples, { cancelled = () => false, onProgress = () => {} } = {}) => {
        const id = this.nextId++;
        if (this.broken) return Promise.reject(this.broken);
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
  let queue = Promise.resolve(); // computes one after another, in the order asked

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
    const onGpu = held.webgpu && !held.wasmOnly.has(m.main);
    const sessions = async (gpu) => ({ session: await session(m.main, gpu), single: m.single ? await session(m.single, gpu) : null });
    const computer = new GradientComputer(await ort(), {
      ...(await sessions(onGpu)),
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

  scope.onmessage = (event) => {
    const m = event.data ?? {};
    if (m.type === "setup") {
      held.ortUrl = m.ortUrl;
      held.webgpu = Boolean(m.webgpu);
    } else if (m.type === "graph") {
      held.bytes.set(m.sha256, m.bytes);
    } else if (m.type === "cancel") {
      cancelled.add(m.id);
    } else if (m.type === "compute") {
      queue = queue.then(() =>
        compute(m)
          .catch((error) => scope.postMessage({ type: "failed", id: m.id, error: { name: error?.name ?? "Error", message: error?.message ?? String(error) } }))
          .finally(() => cancelled.delete(m.id)),
      );
    }
  };
}
