// Runs the browser tab's wire modules (frontend/src/tab/) on vectors the Python tests wrote, for them to compare.
//
//   node tests/tab/run_vectors.mjs DIR
//
// DIR/cases.json is a list of cases, each {name, op, ...}; binary inputs are files in DIR named by
// the case. Each case's outputs go to DIR/<name>.* files, and DIR/results.json maps every name to
// {ok: true, value} or {ok: false, error: <the error class>, message}: a refusal is a result too.

import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { encode, encodedSize } from "../../frontend/src/tab/codec.js";
import { ErrorFeedback } from "../../frontend/src/tab/feedback.js";
import { sliceUpload } from "../../frontend/src/tab/frames.js";
import { paramsFromResponse } from "../../frontend/src/tab/deltas.js";
import { ShardReader, gatherSamples, microbatches } from "../../frontend/src/tab/samples.js";
import { AGGREGATOR_TO_TAB, SITE_TO_TAB, encodeMessage, hello, parseMessage } from "../../frontend/src/tab/messages.js";

const dir = process.argv[2];
const read = (file) => new Uint8Array(readFileSync(join(dir, file)));
const floats = (file) => new Float32Array(read(file).buffer);
const write = (file, bytes) => writeFileSync(join(dir, file), bytes);

const OPS = {
  encode(c) {
    write(`${c.name}.out`, encode(c.codec, floats(c.input), c.block));
    return { size: encodedSize(c.codec, floats(c.input).length, c.block) };
  },
  encoded_size(c) {
    return encodedSize(c.codec, c.n, c.block);
  },
  feedback(c) {
    const feedback = new ErrorFeedback();
    c.uploads.forEach((upload, i) => {
      write(`${c.name}.out.${i}`, feedback.encode(upload.key, floats(upload.input)));
      const residual = feedback.residual(upload.key);
      write(`${c.name}.residual.${i}`, residual === undefined ? new Uint8Array(0) : new Uint8Array(residual.buffer));
    });
    return c.uploads.length;
  },
  upload(c) {
    const { text, frames, bytesUp } = sliceUpload({
      ticket: c.ticket,
      sliceIndex: c.slice_index,
      codec: c.codec,
      codecBlockSize: c.block,
      numElements: c.num_elements,
      payload: read(c.payload),
    }, c.minor);
    frames.forEach((frame, i) => write(`${c.name}.frame.${i}`, frame));
    return { text, frames: frames.length, bytes_up: bytesUp };
  },
  async params(c) {
    const held = c.held === null ? null : { version: c.held_version, params: floats(c.held) };
    const answer = await paramsFromResponse({ headers: new Headers(c.headers), body: read(c.body), numElements: c.num_elements, held });
    write(`${c.name}.out`, new Uint8Array(answer.params.buffer));
    return { delta: answer.delta, etag: answer.etag };
  },
  samples(c) {
    const readers = new Map(Object.entries(c.shards).map(([sha, file]) => [sha, new ShardReader(c.data, read(file))]));
    const batches = microbatches(gatherSamples(c.ranges, readers, c.data, c.version ?? 0), c.microbatch_size);
    return batches.map((batch, i) => {
      for (const part of ["x", "y"]) {
        const data = batch[part].data;
        write(`${c.name}.${i}.${part}`, new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
      }
      return { x: [batch.x.type, batch.x.dims], y: [batch.y.type, batch.y.dims] };
    });
  },
  parse(c) {
    let ignored = null;
    const allowed = c.channel === "aggregator" ? AGGREGATOR_TO_TAB : SITE_TO_TAB;
    const message = parseMessage(c.text, allowed, (kind, fields) => (ignored = { kind, fields }));
    return { message, ignored };
  },
  send(c) {
    return c.kind === "hello" ? hello(c.fields, c.minor ?? undefined) : encodeMessage(c.kind, c.fields, c.minor);
  },
};

const results = {};
for (const c of JSON.parse(readFileSync(join(dir, "cases.json"), "utf8"))) {
  try {
    results[c.name] = { ok: true, value: await OPS[c.op](c) };
  } catch (error) {
    results[c.name] = { ok: false, error: error.name, message: error.message };
  }
}
writeFileSync(join(dir, "results.json"), JSON.stringify(results));
