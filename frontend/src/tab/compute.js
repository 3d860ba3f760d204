// A lease's gradient in a tab: the site's ONNX gradient graph run microbatch by microbatch with onnxruntime-web.
//
// The graph (docs/browser-compute.md) takes every parameter in torch layout, in the flat vector's order,
// then the microbatch's x and y; it answers the loss (the sum over the microbatch of each sample's mean
// loss, what the agent reports) and each parameter's gradient in the same order. The lease's gradient is
// the sum over its microbatches, as the agent's `_summed_gradient` takes it; samples left over after the
// last whole microbatch go through the batch-1 graph one by one (its shapes are fixed as well). Where the
// site gave a wide graph (several microbatches a run, for a model whose samples do not meet in a batch,
// gated against their sum), whole groups of that many microbatches run through it: each run copies every
// parameter in and every gradient out, so fewer runs cost less.
//
// `ort` is passed in (the onnxruntime-web module the worker loaded), so this module runs wherever a
// runtime does: the worker, and the Chromium test that compares it with PyTorch.

export class ComputeError extends Error {
  constructor(message) {
    super(message);
    this.name = "ComputeError";
  }
}

/**
 * onnxruntime could not run the graph at all (an operator its execution provider lacks: WebGPU has no
 * MaxPool with indices, which a CNN's gradient needs), as opposed to a result that came out wrong.
 */
export class RuntimeFailure extends ComputeError {
  constructor(message) {
    super(message);
    this.name = "RuntimeFailure";
  }
}

/** A lease stopped between microbatches (paused, page hidden or closed): the lease is given back. */
export class Cancelled extends Error {
  constructor(message = "stopped") {
    super(message);
    this.name = "Cancelled";
  }
}

const size = (shape) => shape.reduce((a, b) => a * b, 1);

/**
 * `into += g`, four elements a turn: it runs over every parameter once a microbatch, and V8 does not unroll
 * the plain loop (docs/performance.md has what it saves).
 */
export function addInto(into, g) {
  const n = g.length;
  let j = 0;
  for (; j + 4 <= n; j += 4) {
    into[j] += g[j];
    into[j + 1] += g[j + 1];
    into[j + 2] += g[j + 2];
    into[j + 3] += g[j + 3];
  }
  for (; j < n; j++) into[j] += g[j];
}

/**
 * Let the worker's queued events run between two microbatches: a pause from the page, a reply from the
 * site, the next step of an upload. onnxruntime-web's wasm run settles in microtasks only, so without
 * this a lease's whole compute held them back: a report's done_ack waited for the next lease's last
 * microbatch (0.6 s on W1), and a pause for the end of the lease. A MessageChannel round trip is a task
 * without setTimeout's 4 ms clamp.
 */
export function yieldToEvents() {
  return new Promise((resolve) => {
    if (typeof MessageChannel !== "function") {
      setTimeout(resolve, 0);
      return;
    }
    const channel = new MessageChannel();
    channel.port1.onmessage = () => {
      channel.port1.close();
      resolve();
    };
    channel.port2.postMessage(null);
  });
}

/**
 * Where each parameter lies in the flat vector, from the graph's manifest, checked against the lease.
 *
 * @param {{inputs: {name: string, shape: number[], dtype: string}[], outputs: {name: string}[]}} manifest
 * @param {number | null} paramCount the lease's `param_count` (null: not checked).
 * @returns {{params: {name: string, shape: number[], offset: number, size: number}[], x: object, y: object,
 *   outputs: string[], total: number}}
 * @throws {ComputeError} for a manifest that cannot belong to the lease's model.
 */
export function layoutOf(manifest, paramCount = null) {
  const inputs = manifest?.inputs;
  const outputs = manifest?.outputs;
  if (!Array.isArray(inputs) || !Array.isArray(outputs) || inputs.length < 3 || outputs.length !== inputs.length - 1) {
    throw new ComputeError("the graph's manifest does not list parameters, x and y and their gradients; reload the page");
  }
  const params = [];
  let offset = 0;
  for (const spec of inputs.slice(0, -2)) {
    if (spec.dtype !== "float32" || !Array.isArray(spec.shape) || !spec.shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
      throw new ComputeError(`the graph's parameter ${spec.name} is not a float32 tensor of known shape`);
    }
    params.push({ name: spec.name, shape: spec.shape, offset, size: size(spec.shape) });
    offset += size(spec.shape);
  }
  if (paramCount !== null && offset !== paramCount) {
    throw new ComputeError(
      `the graph's parameters hold ${offset} values where the lease's model has ${paramCount}; ` +
        "the graph belongs to another model config, the lease is given back",
    );
  }
  const [x, y] = inputs.slice(-2);
  return { params, x, y, outputs: outputs.map((o) => o.name), total: offset };
}

/**
 * An onnxruntime-web session for graph bytes: wasm on one thread, or WebGPU where asked.
 *
 * @param {object} ort the onnxruntime-web module.
 * @param {Uint8Array} bytes the ONNX graph.
 * @param {{webgpu?: boolean}} options
 */
export async function createSession(ort, bytes, { webgpu = false } = {}) {
  return ort.InferenceSession.create(bytes, {
    executionProviders: webgpu ? ["webgpu"] : ["wasm"],
    graphOptimizationLevel: "all",
  });
}

