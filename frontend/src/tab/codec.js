// Gradient codecs for a browser tab: the bytes crowdtrain_agent.codec writes, bit for bit.
//
// An aggregator cannot tell a tab from an agent, and must not have to: it decodes an upload
// with the same code whatever sent it, and the verification referee compares a tab's gradient
// with an agent's. So every rounding step below is the one torch takes on the agent
// (agent/PROTOCOL.md, "Codecs"); tests/tab/test_tab_wire_matches_python.py compares the bytes.
//
// Arithmetic: a JavaScript number is a double. Math.fround after each fp32 operation gives
// the fp32 result torch computes, because a double holds any sum, product or quotient of two
// fp32 values closely enough that rounding it once more to fp32 is the correctly rounded fp32
// result (double rounding is innocuous for +, -, *, / from 24-bit to 53-bit precision).

export const INT8_BLOCK_SIZE = 256; // the campaign setting's default (lease.codec_block_size)
export const MIN_INT8_BLOCK_SIZE = 32;
export const MAX_INT8_BLOCK_SIZE = 1 << 16;
export const CODECS = Object.freeze(["fp32", "fp16", "int8"]);

// Typed arrays use the machine's byte order and the wire is little-endian. Every browser and
// Node on the machines volunteers have is little-endian; a big-endian one is refused at load,
// rather than sending byte-swapped gradients that would be refused one upload at a time.
if (new Uint8Array(new Uint32Array([1]).buffer)[0] !== 1) {
  throw new Error("crowdtrain tab: this machine is big-endian; the protocol's typed-array code needs little-endian");
}

/** A payload that no aggregator would accept, or a caller's mistake with a codec's parameters. */
export class CodecError extends Error {
  constructor(message) {
    super(message);
    this.name = "CodecError";
  }
}

/** Bytes of a slice of `n` elements in `codec`: what the aggregator expects, exactly. */
export function encodedSize(codec, n, blockSize = INT8_BLOCK_SIZE) {
  checkCount(n);
  if (codec === "fp32") return 4 * n;
  if (codec === "fp16") return 2 * n;
  if (codec === "int8") return n + 4 * Math.ceil(n / checkBlockSize(blockSize));
  throw new CodecError(`unknown codec ${JSON.stringify(codec)}; known codecs: ${CODECS.join(", ")}`);
}

/** The payload of `values` (a Float32Array) in the lease's codec, without error feedback. */
export function encode(codec, values, blockSize = INT8_BLOCK_SIZE) {
  if (codec === "fp32") return encodeFp32(values);
  if (codec === "fp16") return encodeFp16(values);
  if (codec === "int8") return encodeInt8(values, blockSize);
  throw new CodecError(`unknown codec ${JSON.stringify(codec)}; known codecs: ${CODECS.join(", ")}`);
}

/** Raw little-endian fp32: a byte copy (NaN payloads kept), so later changes to `values` do not leak in. */
export function encodeFp32(values) {
  return new Uint8Array(Float32Array.prototype.slice.call(values).buffer);
}

/** fp16 bytes as torch's `.to(torch.float16)`: round to nearest even, too large becomes inf. */
export function encodeFp16(values) {
  const bits = new Uint32Array(values.buffer, values.byteOffset, values.length);
  const out = new Uint16Array(values.length);
  for (let i = 0; i < bits.length; i++) out[i] = halfBits(bits[i]);
  return new Uint8Array(out.buffer);
}

/**
 * The fp16 bit pattern of the fp32 value whose bits are `x`, rounded to nearest even.
 *
 * Works on the bits rather than on Math.fround-style arithmetic because fp16 subnormals and
 * the overflow boundary (65520 and up become inf) are where hand-rolled float code goes wrong.
 * A NaN becomes the quiet NaN 0x7e00 with its sign, as torch's conversion makes of the NaN an
 * fp32 computation produces.
 */
export function halfBits(x) {
  const sign = (x >>> 16) & 0x8000;
  const exponent = (x >>> 23) & 0xff;
  let mantissa = x & 0x7fffff;
  if (exponent === 0xff) return sign | (mantissa ? 0x7e00 : 0x7c00);
  const e = exponent - 112; // fp16's biased exponent: exponent - 127 + 15
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign; // below half the smallest subnormal: rounds to zero
    mantissa |= 0x800000;
    const shift = 14 - e; // from the 24-bit significand to units of 2**-24, fp16's smallest subnormal
    let h = mantissa >>> shift;
    const rest = mantissa & ((1 << shift) - 1);
    const half = 1 << (shift - 1);
    if (rest > half || (rest === half && h & 1)) h++; // a carry into the exponent is still right
    return sign | h;
  }
  let h = (e << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && h & 1)) h++; // a carry out of 0x7bff gives inf, as it should
  return sign | h;
}

