// A lease's samples for a browser tab: shard bytes and sample ranges to the (x, y) inputs of the ONNX graph.
//
// The same reading as crowdtrain_agent.data.ShardReader and crowdtrain_agent.trainer.gather_samples
// (agent/PROTOCOL.md, "Shard formats"), so a tab trains on the very samples an agent would and a
// verification copy of its lease agrees. Each input is {type, data, dims}, the arguments of
// onnxruntime-web's `new ort.Tensor(type, data, dims)`:
//
// - text: raw bytes, `sample_len` per sample; x = s[:-1], y = s[1:], int64 ids (BigInt64Array).
// - tokens: little-endian u16/u32 ids, `sample_len` per sample, read like text; every id of the
//   shard below `vocab_size` (checked once per shard, as the agent does).
// - tensors: a safetensors file with `x` and `y`; x goes to the graph as float32 (image pixels stay
//   0..255: the graph maps them to -1..1 as the agent's loss does, `models.hf.pixels`), y as int64
//   labels (the agent's `.long()`).
//
// Image augmentation (lease.data.augment) is applied per range as the agent's `read_range` does, each
// image seeded by its shard, its index in the shard and the lease's base version (augment.js).

import { augmentImages, sampleSeed } from "./augment.js";

export class SampleError extends Error {
  constructor(message) {
    super(message);
    this.name = "SampleError";
  }
}

const MAX_SAFETENSORS_HEADER = 100_000_000; // safetensors' own bound on the JSON header

/** A shard checked and decoded once, read for many leases (the agent's ShardReader). */
export class ShardReader {
  /**
   * @param {{kind: string, sample_len: number, token_bytes?: number, vocab_size?: number}} spec the lease's `data`.
   * @param {Uint8Array} shard the shard's bytes, already checked against its sha256.
   * @throws {SampleError} if the bytes are not a valid shard of `spec`'s kind.
   */
  constructor(spec, shard) {
    this.spec = spec;
    if (spec.kind === "text") {
      if (spec.sample_len < 2) throw new SampleError(`text data needs sample_len >= 2, got ${spec.sample_len}`);
      this.count = Math.floor(shard.length / spec.sample_len);
      this.ids = shard;
    } else if (spec.kind === "tokens") {
      this.ids = tokenIds(spec, shard);
      this.count = this.ids.length / spec.sample_len;
    } else if (spec.kind === "tensors") {
      const arrays = readSafetensors(shard);
      const names = Object.keys(arrays).sort();
      if (names.join() !== "x,y" || arrays.x.shape[0] !== arrays.y.shape[0]) {
        throw new SampleError(`tensor shard must hold arrays x and y with equal rows, got ${names.join(", ")}`);
      }
      this.x = arrays.x;
      this.y = arrays.y;
      this.count = arrays.x.shape[0] ?? 0;
    } else {
      throw new SampleError(`data kind ${JSON.stringify(spec.kind)} is unknown to this tab; reload the page`);
    }
  }

  /**
   * Inputs and targets of samples `start` to `start + count`.
   * @returns {{x: Input, y: Input}}
   * @throws {SampleError} if the range lies outside the shard.
   */
  read(start, count) {
    if (!Number.isInteger(start) || !Number.isInteger(count) || start < 0 || count <= 0 || start + count > this.count) {
      throw new SampleError(`sample range ${start}+${count} lies outside a shard of ${this.count} samples`);
    }
    if (this.spec.kind === "text" || this.spec.kind === "tokens") {
      const width = this.spec.sample_len;
      const x = new BigInt64Array(count * (width - 1));
      const y = new BigInt64Array(count * (width - 1));
      for (let s = 0; s < count; s++) {
        const row = (start + s) * width;
        for (let t = 0; t < width - 1; t++) {
          x[s * (width - 1) + t] = BigInt(this.ids[row + t]);
          y[s * (width - 1) + t] = BigInt(this.ids[row + t + 1]);
        }
      }
      return { x: input("int64", x, [count, width - 1]), y: input("int64", y, [count, width - 1]) };
    }
    return { x: rows(this.x, start, count, "float32"), y: rows(this.y, start, count, "int64") };
  }
}

/**
 * Inputs and targets of every range of a lease, in lease order (the agent's gather_samples).
 *
 * @param {{shard: string, start: number, count: number}[]} ranges the lease's `ranges`.
 * @param {Map<string, ShardReader>} readers one reader per shard sha256 the ranges name.
 * @param {{augment?: string}} data the lease's `data`.
 * @param {number} version the lease's `base_version`, which seeds each epoch's augmentation anew.
 */
