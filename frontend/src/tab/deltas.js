// Parameter downloads for a browser tab: a full fp32 version, or a delta from the version the tab holds.
//
// The same rules as crowdtrain_agent.deltas and crowdtrain_agent.fetch (agent/PROTOCOL.md, "Deltas"):
// a delta body is the XOR of the wanted and held fp32 bit patterns, its 4n bytes shuffled into four
// planes (byte 0 of every element, then bytes 1, 2, 3), compressed as one zstd frame that states its
// content size. Everything in a body comes from the network, so it is checked before it is
// decompressed (size, frame header, content size, the blocks reach exactly the end of the body),
// and the result is used only once its sha256 matches the aggregator's X-Crowdtrain-Sha256: a delta
// that fails any check is refused with DeltaError, and the caller downloads the version in full.
//
// zstd: fzstd, pinned exactly in frontend/package.json. It is a decompressor only (a tab never
// compresses), pure JavaScript with no dependencies and no WebAssembly to serve, small and
// maintained (MIT); the wasm builds of libzstd on npm are faster but bring a second binary for the
// site to serve next to onnxruntime-web's, and a tab decodes one slice's delta per lease.

import { decompress } from "fzstd";

export const CHECKSUM_HEADER = "X-Crowdtrain-Sha256";
export const DELTA_FROM_HEADER = "X-Crowdtrain-Delta-From";
export const ENCODING_HEADER = "X-Crowdtrain-Delta-Encoding";
export const ENCODING = "xor-shuffle4-zstd";
const PLANES = 4;
const ZSTD_MAGIC = 0xfd2fb528;

/** A delta body that cannot be turned into the wanted version: damaged, truncated, or for another version or slice. */
export class DeltaError extends Error {
  constructor(message) {
    super(message);
    this.name = "DeltaError";
  }
}

/** A full download that does not match its checksum or the slice's size: retry the download. */
export class DownloadError extends Error {
  constructor(message) {
    super(message);
    this.name = "DownloadError";
  }
}

/** The largest delta body accepted for `numBytes` of fp32: zstd's worst case, rounded up (the agent's bound). */
export function maxDeltaSize(numBytes) {
  return numBytes + Math.floor(numBytes / 128) + 4096;
}

/**
 * The parameters a GET of `{params_url}<version>` (or `?from=<held>`) answered, rebuilt and verified.
 *
 * @param {object} answer
 * @param {{get(name: string): string | null}} answer.headers the response's headers (a fetch Headers).
 * @param {Uint8Array} answer.body the whole body.
 * @param {number} answer.numElements the slice's element count (its `end - start`).
 * @param {{version: number, params: Float32Array} | null} answer.held what the tab asked `from`, if it did.
 * @returns {Promise<{params: Float32Array, delta: boolean, etag: string}>} new memory, never `held`'s.
 * @throws {DeltaError} for a delta that cannot be used: download the version again without `from`.
 * @throws {DownloadError} for a full body of the wrong size or checksum: retry the download.
 */
export async function paramsFromResponse({ headers, body, numElements, held = null }) {
  const deltaFrom = headers.get(DELTA_FROM_HEADER);
  const expected = headers.get(CHECKSUM_HEADER);
  let params;
  if (deltaFrom === null) {
    // fp32: from an aggregator that no longer keeps the held version, or older than deltas.
    if (body.length !== 4 * numElements) {
      throw new DownloadError(
        `the parameter download has ${body.length} bytes where the slice's ${numElements} fp32 values take ` +
          `${4 * numElements}; it was cut short, the download will be retried`,
      );
    }
    params = new Float32Array(Uint8Array.prototype.slice.call(body).buffer);
  } else {
    const encoding = headers.get(ENCODING_HEADER);
    if (held === null || deltaFrom !== String(held.version) || encoding !== ENCODING) {
      throw new DeltaError(
        `the aggregator sent a delta from version ${JSON.stringify(deltaFrom)} encoded as ${JSON.stringify(encoding)}, ` +
          `where ${JSON.stringify(ENCODING)} from ${held === null ? "no version" : held.version} was asked for`,
      );
    }
    if (held.params.length !== numElements) {
      throw new DeltaError(
        `the held version has ${held.params.length} values but the slice has ${numElements}; download it in full`,
      );
    }
    params = decodeDelta(body, held.params);
    if (expected === null) {
      throw new DeltaError("the delta came without a checksum to verify the rebuilt parameters against");
    }
  }
  if (expected !== null) {
    const actual = await sha256Hex(new Uint8Array(params.buffer));
    if (actual !== expected) {
      if (deltaFrom !== null) {
        throw new DeltaError(
          `the rebuilt parameters' sha256 is ${actual.slice(0, 12)}, the aggregator's ${expected.slice(0, 12)}`,
        );
      }
      throw new DownloadError(
        `the downloaded parameters' sha256 is ${actual.slice(0, 12)}, the aggregator's ${expected.slice(0, 12)}; ` +
          "the download was damaged on the way, it will be retried",
      );
    }
  }
  return { params, delta: deltaFrom !== null, etag: headers.get("ETag") ?? "" };
}