/**
 * Blockwise absmax quantization, as `crowdtrain_agent.codec.quantize_int8` with fp32 scales.
 *
 * Refuses NaN and infinity: the agent checks a gradient is finite before it encodes it and gives
 * the lease back otherwise (an aggregator refuses such a payload and counts it against the
 * volunteer), and torch's conversion of NaN to int8 has no defined result to copy.
 *
 * @returns {{q: Int8Array, scale: Float32Array}} one value in -127..127 per element, one scale per block.
 */
export function quantizeInt8(values, blockSize = INT8_BLOCK_SIZE) {
  checkBlockSize(blockSize);
  const n = values.length;
  const blocks = Math.ceil(n / blockSize);
  const q = new Int8Array(n);
  const scale = new Float32Array(blocks);
  const word = new Float32Array(1);
  const wordBits = new Uint32Array(word.buffer);
  for (let b = 0; b < blocks; b++) {
    const lo = b * blockSize;
    const hi = Math.min(n, lo + blockSize);
    let absmax = 0;
    for (let i = lo; i < hi; i++) {
      const a = Math.abs(values[i]);
      if (!(a <= 3.4028234663852886e38)) throw notFinite(values, i);
      if (a > absmax) absmax = a;
    }
    // Round the stored scale up, never down, so no value needs more than 127 steps (the
    // agent's rule); stored * 127 is exact in a double, as in the agent's float64 check.
    word[0] = absmax / 127;
    if (word[0] * 127 < absmax) wordBits[0] += 1;
    // Near fp32's largest value 127 scales rounded up overflow: take the float below.
    if (Math.fround(word[0] * 127) === Infinity) wordBits[0] -= 1;
    const s = word[0];
    scale[b] = s;
    const safe = s > 0 ? s : 1; // an all-zero block has scale 0 and its values stay 0
    for (let i = lo; i < hi; i++) {
      let v = roundHalfEven(Math.fround(values[i] / safe));
      if (v > 127) v = 127;
      else if (v < -127) v = -127;
      q[i] = v;
    }
  }
  return { q, scale };
}

/** What the aggregator's decoder makes of `quantizeInt8`'s result, bit for bit (fp32 products). */
export function dequantizeInt8(q, scale, blockSize = INT8_BLOCK_SIZE) {
  checkBlockSize(blockSize);
  const out = new Float32Array(q.length);
  for (let i = 0; i < q.length; i++) out[i] = q[i] * scale[Math.floor(i / blockSize)];
  return out;
}

/** The scales of every block (fp32, little-endian), then one signed byte per element. */
export function encodeInt8(values, blockSize = INT8_BLOCK_SIZE) {
  const { q, scale } = quantizeInt8(values, blockSize);
  return encodeInt8Parts(q, scale);
}

/** The wire bytes of an already quantized slice. */
export function encodeInt8Parts(q, scale) {
  const out = new Uint8Array(4 * scale.length + q.length);
  out.set(new Uint8Array(scale.buffer, scale.byteOffset, 4 * scale.length), 0);
  out.set(new Uint8Array(q.buffer, q.byteOffset, q.length), 4 * scale.length);
  return out;
}

/** torch.round: halves go to the even neighbour (Math.round sends them up). */
function roundHalfEven(v) {
  let r = Math.round(v);
  if (r - v === 0.5 && r % 2 !== 0) r -= 1;
  return r;
}

function notFinite(values, i) {
  return new CodecError(
    `the gradient holds ${values[i]} at element ${i}; it cannot be uploaded (the aggregator refuses it and ` +
      "counts it against you): give the lease back (release) and lower the learning rate if it happens again",
  );
}

function checkCount(n) {
  if (!Number.isSafeInteger(n) || n < 0) throw new CodecError(`element count must be an integer >= 0, got ${n}`);
}

function checkBlockSize(blockSize) {
  if (!Number.isInteger(blockSize) || blockSize < MIN_INT8_BLOCK_SIZE || blockSize > MAX_INT8_BLOCK_SIZE) {
    throw new CodecError(
      `int8 block size ${blockSize} is out of bounds; the lease's codec_block_size lies in ` +
        `${MIN_INT8_BLOCK_SIZE} to ${MAX_INT8_BLOCK_SIZE}, so the site sent something this tab does not know`,
    );
  }
  return blockSize;
}
