// Error feedback for int8 uploads: the rounding error of one upload of a slice is added to the next.
//
// The same rule as crowdtrain_agent.feedback, so a tab's uploads telescope as an agent's do: the sum
// of what the aggregators received differs from the sum of the true gradients by one residual,
// however many uploads there were. Without it int8's rounding errors add up step after step.
// Only int8 is lossy enough to need it; fp16 and fp32 are encoded as they are.
//
// A tab holds residuals for one campaign at a time and drops them when a lease of another
// campaign, parameter count, codec or block size comes (or the campaign is cut into other
// slices). A verification copy (the ticket's `check`) must be encoded with `encode` from
// codec.js instead: the aggregator keeps nothing of a copy, so a residual folded into it is lost.

import { encode, quantizeInt8, dequantizeInt8, encodeInt8Parts, INT8_BLOCK_SIZE } from "./codec.js";

/**
 * What a residual belongs to; a residual of any other slice, model or codec means nothing.
 * @typedef {{campaignId: number, paramCount: number, codec: string, blockSize: number, start: number, end: number}} SliceKey
 */

export class ErrorFeedback {
  constructor() {
    /** @type {Map<string, {key: SliceKey, residual: Float32Array}>} */
    this.residuals = new Map();
  }

  /**
   * Encode `piece` (this upload's Float32Array of the slice) plus the slice's residual, and keep
   * the new residual for the slice's next upload. `piece` is left unchanged.
   *
   * A tab's uploads of one slice run one after the other (one worker), so each takes the
   * residual the previous one left. An upload that then fails costs one rounding error, never
   * a drift: its residual is still the next one's.
   *
   * @param {SliceKey} key
   * @param {Float32Array} piece
   * @returns {Uint8Array} the payload, `encodedSize(key.codec, piece.length, key.blockSize)` bytes.
   */
  encode(key, piece) {
    const blockSize = key.codec === "int8" ? key.blockSize : INT8_BLOCK_SIZE;
    if (key.codec !== "int8") return encode(key.codec, piece, blockSize);
    const residual = this.take(key);
    let wanted = piece;
    if (residual !== undefined && residual.length === piece.length) {
      wanted = new Float32Array(piece.length);
      for (let i = 0; i < piece.length; i++) wanted[i] = piece[i] + residual[i];
    }
    const { q, scale } = quantizeInt8(wanted, blockSize);
    const sent = dequantizeInt8(q, scale, blockSize);
    const left = new Float32Array(wanted.length);
    let finite = true;
    for (let i = 0; i < wanted.length; i++) {
      left[i] = wanted[i] - sent[i];
      if (!Number.isFinite(left[i])) finite = false;
    }
    // A residual that is not finite would spoil every later upload of the slice: dropped, as the agent does.
    if (finite) this.residuals.set(keyString(key), { key, residual: left });
    return encodeInt8Parts(q, scale);
  }

  /** The residual the next upload of `key` will add (undefined: none). */
  residual(key) {
    return this.residuals.get(keyString(key))?.residual;
  }

  /** Drop what `key` makes stale and hand over its own residual, which the upload replaces. */
  take(key) {
    const own = keyString(key);
    for (const [name, held] of this.residuals) {
      if (name !== own && replaces(key, held.key)) this.residuals.delete(name);
    }
    const found = this.residuals.get(own);
    this.residuals.delete(own);
    return found?.residual;
  }
}

function keyString(key) {
  return [key.campaignId, key.paramCount, key.codec, key.blockSize, key.start, key.end].join("/");
}

/** Whether a residual of `old` is stale once `next` is uploaded: another campaign, model or codec, or a slice that overlaps. */
function replaces(next, old) {
  if (
    next.campaignId !== old.campaignId ||
    next.paramCount !== old.paramCount ||
    next.codec !== old.codec ||
    next.blockSize !== old.blockSize
  ) {
    return true;
  }
  return next.start < old.end && old.start < next.end;
}
