// A lease's gradient to its aggregators: each slice encoded with the lease's codec and sent over the
// slice's upload WebSocket, answered by a receipt (crowdtrain_agent.uploader and runtime._send_slice).
//
// One socket per aggregator URL, kept open between leases; uploads to one aggregator run one after the
// other (a receipt answers the upload before it). A socket that dropped is reopened once and the slice
// sent again. int8 adds the slice's last rounding error and keeps this one's (feedback.js), except for a
// verification copy (the ticket says `check`), which no step uses.

import { encode } from "./codec.js";
import { sliceUpload } from "./frames.js";
import { AGGREGATOR_TO_TAB, negotiatedMinor, offeredSubprotocols, parseMessage, ProtocolError } from "./messages.js";

const REPLY_TIMEOUT_MS = 60_000;
const OPEN_TIMEOUT_MS = 10_000;
// Wait for the socket to drain below this before the next chunk. High enough that a W1 slice (5.3 MB) goes
// out without a wait: each wait is a timer, and timers run only between the microbatches the worker is
// computing meanwhile (45 ms each on W1), which stretched an upload from tens of ms to 0.75 s.
const BUFFERED_HIGH_BYTES = 64 << 20;

export class UploadError extends Error {
  constructor(message, code = "") {
    super(message);
    this.name = "UploadError";
    this.code = code;
  }
}

/** Whether a ticket marks a verification copy, read without its key (tickets.ticket_is_check). */
export function ticketIsCheck(ticket) {
  try {
    const part = ticket.split(".")[0].replaceAll("-", "+").replaceAll("_", "/");
    const payload = JSON.parse(atob(part + "=".repeat((4 - (part.length % 4)) % 4)));
    return payload !== null && typeof payload === "object" && payload.check === true;
  } catch {
    return false;
  }
}

/**
 * The payload of one slice of a lease's gradient, encoded as the agent encodes it.
 *
 * @param {object} lease the lease (codec, codec_block_size, ticket, campaign_id, param_count).
 * @param {{start: number, end: number}} route the slice.
 * @param {Float32Array} grad the whole flat gradient.
 * @param {import("./feedback.js").ErrorFeedback} feedback
 */