export function gatherSamples(ranges, readers, data = {}, version = 0) {
  const augment = data.augment ?? "none";
  if (!["none", "flip", "flip_crop"].includes(augment)) {
    throw new SampleError(`unknown augmentation ${JSON.stringify(augment)}; this tab knows flip and flip_crop`);
  }
  const parts = ranges.map((range) => {
    const reader = readers.get(range.shard);
    if (reader === undefined) throw new SampleError(`shard ${range.shard.slice(0, 12)} of the lease was not read`);
    const part = reader.read(range.start, range.count);
    if (augment !== "none") {
      if (part.x.type !== "float32" || part.x.dims.length !== 4) {
        throw new SampleError(`augmentation applies to images (N, C, H, W); these samples are [${part.x.dims}]`);
      }
      const seeds = Array.from({ length: range.count }, (_, i) => sampleSeed(range.shard, range.start + i, version));
      augmentImages(part.x, augment, seeds);
    }
    return part;
  });
  if (parts.length === 0) throw new SampleError("the lease names no samples");
  return { x: concat(parts.map((p) => p.x)), y: concat(parts.map((p) => p.y)) };
}

/**
 * The lease's samples cut into microbatches of `size` samples (the last may be shorter), in order:
 * the gradient of the lease is the sum over these, as the agent's `_summed_gradient` takes them.
 */
export function microbatches({ x, y }, size) {
  if (!Number.isInteger(size) || size < 1) throw new SampleError(`microbatch size must be at least 1, got ${size}`);
  const total = x.dims[0];
  const batches = [];
  for (let lo = 0; lo < total; lo += size) {
    const hi = Math.min(total, lo + size);
    batches.push({ x: slice(x, lo, hi), y: slice(y, lo, hi) });
  }
  return batches;
}

/**
 * @typedef {{type: "int64" | "float32", data: BigInt64Array | Float32Array, dims: number[]}} Input
 */
function input(type, data, dims) {
  return { type, data, dims };
}

function rowSize(dims) {
  return dims.slice(1).reduce((a, b) => a * b, 1);
}

function slice(tensor, lo, hi) {
  const width = rowSize(tensor.dims);
  return input(tensor.type, tensor.data.subarray(lo * width, hi * width), [hi - lo, ...tensor.dims.slice(1)]);
}

function concat(tensors) {
  if (tensors.length === 1) return tensors[0];
  const first = tensors[0];
  const total = tensors.reduce((sum, t) => sum + t.dims[0], 0);
  const data = new first.data.constructor(tensors.reduce((sum, t) => sum + t.data.length, 0));
  let at = 0;
  for (const t of tensors) {
    if (t.dims.slice(1).join() !== first.dims.slice(1).join()) {
      throw new SampleError(`the lease's shards hold samples of shapes ${first.dims.slice(1)} and ${t.dims.slice(1)}`);
    }
    data.set(t.data, at);
    at += t.data.length;
  }
  return input(first.type, data, [total, ...first.dims.slice(1)]);
}

/** A token shard's ids, checked: whole samples, and every id one the model has an embedding for. */
function tokenIds(spec, shard) {
  if (spec.sample_len < 2) throw new SampleError(`token data needs sample_len >= 2, got ${spec.sample_len}`);
  const width = spec.token_bytes;
  if (width !== 2 && width !== 4) throw new SampleError(`token shards hold 2- or 4-byte ids, not ${width}-byte ones`);
  const sampleBytes = spec.sample_len * width;
  if (shard.length % sampleBytes) {
    throw new SampleError(`a token shard of ${shard.length} bytes is not whole samples of ${sampleBytes} bytes`);
  }
  const copy = Uint8Array.prototype.slice.call(shard).buffer; // aligned, whatever the shard's offset
  const ids = width === 2 ? new Uint16Array(copy) : new Uint32Array(copy);
  for (let i = 0; i < ids.length; i++) {
    if (ids[i] >= spec.vocab_size) {
      throw new SampleError(`token ${i} of the shard is id ${ids[i]}, outside the vocabulary of ${spec.vocab_size}`);
    }
  }
  return ids;
}

