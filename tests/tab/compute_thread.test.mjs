// The compute worker's side (frontend/src/tab/compute_thread.js serveComputeThread) on onnxruntime-web's
// wasm under Node, fed graphs and a lease that test_tab_compute_thread.py exported: run by that test.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { serveComputeThread } from "../../frontend/src/tab/compute_thread.js";

const dir = process.env.CROWDTRAIN_TAB_CASE;
const read = (file) => readFileSync(join(dir, file));
const spec = JSON.parse(read("spec.json"));
const flat = () => new Float32Array(new Uint8Array(read("params.bin")).buffer);
const samples = () => ({
  x: { type: "float32", data: new Float32Array(new Uint8Array(read("x.bin")).buffer), dims: spec.x },
  y: { type: "int64", data: new BigInt64Array(new Uint8Array(read("y.bin")).buffer), dims: spec.y },
});

/** A stand-in for the worker's global scope: what the compute worker posts, and a way to send it messages. */
function scope() {
  const posted = [];
  const s = { posted, postMessage: (message) => posted.push(message) };
  s.send = (message) => s.onmessage({ data: message });
  s.answer = async (id) => {
    for (let waited = 0; waited < 60_000; waited += 10) {
      const found = posted.find((m) => m.id === id && (m.type === "result" || m.type === "failed"));
      if (found) return found;
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    throw new Error(`no answer to compute ${id} in 60 s`);
  };
  return s;
}

const compute = (id, { wide = false } = {}) => ({
  type: "compute", id, main: spec.main, single: spec.single, manifest: spec.manifest,
  ...(wide ? { wide: spec.wide, wideBatch: spec.wideBatch } : {}),
  paramCount: flat().length, flat: flat(), samples: samples(),
});
const expected = () => new Float32Array(new Uint8Array(read("expected.bin")).buffer);

/** The largest difference from the agent's gradient, in units of the tolerance (1e-6 + 1e-4 of the value). */
function offBy(grad) {
  let worst = 0;
  expected().forEach((e, i) => {
    worst = Math.max(worst, Math.abs(grad[i] - e) / (1e-6 + 1e-4 * Math.abs(e)));
  });
  return worst;
}

test("a lease's gradient is the agent's; one given back while queued never starts", async () => {
  const worker = scope();
  serveComputeThread(worker);
  worker.send({ type: "setup", ortUrl: spec.ort, webgpu: false });
  worker.send({ type: "graph", sha256: spec.main, bytes: new Uint8Array(read("main.onnx")) });
  worker.send({ type: "graph", sha256: spec.single, bytes: new Uint8Array(read("single.onnx")) });
  worker.send(compute(1));
  worker.send(compute(2));
  worker.send({ type: "cancel", id: 2 }); // given back while lease 1 computes

  const first = await worker.answer(1);
  assert.equal(first.type, "result", JSON.stringify(first.error));
  assert.equal(first.result.numSamples, spec.x[0]);
  assert.ok(Math.abs(first.result.lossSum - spec.loss) <= 1e-5 * Math.abs(spec.loss), `${first.result.lossSum} vs ${spec.loss}`);
  assert.equal(first.result.grad.length, expected().length);
  const worst = offBy(first.result.grad);
  assert.ok(worst <= 1, `the worker's gradient is off the agent's by ${worst}x the tolerance`);
  const progress = worker.posted.filter((m) => m.type === "progress" && m.id === 1).map((m) => m.done);
  assert.deepEqual(progress, [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 41]);

  const second = await worker.answer(2);
  assert.deepEqual([second.type, second.error.name], ["failed", "Cancelled"]);
  assert.equal(worker.posted.filter((m) => m.type === "progress" && m.id === 2).length, 0, "a cancelled lease computed");
});

test("a forgotten graph's sessions go, and a graph sent again after its forget is kept", async () => {
  const worker = scope();
  const held = serveComputeThread(worker);
  worker.send({ type: "setup", ortUrl: spec.ort, webgpu: false });
  worker.send({ type: "graph", sha256: spec.main, bytes: new Uint8Array(read("main.onnx")) });
  worker.send({ type: "graph", sha256: spec.single, bytes: new Uint8Array(read("single.onnx")) });
  worker.send(compute(1));
  worker.send({ type: "forget", sha256: spec.main }); // queued behind lease 1, which still needs it
  worker.send(compute(2));
  assert.equal((await worker.answer(1)).type, "result");
  const second = await worker.answer(2);
  assert.equal(second.type, "failed");
  assert.match(second.error.message, /was not sent graph/);
  assert.deepEqual([...held.sessions.keys()], [`${spec.single}:wasm`]);
  assert.equal(held.bytes.has(spec.main), false);

  worker.send({ type: "forget", sha256: spec.single });
  worker.send({ type: "graph", sha256: spec.single, bytes: new Uint8Array(read("single.onnx")) });
  worker.send({ type: "graph", sha256: spec.main, bytes: new Uint8Array(read("main.onnx")) });
  worker.send(compute(3));
  assert.equal((await worker.answer(3)).type, "result");
});

test("whole groups of microbatches run through the wide graph, and the sum is still the agent's", async () => {
  const worker = scope();
  serveComputeThread(worker);
  worker.send({ type: "setup", ortUrl: spec.ort, webgpu: false });
  for (const [sha256, file] of [[spec.main, "main.onnx"], [spec.single, "single.onnx"], [spec.wide, "wide.onnx"]]) {
    worker.send({ type: "graph", sha256, bytes: new Uint8Array(read(file)) });
  }
  worker.send(compute(1, { wide: true }));
  const answer = await worker.answer(1);
  assert.equal(answer.type, "result", JSON.stringify(answer.error));
  const progress = worker.posted.filter((m) => m.type === "progress").map((m) => m.done);
  assert.deepEqual(progress, [16, 32, 36, 40, 41]);
  const worst = offBy(answer.result.grad);
  assert.ok(worst <= 1, `the wide graph's sum is off the agent's by ${worst}x the tolerance`);
  assert.ok(Math.abs(answer.result.lossSum - spec.loss) <= 1e-5 * Math.abs(spec.loss));
});