/**
 * The wanted version rebuilt from a delta body and the held version (crowdtrain_agent.deltas.decode_delta).
 *
 * @param {Uint8Array} body the delta body as received.
 * @param {Float32Array} held the held version, exactly as the aggregator published it.
 * @returns {Float32Array} the wanted version, in new memory.
 * @throws {DeltaError} if the body is too large, not one zstd frame of exactly 4n bytes, or damaged.
 */
export function decodeDelta(body, held) {
  const size = PLANES * held.length;
  if (body.length > maxDeltaSize(size)) {
    throw new DeltaError(
      `delta body of ${body.length} bytes is larger than any delta of a ${size}-byte slice can be ` +
        `(${maxDeltaSize(size)}); the aggregator sent something else, download the full version`,
    );
  }
  const frame = readFrame(body);
  if (frame.contentSize !== size) {
    throw new DeltaError(
      `delta body decompresses to ${frame.contentSize ?? "an unannounced number of"} bytes, the slice has ${size}; ` +
        "it is a delta of another slice or version",
    );
  }
  // The planes go to scratch memory the size of the slice; fzstd writes into it and never beyond
  // (an oversized block would show as a wrong checksum, which the caller checks).
  const planes = new Uint8Array(size);
  try {
    decompress(body, planes);
  } catch (error) {
    throw new DeltaError(`delta body of ${body.length} bytes is damaged: ${error.message}`);
  }
  const out = new Float32Array(held.length);
  const target = new Uint8Array(out.buffer);
  const base = new Uint8Array(held.buffer, held.byteOffset, size);
  const n = held.length;
  for (let plane = 0; plane < PLANES; plane++) {
    const offset = plane * n;
    for (let i = 0; i < n; i++) target[PLANES * i + plane] = planes[offset + i] ^ base[PLANES * i + plane];
  }
  return out;
}

/**
 * A zstd frame's header and the extent of its blocks, read without decompressing anything.
 *
 * Checks what the agent's zstandard library checks before it decompresses (one frame, a content
 * size stated) and what it finds while it does (the frame is whole, nothing follows it), so a
 * truncated or padded body is refused with its own words rather than as "damaged".
 *
 * @returns {{contentSize: number | null, end: number}}
 */
export function readFrame(body) {
  if (body.length < 6 || readU32(body, 0) !== ZSTD_MAGIC) {
    throw new DeltaError(`delta body of ${body.length} bytes has no valid zstd frame header`);
  }
  const descriptor = body[4];
  const contentFlag = descriptor >> 6;
  const singleSegment = (descriptor >> 5) & 1;
  const checksum = (descriptor >> 2) & 1;
  const dictionaryBytes = [0, 1, 2, 4][descriptor & 3];
  if (descriptor & 8) throw new DeltaError("delta body's zstd frame header sets a reserved bit");
  if (dictionaryBytes) throw new DeltaError("delta body's zstd frame names a dictionary; deltas never use one");
  const contentBytes = [singleSegment, 2, 4, 8][contentFlag];
  let at = 5 + (singleSegment ? 0 : 1) + dictionaryBytes;
  if (at + contentBytes > body.length) throw truncated(body, 0, 0);
  let contentSize = null;
  if (contentBytes) {
    contentSize = 0;
    for (let i = contentBytes - 1; i >= 0; i--) contentSize = contentSize * 256 + body[at + i];
    if (contentBytes === 2) contentSize += 256;
  }
  at += contentBytes;
  for (let last = 0; !last; ) {
    if (at + 3 > body.length) throw truncated(body, at, contentSize);
    const header = body[at] | (body[at + 1] << 8) | (body[at + 2] << 16);
    last = header & 1;
    const type = (header >> 1) & 3;
    const blockSize = header >>> 3;
    if (type === 3) throw new DeltaError(`delta body is damaged: a zstd block of reserved type at byte ${at}`);
    at += 3 + (type === 1 ? 1 : blockSize);
    if (at > body.length) throw truncated(body, at, contentSize);
  }
  at += checksum ? 4 : 0;
  if (at > body.length) throw truncated(body, at, contentSize);
  if (at < body.length) {
    throw new DeltaError(`delta body of ${body.length} bytes has data after its zstd frame (which ends at ${at})`);
  }
  return { contentSize, end: at };
}

/** Lower-case hex SHA-256, as X-Crowdtrain-Sha256 carries it (Web Crypto: in workers and in Node 20). */
export async function sha256Hex(bytes) {
  const digest = new Uint8Array(await globalThis.crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

function readU32(bytes, at) {
  return (bytes[at] | (bytes[at + 1] << 8) | (bytes[at + 2] << 16) | (bytes[at + 3] << 24)) >>> 0;
}

function truncated(body, at, contentSize) {
  return new DeltaError(
    `delta body of ${body.length} bytes is truncated: its zstd frame needs ${Math.max(at, body.length + 1)} or more ` +
      `(it states ${contentSize ?? "no"} content bytes); download the version again`,
  );
}