const DTYPES = {
  F64: [8, (v, i) => v.getFloat64(i, true)],
  F32: [4, (v, i) => v.getFloat32(i, true)],
  F16: [2, (v, i) => halfValue(v.getUint16(i, true))],
  BF16: [2, (v, i) => new Float32Array(new Uint32Array([v.getUint16(i, true) << 16]).buffer)[0]],
  I64: [8, (v, i) => v.getBigInt64(i, true)],
  U64: [8, (v, i) => v.getBigInt64(i, true)], // torch's .long() wraps the top half, as this does
  I32: [4, (v, i) => v.getInt32(i, true)],
  U32: [4, (v, i) => v.getUint32(i, true)],
  I16: [2, (v, i) => v.getInt16(i, true)],
  U16: [2, (v, i) => v.getUint16(i, true)],
  I8: [1, (v, i) => v.getInt8(i)],
  U8: [1, (v, i) => v.getUint8(i)],
  BOOL: [1, (v, i) => (v.getUint8(i) ? 1 : 0)],
};

/** The arrays of a safetensors file, each {dtype, shape, view}, checked as the safetensors library checks them. */
export function readSafetensors(bytes) {
  const bad = (why) => new SampleError(`shard is not a valid safetensors file: ${why}`);
  if (bytes.length < 8) throw bad("shorter than its 8-byte header length");
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = Number(view.getBigUint64(0, true));
  if (headerLength > MAX_SAFETENSORS_HEADER || 8 + headerLength > bytes.length) throw bad(`header of ${headerLength} bytes`);
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(8, 8 + headerLength)));
  } catch (error) {
    throw bad(`its header is not JSON (${error.message})`);
  }
  if (header === null || typeof header !== "object" || Array.isArray(header)) throw bad("its header is not an object");
  const dataStart = 8 + headerLength;
  const arrays = {};
  const extents = [];
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const dtype = DTYPES[info?.dtype];
    const shape = info?.shape;
    const offsets = info?.data_offsets;
    if (dtype === undefined) throw bad(`array ${name} has dtype ${JSON.stringify(info?.dtype)}, which no shard uses`);
    if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) throw bad(`array ${name} has no valid shape`);
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(Number.isSafeInteger)) throw bad(`array ${name} has no valid data_offsets`);
    const [begin, end] = offsets;
    const size = shape.reduce((a, b) => a * b, 1) * dtype[0];
    if (begin < 0 || end < begin || end - begin !== size || dataStart + end > bytes.length) {
      throw bad(`array ${name} of shape [${shape}] does not fit its data_offsets [${begin}, ${end}]`);
    }
    extents.push([begin, end]);
    arrays[name] = { dtype: info.dtype, shape, view: new DataView(bytes.buffer, bytes.byteOffset + dataStart + begin, size) };
  }
  // The arrays tile the data exactly, as the library insists: no gaps, no overlaps, nothing after.
  extents.sort((a, b) => a[0] - b[0]);
  let covered = 0;
  for (const [begin, end] of extents) {
    if (begin !== covered) throw bad("its arrays leave gaps or overlap");
    covered = end;
  }
  if (dataStart + covered !== bytes.length) throw bad(`${bytes.length - dataStart - covered} bytes follow its arrays`);
  return arrays;
}

/** Rows `start` to `start + count` of a safetensors array, as the graph's input type. */
function rows(array, start, count, type) {
  const [width, read] = DTYPES[array.dtype];
  const perRow = rowSize(array.shape);
  const n = count * perRow;
  const at = start * perRow * width;
  if (type === "float32") {
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = Number(read(array.view, at + i * width));
    return input(type, out, [count, ...array.shape.slice(1)]);
  }
  const out = new BigInt64Array(n);
  for (let i = 0; i < n; i++) {
    const v = read(array.view, at + i * width);
    if (typeof v === "bigint") out[i] = v;
    else if (Number.isFinite(v)) out[i] = BigInt(Math.trunc(v)); // torch's .long() truncates toward zero
    else throw new SampleError(`label ${start + Math.floor(i / perRow)} is ${v}, which is no class`);
  }
  return input(type, out, [count, ...array.shape.slice(1)]);
}

/** The value of an fp16 bit pattern (exact in a double). */
function halfValue(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const mantissa = h & 0x3ff;
  if (exponent === 0) return sign * mantissa * 2 ** -24;
  if (exponent === 0x1f) return mantissa ? NaN : sign * Infinity;
  return sign * (1024 + mantissa) * 2 ** (exponent - 25);
}
