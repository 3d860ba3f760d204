// The tab's leases as a pipeline, as the agent's runtime._work runs them: while a lease computes, the
// next one is asked for and downloaded; once its gradient is computed, its report (encode, upload every
// slice, done, done_ack) goes on in the background while the loop computes the next. The worker (worker.js) strings these
// together; each is testable under Node on its own (tests/tab/steps.test.mjs).

/**
 * Reports of computed leases, one at a time, in the background.
 *
 * At most one is in flight, as in the agent (runtime._start_report): a second computed gradient waits
 * for the first report to end before its own starts, and the loop with it. So a tab holds at most two
 * gradients at once (the one uploading and the one just computed), besides the parameters of the lease
 * computing and of the one prepared ahead, whatever the network's speed: a slow link slows the loop
 * down instead of piling gradients up in a tab's bounded memory (memoryRefusal's budget).
 */
export class Reports {
  /** @param {{onError?: (error: Error) => void}} options `onError`: a report that threw (a bug: reports handle their own failures). */
  constructor({ onError = () => {} } = {}) {
    this.running = null;
    this.onError = onError;
  }

  /** Whether a report is in flight now. */
  get busy() {
    return this.running !== null;
  }

  /**
   * Start `report()` once the report in flight (if any) has ended; resolves as soon as it has started,
   * not when it ends.
   * @param {() => Promise<void>} report
   */
  async start(report) {
    while (this.running !== null) await this.running;
    const tracked = (async () => report())()
      .catch((error) => this.onError(error))
      .finally(() => {
        if (this.running === tracked) this.running = null;
      });
    this.running = tracked;
  }

  /** Resolves once no report is in flight. */
  async drain() {
    while (this.running !== null) await this.running;
  }
}

/**
 * What the tab is doing, which is up to three things at once: the loop (the lease computing, or what it
 * waits for), the next lease asked for and downloaded ahead while one computes, and the report in flight.
 * The page shows them in that order: "lease 12: computing, 512 of 1024 samples; lease 13: downloading
 * parameters of version 7; lease 11: uploading the gradient".
 */
export class Doing {
  constructor() {
    this.loop = "";
    this.ahead = "";
    this.report = "";
  }

  text() {
    return [this.loop, this.ahead, this.report].filter(Boolean).join("; ");
  }
}

/**
 * The leases a tab holds, oldest first, and where each stands: "preparing" (graph, parameters, shards,
 * then ready and waiting for the compute before it),
 * "computing", "computed" (waiting for the report before it), "reporting" (encode, upload) and
 * "reported" (done sent: the site has it, nothing left to give back). `given` once released.
 */
export class HeldLeases {
  constructor() {
    this.jobs = [];
  }

  /** A lease just received, in the "preparing" phase. */
  add(lease) {
    const job = { lease, phase: "preparing", given: false };
    this.jobs.push(job);
    return job;
  }

  /** The job is over (reported, given back, failed): it is no longer held. */
  drop(job) {
    this.jobs = this.jobs.filter((j) => j !== job);
  }

  /**
   * The jobs to give back now, each marked `given`: for a pause, those still being prepared or computed
   * (their gradient would take a while yet); for a closing tab, every one not reported yet (nothing in
   * this tab will finish once it is gone).
   */
  toGiveBack(closing) {
    const early = new Set(["preparing", "computing"]);
    const out = this.jobs.filter((j) => !j.given && j.phase !== "reported" && (closing || early.has(j.phase)));
    for (const job of out) job.given = true;
    return out;
  }

  /** Ids of the leases held (not given back, not reported), oldest first. */
  ids() {
    return this.jobs.filter((j) => !j.given && j.phase !== "reported").map((j) => j.lease.lease_id);
  }
}
