// A lease's parameters and shards, downloaded as the agent downloads them (crowdtrain_agent.fetch).
//
// Parameters: each slice from its aggregator at `{params_url}{version}`, with the lease's ticket as a
// bearer token (never the device token: that is for the site alone); asked as a delta from the version
// the tab holds (`?from=<held>`) when it holds one of the same slice; in parts of PART_BYTES (HTTP Range)
// when the slice is larger; a 404 (a version being published right now) retried with backoff for a
// while; a delta that cannot be used replaced by a full download, never used (deltas.js checks it).
// Shards: from the site's shard endpoint with the device token, checked against their sha256, kept in
// memory for the next leases and in the Cache API for the next visit.

import { DeltaError, DownloadError, maxDeltaSize, paramsFromResponse, sha256Hex } from "./deltas.js";
import { ShardReader } from "./samples.js";

export const PART_BYTES = 16 << 20; // the agent's fetch.PART_BYTES
const RETRY_FOR_S = 10;
const SHA256 = /^[0-9a-f]{64}$/;
export const PREFETCH_SHARDS = 2; // shards fetched ahead per lease: the next lease's, not the epoch's

const readerKey = (sha, data) => `${sha}:${JSON.stringify(data)}`;

export class FetchError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.name = "FetchError";
    this.status = status;
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * `fetchFn` held to the volunteer's download limit (the device's `download_kbps` control, read at each
 * answer): a body is read whole, then handed on after as long as the limit says it takes.
 * @param {typeof fetch} fetchFn
 * @param {() => number | null} kbps the limit now, in kilobits per second; null: none.
 */
export function limitedFetch(fetchFn, kbps) {
  return async (url, init) => {
    const answer = await fetchFn(url, init);
    const limit = kbps();
    if (!limit) return answer;
    const body = await answer.arrayBuffer();
    await sleep((body.byteLength * 8) / limit); // bytes * 8 / (kbps * 1000) seconds, in milliseconds
    return new Response(answer.status === 204 || answer.status === 304 ? null : body, { status: answer.status, headers: answer.headers });
  };
}

/** The URL of one slice's version, asked as a delta from `heldVersion` when given. */
export function paramsUrl(route, version, heldVersion = null) {
  const url = `${route.params_url}${version}`;
  return heldVersion === null ? url : `${url}?from=${heldVersion}`;
}

/** `(first, last, total)` of a 206's Content-Range, or null when it is not one. */
export function contentRange(value) {
  const match = /^bytes (\d+)-(\d+)\/(\d+)$/.exec(value ?? "");
  return match ? { first: Number(match[1]), last: Number(match[2]), total: Number(match[3]) } : null;
}

/**
 * One GET's whole body: the first part, then the rest in parts when the server answered 206.
 *
 * @returns {Promise<{headers: Headers, body: Uint8Array}>}
 * @throws {FetchError} with `status` for a non-2xx answer, or a part that does not follow the one before.
 */
export async function getInParts(fetchFn, url, { ticket, limit, partBytes = PART_BYTES, meter = () => {} }) {
  const headers = ticket ? { Authorization: `Bearer ${ticket}` } : {};
  const ask = (first) => fetchFn(url, { headers: { ...headers, Range: `bytes=${first}-${first + partBytes - 1}` }, cache: "no-store" });
  const first = await ask(0);
  if (!first.ok) throw new FetchError(`${url} answered HTTP ${first.status}`, first.status);
  const head = new Uint8Array(await first.arrayBuffer());
  meter(head.length);
  if (first.status !== 206) return { headers: first.headers, body: head };
  const range = contentRange(first.headers.get("Content-Range"));
  if (range === null || range.first !== 0 || range.last !== head.length - 1) {
    throw new FetchError(`${url} answered a part with Content-Range ${first.headers.get("Content-Range")}`);
  }
  if (range.total > limit) throw new FetchError(`${url} sends ${range.total} bytes, more than the ${limit} a slice can take`);
  const body = new Uint8Array(range.total);
  body.set(head, 0);
  for (let at = head.length; at < range.total; ) {
    const answer = await ask(at);
    if (answer.status !== 206) throw new FetchError(`${url} answered part ${at} with HTTP ${answer.status}`, answer.status);
    const part = new Uint8Array(await answer.arrayBuffer());
    const r = contentRange(answer.headers.get("Content-Range"));
    if (r === null || r.first !== at || r.total !== range.total || at + part.length > range.total || part.length === 0) {
      throw new FetchError(`${url} answered part ${at} with Content-Range ${answer.headers.get("Content-Range")}`);
    }
    meter(part.length);
    body.set(part, at);
    at += part.length;
  }
  return { headers: first.headers, body };
}