/** The summed loss and gradient of a lease's samples through one graph and its batch-1 companion. */
export class GradientComputer {
  /**
   * @param {object} ort the onnxruntime-web module (for `ort.Tensor`).
   * @param {{session: object, single: object | null, wide?: object | null, wideBatch?: number, manifest: object,
   *   paramCount?: number | null}} graphs
   *   `session` runs microbatches of the manifest's size; `single` one sample (null when that size is 1);
   *   `wide`, where given, `wideBatch` samples (a multiple of the microbatch).
   */
  constructor(ort, { session, single = null, wide = null, wideBatch = 0, manifest, paramCount = null, runtime = "wasm", fallback = null }) {
    this.ort = ort;
    this.session = session;
    this.single = single;
    this.wide = wide;
    this.wideBatch = wideBatch; // used only with `wide`
    this.layout = layoutOf(manifest, paramCount);
    // A lease with a partial last microbatch needs `single`; compute() says so when it lacks one.
    this.batch = manifest.microbatch_size ?? this.layout.x.shape[0];
    if (wide && !(Number.isSafeInteger(wideBatch) && wideBatch > this.batch && wideBatch % this.batch === 0)) {
      throw new ComputeError(`a wide graph of ${wideBatch} samples is not a whole number of microbatches of ${this.batch}; reload the page`);
    }
    this.runtime = runtime; // "webgpu" or "wasm": what computes now
    // async (failure) => ({session, single, wide}) on wasm, for graphs WebGPU cannot run (null: none to fall to)
    this.fallback = fallback;
    this.fellBack = ""; // why WebGPU gave way to wasm, once it did
  }

  /**
   * Sum the loss and gradient over `samples` (lease order); on a runtime that cannot run the graph, the
   * lease's samples again from the first on the fallback's (wasm) sessions.
   * @see GradientComputer#computeOn
   */
  async compute(params, samples, hooks = {}) {
    try {
      return await this.computeOn(params, samples, hooks);
    } catch (error) {
      if (!(error instanceof RuntimeFailure) || this.fallback === null) throw error;
      const fallback = this.fallback;
      this.fallback = null;
      Object.assign(this, { wide: null }, await fallback(error), { runtime: "wasm", fellBack: error.message });
      return this.computeOn(params, samples, hooks);
    }
  }

  /**
   * Sum the loss and gradient over `samples` (lease order) on the sessions held now.
   *
   * @param {Float32Array} params the flat parameter vector (param_count values).
   * @param {{x: {type: string, data: any, dims: number[]}, y: {type: string, data: any, dims: number[]}}} samples
   *   the lease's inputs and targets (samples.js gatherSamples).
   * @param {{cancelled?: () => boolean, onProgress?: (done: number, total: number) => void}} hooks
   * @returns {Promise<{grad: Float32Array, lossSum: number, numSamples: number, computeS: number}>}
   * @throws {Cancelled} if `cancelled()` turned true between two microbatches.
   * @throws {RuntimeFailure} if onnxruntime could not run the graph.
   */
  async computeOn(params, samples, { cancelled = () => false, onProgress = () => {} } = {}) {
    const { layout } = this;
    if (params.length !== layout.total) {
      throw new ComputeError(`the parameters hold ${params.length} values, the graph ${layout.total}`);
    }
    const total = samples.x.dims[0];
    if (samples.y.dims[0] !== total) throw new ComputeError("the lease's inputs and targets count different samples");
    const started = performance.now();
    const feeds = {};
    for (const p of layout.params) feeds[p.name] = new this.ort.Tensor("float32", params.subarray(p.offset, p.offset + p.size), p.shape);
    const grad = new Float32Array(layout.total);
    let lossSum = 0;
    let done = 0;
    while (done < total) {
      if (cancelled()) throw new Cancelled();
      const left = total - done;
      const [count, session] =
        this.wide && left >= this.wideBatch ? [this.wideBatch, this.wide] : left >= this.batch ? [this.batch, this.session] : [1, this.single];
      if (session === null) {
        throw new ComputeError(
          `the lease has ${total - done} samples left after its whole microbatches of ${this.batch}, ` +
            "and the site gave no batch-1 graph for them",
        );
      }
      feeds[layout.x.name] = this.tensor(samples.x, done, count);
      feeds[layout.y.name] = this.tensor(samples.y, done, count);
      let answer;
      try {
        answer = await session.run(feeds);
      } catch (error) {
        throw new RuntimeFailure(`onnxruntime (${this.runtime}) could not run the graph: ${error?.message ?? error}`);
      }
      const loss = answer[layout.outputs[0]].data[0];
      lossSum += Number(loss);
      layout.params.forEach((p, i) => {
        const g = answer[layout.outputs[i + 1]].data;
        if (g.length !== p.size) throw new ComputeError(`the graph's ${layout.outputs[i + 1]} has ${g.length} values, not ${p.size}`);
        const into = grad.subarray(p.offset, p.offset + p.size);
        if (done === 0) into.set(g); // the first microbatch's gradient is the sum so far: a copy, not a pass of adds
        else addInto(into, g);
      });
      for (const name of layout.outputs) answer[name].dispose?.();
      done += count;
      onProgress(done, total);
      await yieldToEvents();
    }
    if (!Number.isFinite(lossSum)) throw new ComputeError(`the loss came out ${lossSum}; the lease is given back`);
    return { grad, lossSum, numSamples: total, computeS: (performance.now() - started) / 1000 };
  }

  tensor(input, start, count) {
    const row = size(input.dims.slice(1));
    return new this.ort.Tensor(input.type, input.data.subarray(start * row, (start + count) * row), [count, ...input.dims.slice(1)]);
  }
}
