// The data channel's upload of one slice: a text `upload` header, then the payload in binary chunk frames.
//
// The layout is crowdtrain_agent.protocol.frames (agent/PROTOCOL.md, "Data channel"): each frame is
// b"CTGC", chunk index, chunk count and payload length as big-endian u32s, then the payload. Chunks
// are CHUNK_PAYLOAD_BYTES like the agent's: daphne and the aggregator drop WebSocket messages over
// 1 MiB, and an aggregator refuses a chunk of another size than the agent's cut ("wrong chunk size").

import { encodedSize } from "./codec.js";
import { PROTOCOL_MINOR } from "./messages.js";

export const CHUNK_PAYLOAD_BYTES = 512 << 10;
export const MAX_CHUNK_PAYLOAD_BYTES = (1 << 20) - 64;
export const CHUNK_HEADER_BYTES = 16;
const MAGIC = [0x43, 0x54, 0x47, 0x43]; // "CTGC"

/** The 16-byte header of chunk `index` of `count`, carrying `payloadLength` bytes. */
export function chunkHeader(index, count, payloadLength) {
  const header = new Uint8Array(CHUNK_HEADER_BYTES);
  header.set(MAGIC, 0);
  const view = new DataView(header.buffer);
  view.setUint32(4, index, false);
  view.setUint32(8, count, false);
  view.setUint32(12, payloadLength, false);
  return header;
}

/**
 * Cut an encoded slice into the binary messages to send, in order: header and payload in one
 * Uint8Array each, since a browser WebSocket sends one buffer as one message. An empty payload
 * is one chunk of 0 bytes, as the agent sends it.
 */
export function chunkFrames(payload, chunkBytes = CHUNK_PAYLOAD_BYTES) {
  if (!Number.isInteger(chunkBytes) || chunkBytes < 1 || chunkBytes > MAX_CHUNK_PAYLOAD_BYTES) {
    throw new RangeError(`chunk size ${chunkBytes} must lie in 1 to ${MAX_CHUNK_PAYLOAD_BYTES} bytes`);
  }
  const count = Math.max(1, Math.ceil(payload.length / chunkBytes));
  const frames = [];
  for (let i = 0; i < count; i++) {
    const part = payload.subarray(i * chunkBytes, Math.min(payload.length, (i + 1) * chunkBytes));
    const frame = new Uint8Array(CHUNK_HEADER_BYTES + part.length);
    frame.set(chunkHeader(i, count, part.length), 0);
    frame.set(part, CHUNK_HEADER_BYTES);
    frames.push(frame);
  }
  return frames;
}

/**
 * The text frame that announces one slice's upload, as the agent's `encode_message(UploadBegin)`
 * writes it: the keys in the struct's order, so the two are the same bytes. `codec_block_size`
 * came with 2.3 and is left out for an older aggregator (`minor` is the negotiated one).
 */
export function uploadMessage({ ticket, sliceIndex, codec, numElements, numChunks, codecBlockSize = 256 }, minor = PROTOCOL_MINOR) {
  const message = {
    kind: "upload",
    ticket,
    slice_index: sliceIndex,
    codec,
    num_elements: numElements,
    num_chunks: numChunks,
  };
  if (minor >= 3) message.codec_block_size = codecBlockSize;
  return JSON.stringify(message);
}

/**
 * Everything one slice's upload sends: the header text, then the binary frames.
 *
 * @returns {{text: string, frames: Uint8Array[], bytesUp: number}} `bytesUp` counts the chunk
 *   messages only, as `done.bytes_up` does (the small text header is not counted).
 */
export function sliceUpload({ ticket, sliceIndex, codec, codecBlockSize = 256, payload, numElements }, minor = PROTOCOL_MINOR) {
  const expected = encodedSize(codec, numElements, codecBlockSize);
  if (payload.length !== expected) {
    throw new RangeError(
      `a ${codec} payload of ${numElements} elements is ${expected} bytes, not ${payload.length}; ` +
        "encode the slice with the lease's codec and codec_block_size",
    );
  }
  const frames = chunkFrames(payload);
  const text = uploadMessage({ ticket, sliceIndex, codec, numElements, numChunks: frames.length, codecBlockSize }, minor);
  return { text, frames, bytesUp: frames.reduce((sum, frame) => sum + frame.length, 0) };
}