/**
 * One slice of parameter version `version`, verified (fetch.fetch_slice).
 *
 * @param {object} args
 * @param {typeof fetch} args.fetchFn
 * @param {{index: number, start: number, end: number, params_url: string}} args.route the lease's slice.
 * @param {number} args.version the lease's base_version.
 * @param {string} args.ticket the lease's ticket.
 * @param {{version: number, params: Float32Array} | null} args.held what the tab holds of this slice.
 * @param {DeltaChoice | null} args.choice whether a delta pays on this link (null: always ask one).
 * @returns {Promise<{params: Float32Array, etag: string, delta: boolean}>}
 * @throws {FetchError} when the slice stays unpublished, or cannot be downloaded intact.
 */
export async function fetchSlice({ fetchFn, route, version, ticket, held = null, retryForS = RETRY_FOR_S, meter = () => {}, partBytes = PART_BYTES, choice = null }) {
  const numElements = route.end - route.start;
  const attempt = async (from) => {
    const url = paramsUrl(route, version, from === null ? null : from.version);
    const limit = from === null ? 4 * numElements : maxDeltaSize(4 * numElements);
    const asked = performance.now();
    const { headers, body } = await getInParts(fetchFn, url, { ticket, limit, partBytes, meter });
    const arrived = performance.now();
    const answer = await paramsFromResponse({ headers, body, numElements, held: from });
    choice?.note({ bodyBytes: body.length, fullBytes: 4 * numElements, downloadS: (arrived - asked) / 1000,
      decodeS: answer.delta ? (performance.now() - arrived) / 1000 : null });
    return answer;
  };
  const retrying = async (from) => {
    const deadline = performance.now() + retryForS * 1000;
    let damaged = 0;
    for (let wait = 50; ; wait = Math.min(1000, wait * 2)) {
      try {
        return await attempt(from);
      } catch (error) {
        // 404: the version is being published there right now; a damaged full body: once more.
        const again = (error instanceof FetchError && error.status === 404) || (error instanceof DownloadError && damaged++ === 0);
        if (!again || performance.now() + wait > deadline) throw error;
        await sleep(wait);
      }
    }
  };
  try {
    if (held !== null && held.params.length === numElements && held.version !== version && (choice === null || choice.wantsDelta())) {
      try {
        return await retrying(held);
      } catch (error) {
        if (!(error instanceof DeltaError)) throw error;
        // fetch.py logs the same: the delta is dropped and the version downloaded whole.
      }
    }
    return await retrying(null);
  } catch (error) {
    if (error instanceof FetchError || error instanceof DownloadError || error instanceof DeltaError) {
      throw new FetchError(`parameters of version ${version}, slice ${route.index}: ${error.message}`, error.status ?? 0);
    }
    throw new FetchError(`parameters of version ${version}, slice ${route.index}: cannot reach the aggregator (${error.message})`);
  }
}