export function encodeSlice(lease, route, grad, feedback) {
  const piece = grad.subarray(route.start, route.end);
  if (lease.codec === "int8" && !ticketIsCheck(lease.ticket)) {
    const key = {
      campaignId: lease.campaign_id,
      paramCount: lease.param_count,
      codec: lease.codec,
      blockSize: lease.codec_block_size,
      start: route.start,
      end: route.end,
    };
    return feedback.encode(key, piece);
  }
  return encode(lease.codec, piece, lease.codec_block_size);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Sockets to aggregators, and the one upload at a time each carries. */
export class Uploader {
  /**
   * @param {{WebSocketImpl?: typeof WebSocket, uploadKbps?: () => number | null}} options
   *   `uploadKbps`: the volunteer's upload limit now (the device's controls), or null.
   */
  constructor({ WebSocketImpl = globalThis.WebSocket, uploadKbps = () => null } = {}) {
    this.WebSocketImpl = WebSocketImpl;
    this.uploadKbps = uploadKbps;
    this.sockets = new Map(); // url -> {ws, replies: [], waiting: null}
    this.queues = new Map(); // url -> promise of the upload before
  }

  /**
   * Send one slice and wait for its receipt.
   * @returns {Promise<{token: string, bytesUp: number}>}
   * @throws {UploadError} if the aggregator rejected the slice, closed on it, or cannot be reached.
   */
  upload(url, { ticket, sliceIndex, codec, codecBlockSize, payload, numElements }) {
    const before = this.queues.get(url) ?? Promise.resolve();
    const mine = before.catch(() => {}).then(async () => {
      let bytesUp = 0;
      for (let attempt = 0; ; attempt++) {
        try {
          const conn = await this.connection(url);
          const minor = negotiatedMinor(conn.ws.protocol);
          const { text, frames } = sliceUpload({ ticket, sliceIndex, codec, codecBlockSize, payload, numElements }, minor);
          conn.replies.length = 0;
          conn.ws.send(text);
          for (const frame of frames) {
            conn.ws.send(frame);
            bytesUp += frame.length;
            await this.pace(conn.ws, frame.length);
          }
          const raw = await this.reply(conn, url);
          return { token: checkReply(url, sliceIndex, raw), bytesUp };
        } catch (error) {
          if (error instanceof UploadError && error.code !== "closed" && error.code !== "unreachable") throw error;
          if (attempt >= 1) throw error;
          await sleep(500);
        }
      }
    });
    this.queues.set(url, mine);
    return mine;
  }

  async pace(ws, sent) {
    const kbps = this.uploadKbps();
    if (kbps) await sleep((sent * 8) / kbps); // kilobits per second: bytes * 8 / (kbps * 1000) s
    while (ws.bufferedAmount > BUFFERED_HIGH_BYTES && ws.readyState === 1) await sleep(20);
  }

  connection(url) {
    const open = this.sockets.get(url);
    if (open !== undefined && open.ws.readyState <= 1) return open.ready;
    const conn = { ws: null, replies: [], waiting: null, closed: null };
    conn.ready = new Promise((resolve, reject) => {
      let ws;
      try {
        ws = new this.WebSocketImpl(url, offeredSubprotocols());
      } catch (error) {
        reject(new UploadError(`cannot open the upload socket ${url}: ${error.message}`, "unreachable"));
        return;
      }
      ws.binaryType = "arraybuffer";
      conn.ws = ws;
      const timer = setTimeout(() => {
        ws.close();
        reject(new UploadError(`aggregator ${url} did not answer within ${OPEN_TIMEOUT_MS / 1000} s`, "unreachable"));
      }, OPEN_TIMEOUT_MS);
      ws.onopen = () => {
        clearTimeout(timer);
        resolve(conn);
      };
      ws.onmessage = (event) => {
        if (conn.waiting) {
          const waiting = conn.waiting;
          conn.waiting = null;
          waiting.resolve(event.data);
        } else conn.replies.push(event.data);
      };
      ws.onclose = (event) => {
        clearTimeout(timer);
        this.sockets.delete(url);
        conn.closed = event;
        const error = new UploadError(`aggregator ${url} closed the upload (code ${event.code}: ${event.reason || "connection dropped"})`, "closed");
        reject(error);
        if (conn.waiting) conn.waiting.reject(error);
        conn.waiting = null;
      };
      ws.onerror = () => {}; // onclose follows with the code
    });
    this.sockets.set(url, conn);
    return conn.ready;
  }

  reply(conn, url) {
    if (conn.replies.length) return Promise.resolve(conn.replies.shift());
    if (conn.closed) return Promise.reject(new UploadError(`aggregator ${url} closed the upload (code ${conn.closed.code})`, "closed"));
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        conn.waiting = null;
        conn.ws.close();
        reject(new UploadError(`aggregator ${url} sent no receipt within ${REPLY_TIMEOUT_MS / 1000} s`, "unreachable"));
      }, REPLY_TIMEOUT_MS);
      conn.waiting = {
        resolve: (v) => (clearTimeout(timer), resolve(v)),
        reject: (e) => (clearTimeout(timer), reject(e)),
      };
    });
  }

  close() {
    for (const { ws } of this.sockets.values()) ws?.close(1000);
    this.sockets.clear();
  }
}

/** The receipt's token, or an UploadError in the aggregator's words (uploader._check_reply). */
export function checkReply(url, sliceIndex, raw) {
  let reply;
  try {
    reply = parseMessage(raw, AGGREGATOR_TO_TAB);
  } catch (error) {
    if (error instanceof ProtocolError) throw new UploadError(`aggregator ${url} answered slice ${sliceIndex} with a bad message: ${error.message}`);
    throw error;
  }
  if (reply.kind === "receipt") {
    if (reply.slice_index !== sliceIndex) throw new UploadError(`aggregator ${url} sent a receipt for slice ${reply.slice_index} after slice ${sliceIndex}`);
    return reply.token;
  }
  const verb = reply.kind === "upload_rejected" ? "rejected" : "refused";
  throw new UploadError(`aggregator ${url} ${verb} slice ${sliceIndex}: ${reply.code} (${reply.detail})`, reply.code);
}
