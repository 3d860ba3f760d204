// Image augmentation for a browser tab, drawing the very flips and shifts the agent draws.
//
// agent/PROTOCOL.md, "Augmentation": each sample's seed is the first 8 bytes (little-endian, top bit
// cleared) of BLAKE2b-64 of "<shard>:<index>:<base_version>"; a torch.Generator seeded with it draws
// one integer in [0, 1] (1 flips the image left-right), then two in [0, 2p] (p = max(1, side // 8)):
// with flip_crop the image moves right by the first minus p and down by the second minus p pixels,
// the uncovered edge black. A verification copy of a tab's lease computed by an agent must see the
// same images, so both draws are rebuilt here bit for bit: torch's CPU generator is MT19937 seeded with
// the seed's low 32 bits, and `randint(lo, hi)` of a range below 2**32 is `lo + next() % (hi - lo)`.

/** Images (N, C, H, W) as a Float32Array, flipped and shifted in place as the agent's `augment_images`. */
export function augmentImages(x, mode, seeds) {
  if (mode === "none") return x;
  if (mode !== "flip" && mode !== "flip_crop") {
    throw new RangeError(`unknown augmentation ${JSON.stringify(mode)}; this tab knows flip and flip_crop`);
  }
  if (x.dims.length !== 4 || seeds.length !== x.dims[0]) {
    throw new RangeError(`augmentation applies to images (N, C, H, W); these samples are [${x.dims}]`);
  }
  const [n, channels, height, width] = x.dims;
  const pad = Math.max(1, Math.floor(width / 8));
  const plane = height * width;
  const image = new Float32Array(channels * plane);
  for (let s = 0; s < n; s++) {
    const twister = new Mt19937(seeds[s]);
    const flip = twister.next() % 2;
    const dx = (twister.next() % (2 * pad + 1)) - pad;
    const dy = (twister.next() % (2 * pad + 1)) - pad;
    const shift = mode === "flip_crop";
    const sample = x.data.subarray(s * channels * plane, (s + 1) * channels * plane);
    image.set(sample);
    for (let c = 0; c < channels; c++) {
      for (let i = 0; i < height; i++) {
        for (let j = 0; j < width; j++) {
          const si = shift ? i - dy : i;
          const sj = shift ? j - dx : j;
          const inside = si >= 0 && si < height && sj >= 0 && sj < width;
          sample[c * plane + i * width + j] = inside ? image[c * plane + si * width + (flip ? width - 1 - sj : sj)] : 0;
        }
      }
    }
  }
  return x;
}

/** The low 32 bits of a sample's augmentation seed (`crowdtrain_agent.data.sample_seed`): all MT19937 takes. */
export function sampleSeed(shard, index, version) {
  const digest = blake2b64(new TextEncoder().encode(`${shard}:${index}:${version}`));
  return (digest[0] | (digest[1] << 8) | (digest[2] << 16) | (digest[3] << 24)) >>> 0;
}

/** MT19937 as torch's CPU generator runs it (at::mt19937): 32-bit outputs. */
export class Mt19937 {
  constructor(seed) {
    this.state = new Uint32Array(624);
    this.state[0] = seed >>> 0;
    for (let j = 1; j < 624; j++) {
      const prev = this.state[j - 1] ^ (this.state[j - 1] >>> 30);
      this.state[j] = (Math.imul(prev, 1812433253) + j) >>> 0; // modulo 2**32, as the C++ uint32 wraps
    }
    this.index = 624;
  }

  next() {
    if (this.index >= 624) this.twist();
    let y = this.state[this.index++];
    y ^= y >>> 11;
    y ^= (y << 7) & 0x9d2c5680;
    y ^= (y << 15) & 0xefc60000;
    y ^= y >>> 18;
    return y >>> 0;
  }

  twist() {
    const s = this.state;
    for (let k = 0; k < 624; k++) {
      const y = (s[k] & 0x80000000) | (s[(k + 1) % 624] & 0x7fffffff);
      s[k] = s[(k + 397) % 624] ^ (y >>> 1) ^ (y & 1 ? 0x9908b0df : 0);
    }
    this.index = 0;
  }
}

const MASK = (1n << 64n) - 1n;
const IV = [
  0x6a09e667f3bcc908n, 0xbb67ae8584caa73bn, 0x3c6ef372fe94f82bn, 0xa54ff53a5f1d36f1n,
  0x510e527fade682d1n, 0x9b05688c2b3e6c1fn, 0x1f83d9abfb41bd6bn, 0x5be0cd19137e2179n,
];
const SIGMA = [
  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
  [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
  [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
  [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
  [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
  [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
  [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
  [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
  [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
  [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
];

/**
 * BLAKE2b with an 8-byte digest and no key (RFC 7693), as Python's hashlib.blake2b(digest_size=8).
 * BigInt arithmetic: one short message per sample, so clarity wins over speed here.
 */
export function blake2b64(message) {
  const h = IV.slice();
  h[0] ^= 0x01010008n; // digest length 8, no key, fanout 1, depth 1
  const blocks = Math.max(1, Math.ceil(message.length / 128));
  for (let b = 0; b < blocks; b++) {
    const block = new Uint8Array(128);
    block.set(message.subarray(b * 128, (b + 1) * 128));
    const last = b === blocks - 1;
    compress(h, block, BigInt(last ? message.length : (b + 1) * 128), last);
  }
  const out = new Uint8Array(8);
  new DataView(out.buffer).setBigUint64(0, h[0], true);
  return out;
}

function compress(h, block, counter, last) {
  const view = new DataView(block.buffer);
  const m = Array.from({ length: 16 }, (_, i) => view.getBigUint64(8 * i, true));
  const v = [...h, ...IV];
  v[12] ^= counter & MASK;
  v[13] ^= counter >> 64n;
  if (last) v[14] ^= MASK;
  const rotr = (x, n) => ((x >> n) | (x << (64n - n))) & MASK;
  const g = (a, b, c, d, x, y) => {
    v[a] = (v[a] + v[b] + x) & MASK;
    v[d] = rotr(v[d] ^ v[a], 32n);
    v[c] = (v[c] + v[d]) & MASK;
    v[b] = rotr(v[b] ^ v[c], 24n);
    v[a] = (v[a] + v[b] + y) & MASK;
    v[d] = rotr(v[d] ^ v[a], 16n);
    v[c] = (v[c] + v[d]) & MASK;
    v[b] = rotr(v[b] ^ v[c], 63n);
  };
  for (let round = 0; round < 12; round++) {
    const s = SIGMA[round % 10];
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (let i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}