/**
 * Whether a delta pays on this tab's link, from what the downloads so far cost.
 *
 * A delta saves bytes and costs decoding: zstd and the byte planes in JavaScript, on the thread that also
 * computes the gradient (measured on W1 in Chromium: a 5.3 MB slice decodes in 150-300 ms, while the whole
 * fp32 body comes over a fast link in tens of ms). Over a home link the bytes saved are worth far more
 * than the decoding; next to the site, the whole slice is quicker. A delta is worth it when
 *   ratio * full / link + full / decode < full / link,  that is  link < decode * (1 - ratio),
 * with `link` and `decode` in bytes per second and `ratio` a delta's size over the whole slice's. The
 * estimates are running averages; every PROBE_EVERY-th download asks a delta anyway, so a link or a
 * model that changes is noticed.
 */
export class DeltaChoice {
  static PROBE_EVERY = 16;
  static WEIGHT = 0.3; // of the newest figure in each running average

  constructor() {
    this.linkBps = null;
    this.decodeBps = null;
    this.ratio = null;
    this.asked = 0;
  }

  /** True until both costs are known, then whenever a delta is the quicker way; now and then to re-measure. */
  wantsDelta() {
    this.asked += 1;
    if (this.linkBps === null || this.decodeBps === null || this.ratio === null) return true;
    if (this.asked % DeltaChoice.PROBE_EVERY === 0) return true;
    return this.linkBps < this.decodeBps * (1 - this.ratio);
  }

  /** One download: its body's bytes, the whole slice's, seconds on the link, and seconds decoding a delta (null: not one). */
  note({ bodyBytes, fullBytes, downloadS, decodeS }) {
    const mix = (old, now) => (old === null ? now : old + DeltaChoice.WEIGHT * (now - old));
    if (bodyBytes > 0 && downloadS > 0) this.linkBps = mix(this.linkBps, bodyBytes / downloadS);
    if (decodeS !== null && fullBytes > 0) {
      this.ratio = mix(this.ratio, Math.min(1, bodyBytes / fullBytes));
      if (decodeS > 0) this.decodeBps = mix(this.decodeBps, fullBytes / decodeS);
    }
  }
}

/**
 * The parameters a tab holds: one version per slice, reused as the base of the next delta. Dropped when
 * a lease of another campaign or parameter count comes (a slice's residual means nothing elsewhere).
 */
export class HeldParams {
  constructor() {
    this.key = "";
    this.slices = new Map(); // "start:end" -> {version, params}
    this.choice = new DeltaChoice();
  }

  /**
   * The flat parameter vector of the lease's version, every slice downloaded (as a delta where one is held).
   * @returns {Promise<{flat: Float32Array, bytesDown: number}>}
   */
  async fetchAll({ fetchFn, lease, meter = () => {} }) {
    const key = `${lease.campaign_id}:${lease.param_count}`;
    if (key !== this.key) {
      this.key = key;
      this.slices.clear();
    }
    const flat = new Float32Array(lease.param_count);
    let bytesDown = 0;
    const count = (n) => {
      bytesDown += n;
      meter(n);
    };
    await Promise.all(
      lease.slices.map(async (route) => {
        if (!(route.start <= route.end && route.end <= lease.param_count)) {
          throw new FetchError(`slice ${route.index} spans ${route.start}:${route.end}, outside the model's ${lease.param_count} values`);
        }
        const at = `${route.start}:${route.end}`;
        const held = this.slices.get(at) ?? null;
        let params;
        if (held !== null && held.version === lease.base_version) {
          params = held.params; // the same version again: nothing to download
        } else {
          ({ params } = await fetchSlice({ fetchFn, route, version: lease.base_version, ticket: lease.ticket, held, meter: count, choice: this.choice }));
          this.slices.set(at, { version: lease.base_version, params });
        }
        flat.set(params, route.start);
      }),
    );
    return { flat, bytesDown };
  }
}

/** Shards by sha256: verified bytes in memory (a few) and in the Cache API (the next visit's). */
export class Shards {
  /**
   * @param {{fetchFn: typeof fetch, url: string, token: string, caches?: CacheStorage | null, keep?: number}} options
   *   `url` the site's shard prefix (`/api/shards/`), `token` the device token.
   */
  constructor({ fetchFn, url, token, caches = null, keep = 4 }) {
    this.fetchFn = fetchFn;
    this.url = url.replace(/\/+$/, "");
    this.token = token;
    this.caches = caches;
    this.keep = keep;
    this.readers = new Map();
    this.fetching = new Map(); // sha -> promise of {bytes, downloaded}: a lease needing a shard fetched ahead waits for that fetch
  }

  /**
   * Readers for every shard the lease names (samples.js ShardReader).
   * @returns {Promise<{readers: Map<string, ShardReader>, bytesDown: number}>}
   */
  async readersFor(lease, meter = () => {}) {
    const readers = new Map();
    let bytesDown = 0;
    for (const sha of new Set(lease.ranges.map((r) => r.shard))) {
      const reader = await this.reader(sha, lease.data, (n) => {
        bytesDown += n;
        meter(n);
      });
      readers.set(sha, reader);
    }
    return { readers, bytesDown };
  }

  /**
   * Fetch ahead the shards the site says the next leases will read (a lease's `prefetch`), at most
   * `limit` of them not held yet, so that the next lease does not wait for its data. Never throws: the
   * lease that needs a shard fetches it again and says why it cannot.
   * @returns {Promise<number>} the bytes downloaded.
   */
  async prefetch(lease, limit = PREFETCH_SHARDS, meter = () => {}) {
    const wanted = (lease.prefetch ?? []).filter((sha) => !this.readers.has(readerKey(sha, lease.data))).slice(0, Math.min(limit, this.keep - 1));
    let down = 0;
    for (const sha of wanted) {
      try {
        await this.reader(sha, lease.data, (n) => {
          down += n;
          meter(n);
        });
      } catch {
        // fetched again, with its reason, by the lease that needs it
      }
    }
    return down;
  }

  async reader(sha, data, meter) {
    const key = readerKey(sha, data);
    let reader = this.readers.get(key);
    if (reader === undefined) {
      let fetching = this.fetching.get(sha);
      let mine = false;
      if (fetching === undefined) {
        mine = true;
        fetching = this.bytes(sha).finally(() => this.fetching.delete(sha));
        this.fetching.set(sha, fetching);
      }
      const { bytes, downloaded } = await fetching;
      if (mine) meter(downloaded); // counted once, by whoever fetched it
      reader = this.readers.get(key) ?? new ShardReader(data, bytes);
    } else {
      this.readers.delete(key); // most recently used last
    }
    this.readers.set(key, reader);
    while (this.readers.size > this.keep) this.readers.delete(this.readers.keys().next().value);
    return reader;
  }

  async bytes(sha) {
    if (!SHA256.test(sha)) throw new FetchError(`shard name ${JSON.stringify(sha.slice(0, 70))} is not a lower-case sha256 hex digest`);
    const url = `${this.url}/${sha}`;
    const cache = this.caches ? await this.caches.open("crowdtrain-shards").catch(() => null) : null;
    const cached = cache ? await cache.match(url).catch(() => undefined) : undefined;
    if (cached) {
      const bytes = new Uint8Array(await cached.arrayBuffer());
      if ((await sha256Hex(bytes)) === sha) return { bytes, downloaded: 0 };
      await cache.delete(url);
    }
    const answer = await this.fetchFn(url, { headers: { Authorization: `Bearer ${this.token}` } });
    if (!answer.ok) throw new FetchError(`shard ${sha.slice(0, 12)}: the site answered HTTP ${answer.status} for ${url}`, answer.status);
    const bytes = new Uint8Array(await answer.arrayBuffer());
    const actual = await sha256Hex(bytes);
    if (actual !== sha) {
      throw new FetchError(
        `shard ${sha.slice(0, 12)}: downloaded ${bytes.length} bytes whose sha256 is ${actual.slice(0, 12)}; ` +
          "the download was damaged or the server is misconfigured, the lease will be retried",
      );
    }
    await cache?.put(url, new Response(bytes)).catch(() => {}); // a full quota only costs the next visit a download
    return { bytes, downloaded: bytes.length };
  }
}
