"""Simulated agents for the scale bench: the agent's own control channel and uploader, a fixed gradient, no compute.

    python -m tests.benchmarks.loadgen --spec var/bench/scale/wide-100/loadgen-0/spec.json
    python -m tests.benchmarks.loadgen --spec spec.json --standalone --warmup-s 3 --window-s 10

One asyncio process drives thousands of agents. Each speaks the real
protocol through ``crowdtrain_agent.control.ControlChannel`` (hello,
heartbeats every ``heartbeat_s``, reconnects with backoff) and, in ``cycle``
mode, repeats a *lease cycle* as fast as ``period_s`` lets it:

1. ``lease_request`` with ``wait_s`` like the agent's (held by the site while
   every step is full; after a ``no_lease`` it asks again on the next version
   push or after ``retry_after_s``, like ``Agent._next_lease``);
2. upload of every slice, through ``crowdtrain_agent.uploader.Uploader``, of a
   fixed gradient of the lease's ``param_count`` (``fixed_gradient``: real tickets, real
   receipts), sent again while the aggregator refuses it as a "future
   version" (the real agent downloads that version first, which waits for it
   at the aggregator);
3. ``done`` with the receipts; the site checks them and counts the samples.

In ``idle`` mode the agents only connect and heartbeat.

Agents share a pool of ``upload_connections`` uploaders instead of one
WebSocket each to the aggregator: the bench measures the site, and 10,000
more sockets on the aggregator would only cost file descriptors here.

Per agent this keeps a ControlChannel (one socket, a reader and a heartbeat
task) and a few slots; everything else (the hello, the fixed gradient, the
uploaders) is shared, so 10,000 agents fit in one process.

The bench talks to this process through files in the spec's folder:
``ready.json`` (written once the agents are connected, or the connect time
is up), ``go.json`` (written by the bench: wall-clock ``start``,
``measure_from`` and ``measure_to``) and ``result.json`` (the counts and
latencies, written after the window and a bounded drain). Only what happens
inside the window is counted as a rate or a latency; rejections and losses
are counted over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import random
import re
import resource
import struct
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "agent" / "src") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "agent" / "src"))

from crowdtrain_agent import __version__  # noqa: E402
from crowdtrain_agent.control import AgentStopped, Backoff, ConnectionLost, ControlChannel  # noqa: E402
from crowdtrain_agent.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    AgentHello,
    DeviceInfo,
    DoneAck,
    Lease,
    LeaseDone,
    LeaseRelease,
    LeaseRequest,
    NoLease,
    Receipt,
    UploadBegin,
    VersionPublished,
    chunk_fragments,
    ticket_is_check,
)
from crowdtrain_agent.uploader import Uploader, UploadError  # noqa: E402

logger = logging.getLogger("tests.benchmarks.loadgen")

# The agent's own timeouts and retries (crowdtrain_agent.runtime), so a simulated agent gives up
# on a slow site exactly when a real one would.
LEASE_WAIT_S = 10.0
LEASE_CALL_RETRIES = 3
DONE_TIMEOUT_S = 30.0
DONE_CALL_RETRIES = 3
RELEASE_TIMEOUT_S = 5.0
# An upload that raced the aggregator's apply is sent again after 25 ms, then 50, 100, 200 and 400 ms apart
# (9 s in all), sooner if the site pushes a version meanwhile. The real agent waits at the aggregator instead
# (its parameter download is held until that version is applied): polling every 25 ms made 2,500 refused
# uploads a second at 1,000 agents, which the aggregator had to answer while the step they waited on waited
# for it.
FUTURE_VERSION_RETRIES = 25
FUTURE_VERSION_FIRST_WAIT_S = 0.025
LOSS_PER_SAMPLE = 0.69  # any plausible loss: the site only bounds it
BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2}
LAG_PROBE_S = 0.1

HELLO = AgentHello(
    protocol_version=PROTOCOL_VERSION,
    agent_version=__version__,
    device=DeviceInfo(kind="cpu", name="simulated agent (tests.benchmarks.loadgen)", threads=1),
)


def reason_kind(reason: str) -> str:
    """A rejection's reason as a tally key: whole when it names no numbers (a backup twin's "lease released:
    the original lease finished first" says nothing was lost), else cut before its details ("stale version:
    computed on 3, step 5 is open" -> "stale version")."""
    reason = reason or "no reason"
    return (reason if not any(c.isdigit() for c in reason) else reason.split(":")[0])[:80]


@dataclass(frozen=True)
class LoadSpec:
    """What one load-generator process does; the bench writes it as JSON.

    ``period_s`` paces each agent: a cycle starts at most every ``period_s``
    (0: the next starts as soon as the last ends). ``samples_per_s`` is the
    speed the agents claim in lease requests, which sizes their leases.
    """

    site_urls: list[str]
    tokens: list[str]
    mode: Literal["cycle", "idle"] = "cycle"
    campaign_id: int | None = None
    connect_rate: float = 500.0
    connect_timeout_s: float = 60.0
    go_timeout_s: float = 600.0
    period_s: float = 0.0
    samples_per_s: float | None = None
    lease_wait_s: float = LEASE_WAIT_S
    upload_connections: int = 64
    drain_s: float = 15.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown load spec field(s) {unknown}; known: {sorted(known)}")
        spec = cls(**data)
        if spec.mode not in ("cycle", "idle"):
            raise ValueError(f"mode must be 'cycle' or 'idle', got {spec.mode!r}")
        if spec.connect_rate <= 0 or spec.upload_connections < 1 or not spec.site_urls:
            raise ValueError("connect_rate must be > 0, upload_connections >= 1, and site_urls not empty")
        return spec


@dataclass
class Stats:
    """Counts and latencies of one process; merged by the bench."""

    agents: int = 0
    connected: int = 0
    connect_ms: list[float] = field(default_factory=list)  # hello sent... welcome, first connection of each agent
    reconnects: int = 0
    disconnects: int = 0
    fatal: Counter[str] = field(default_factory=Counter)  # channels closed for good (bad token, gave up)
    window: tuple[float, float] = (float("inf"), float("inf"))  # wall clock
    lease_ms: list[float] = field(default_factory=list)  # request -> lease, for requests sent in the window
    # Requests sent in the window and still unanswered when the drain ended: in lease_ms at their age then, a
    # lower bound (leaving them out would drop exactly the slowest requests from the percentile).
    lease_unanswered: int = 0
    lease_outstanding: int = 0  # lease requests still unanswered when the drain ended, whenever sent
    lease_wait_ms: list[float] = field(default_factory=list)  # a cycle's first request -> its lease (no_lease included)
    cycles: int = 0  # done reports accepted in the window
    cycles_total: int = 0
    no_lease: Counter[str] = field(default_factory=Counter)
    lease_errors: Counter[str] = field(default_factory=Counter)  # calls that got no answer (timeout, lost)
    upload_failed: Counter[str] = field(default_factory=Counter)
    future_version_retries: int = 0
    done_rejected: Counter[str] = field(default_factory=Counter)
    done_unconfirmed: int = 0
    # Leases uploaded and reported done; not verification copies, whose record is their check's answer, not a lease.
    reported: list[int] = field(default_factory=list)
    not_accepted: list[int] = field(default_factory=list)  # of those: rejected, or no answer
    loop_lag_max_ms: float = 0.0  # in the window: how late this process's event loop ran
    rss_mb: float = 0.0

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t <= self.window[1]

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs, counting the pairs.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in data.items():
            if isinstance(value, Counter):
                data[name] = dict(value)
        for name in ("connect_ms", "lease_ms", "lease_wait_ms"):
            data[name] = [round(v, 2) for v in data[name]]
        return data


FIXED_GRADIENT = 1.0 / 1024  # exact in fp16 and fp32


@functools.cache
def fixed_gradient(num_elements: int, codec: str) -> list[tuple[bytes, memoryview]]:
    """The chunks of a slice whose every element is ``FIXED_GRADIENT``, in the codec's bytes (no torch needed).

    The same for every lease, so a verification copy agrees with its original as an honest one does, and
    the site's checks cost what they cost in an honest swarm. A zero gradient agrees with nothing
    (``crowdtrain_agent.sketch.compare``): every check then went to a third copy and ended inconclusive.
    """
    element = struct.pack("<e" if codec == "fp16" else "<f", FIXED_GRADIENT)
    assert len(element) == BYTES_PER_ELEMENT[codec]
    return chunk_fragments(element * num_elements)


@dataclass
class Context:
    spec: LoadSpec
    stats: Stats
    uploaders: list[Uploader]
    stopping: bool = False


class SimAgent:
    """One simulated agent: a real control channel and the lease cycle, no model."""

    __slots__ = (
        "index",
        "ctx",
        "channel",
        "connect_started",
        "connected",
        "pushed",
        "published",
        "task",
        "cycle_task",
        "asking",
    )

    def __init__(self, index: int, ctx: Context, url: str, token: str) -> None:
        self.index = index
        self.ctx = ctx
        self.channel = ControlChannel(
            url.rstrip("/").replace("http://", "ws://", 1) + "/ws/agent/", token, HELLO,
            on_push=self._on_push, on_state=self._on_state, backoff=Backoff(),
        )  # fmt: skip
        self.connect_started = 0.0
        self.connected = False
        self.pushed = asyncio.Event()
        self.published = asyncio.Event()  # a version push since the last refused upload
        self.task: asyncio.Task[None] | None = None
        self.cycle_task: asyncio.Task[None] | None = None
        self.asking: tuple[float, float] | None = None  # (wall, perf) send time of the lease request in flight

    def start(self) -> None:
        self.connect_started = time.perf_counter()
        self.task = asyncio.create_task(self._run_channel())

    async def _run_channel(self) -> None:
        try:
            await self.channel.run()
        except AgentStopped as exc:
            # "the site at ws://127.0.0.1:PORT/... (close code 4001); log in again..." -> "close code 4001"
            code = re.search(r"close code \d+", str(exc))
            self.ctx.stats.fatal[code.group(0) if code else str(exc)[:80]] += 1

    def _on_state(self, text: str) -> None:
        stats = self.ctx.stats
        if text == "connected":
            if not self.connected:
                self.connected = True
                stats.connected += 1
                stats.connect_ms.append(1e3 * (time.perf_counter() - self.connect_started))
            else:
                stats.reconnects += 1
        elif text.startswith("disconnected"):
            stats.disconnects += 1

    def _on_push(self, message: Any) -> None:
        if isinstance(message, VersionPublished):
            self.pushed.set()
            self.published.set()

    # ------------------------------------------------------------ the cycle

    async def cycle_forever(self, first_delay_s: float) -> None:
        await asyncio.sleep(first_delay_s)
        period = self.ctx.spec.period_s
        next_start = time.perf_counter()
        while not self.ctx.stopping:
            if period > 0:
                delay = next_start - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_start = max(next_start + period, time.perf_counter())
            if self.ctx.stopping:
                return
            try:
                await self.one_cycle()
            except AgentStopped:
                return  # counted in _run_channel

    async def one_cycle(self) -> None:
        lease = await self._lease()
        if lease is None:
            return
        receipts = await self._upload(lease)
        if receipts is None:
            await self._release(lease)
            return
        await self._report(lease, receipts)

    async def _lease(self) -> Lease | None:
        ctx, stats = self.ctx, self.ctx.stats
        request_id = uuid.uuid4().hex
        first_asked = time.perf_counter()
        while not ctx.stopping:
            self.pushed.clear()  # before asking, so a push during the request still wakes us (as the agent does)
            request = LeaseRequest(campaign_id=ctx.spec.campaign_id, samples_per_s=ctx.spec.samples_per_s,
                                   request_id=request_id, wait_s=ctx.spec.lease_wait_s)  # fmt: skip
            sent_wall, sent = self.asking = time.time(), time.perf_counter()
            try:
                reply = await self.channel.call(request, "lease", timeout=ctx.spec.lease_wait_s + 30.0,
                                                retries=LEASE_CALL_RETRIES)  # fmt: skip
            except (ConnectionLost, TimeoutError) as exc:
                stats.lease_errors[type(exc).__name__] += 1
                continue
            finally:
                self.asking = None
            answered = time.perf_counter()
            if isinstance(reply, Lease):
                if stats.in_window(sent_wall):
                    stats.lease_ms.append(1e3 * (answered - sent))
                    stats.lease_wait_ms.append(1e3 * (answered - first_asked))
                return reply
            if isinstance(reply, NoLease):
                stats.no_lease[reply.reason] += 1
                request_id = uuid.uuid4().hex  # answered: the next request is a new one
                try:
                    await asyncio.wait_for(self.pushed.wait(), max(0.0, reply.retry_after_s))
                except TimeoutError:
                    pass
        return None

    async def _upload(self, lease: Lease) -> list[Receipt] | None:
        ctx, stats = self.ctx, self.ctx.stats
        # No wait for a version push first: like the agent, which asks the aggregator for the lease's
        # parameters (answered once it has applied that version), an upload that comes too early is refused
        # as a "future version" and sent again a moment later (FUTURE_VERSION_RETRIES).
        uploader = ctx.uploaders[self.index % len(ctx.uploaders)]
        receipts = []
        for route in lease.slices:
            num_elements = route.end - route.start
            if lease.codec not in BYTES_PER_ELEMENT:
                stats.upload_failed[f"codec {lease.codec} not simulated"] += 1
                return None
            chunks = fixed_gradient(num_elements, lease.codec)
            begin = UploadBegin(ticket=lease.ticket, slice_index=route.index, codec=lease.codec,
                                num_elements=num_elements, num_chunks=len(chunks))  # fmt: skip
            for attempt in range(FUTURE_VERSION_RETRIES + 1):
                try:
                    receipt = await uploader.upload(route.upload_url, begin, chunks)
                    break
                except UploadError as exc:
                    if exc.code == "future version" and attempt < FUTURE_VERSION_RETRIES:
                        stats.future_version_retries += 1
                        self.published.clear()
                        wait_s = FUTURE_VERSION_FIRST_WAIT_S * 2 ** min(attempt, 4)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.published.wait(), wait_s)
                        continue
                    stats.upload_failed[exc.code or "error"] += 1
                    return None
            receipts.append(Receipt(slice_index=route.index, token=receipt.token))
        return receipts

    async def _report(self, lease: Lease, receipts: list[Receipt]) -> None:
        stats = self.ctx.stats
        done = LeaseDone(lease_id=lease.lease_id, receipts=receipts, num_samples=lease.num_samples,
                         loss_sum=LOSS_PER_SAMPLE * lease.num_samples, compute_s=0.0)  # fmt: skip
        if not ticket_is_check(lease.ticket):
            stats.reported.append(lease.lease_id)
        try:
            ack = await self.channel.call(done, f"done:{lease.lease_id}", timeout=DONE_TIMEOUT_S,
                                          retries=DONE_CALL_RETRIES)  # fmt: skip
        except (ConnectionLost, TimeoutError):
            stats.done_unconfirmed += 1
            stats.not_accepted.append(lease.lease_id)
            return
        if not isinstance(ack, DoneAck):  # the "done:<id>" slot receives only acks; anything else is a site bug
            stats.done_rejected[f"unexpected reply {type(ack).__name__}"] += 1
            stats.not_accepted.append(lease.lease_id)
            return
        if ack.accepted:
            stats.cycles_total += 1
            if stats.in_window(time.time()):
                stats.cycles += 1
            return
        stats.done_rejected[reason_kind(ack.reason)] += 1
        stats.not_accepted.append(lease.lease_id)

    async def _release(self, lease: Lease) -> None:
        try:
            await self.channel.call(LeaseRelease(lease_id=lease.lease_id), f"release:{lease.lease_id}",
                                    timeout=RELEASE_TIMEOUT_S)  # fmt: skip
        except (ConnectionLost, TimeoutError, AgentStopped):
            pass  # it expires at its deadline, as a real agent's would


# ---------------------------------------------------------------- the process


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %s to %s: %s", soft, target, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write then rename, so a reader polling for the file never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


async def _watch_lag(stats: Stats) -> None:
    while True:
        started = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        lag_ms = 1e3 * (time.perf_counter() - started - LAG_PROBE_S)
        if stats.in_window(time.time()):
            stats.loop_lag_max_ms = max(stats.loop_lag_max_ms, lag_ms)


async def _wait_for_go(folder: Path, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    path = folder / "go.json"
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no {path} within {timeout_s:.0f} s")


async def _sleep_until(wall: float) -> None:
    delay = wall - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def drive(spec: LoadSpec, folder: Path) -> Stats:
    """Connect the agents, signal ready, run the window the bench names in go.json, drain, and return the counts."""
    ctx = Context(spec, Stats(agents=len(spec.tokens)),
                  [Uploader() for _ in range(min(spec.upload_connections, len(spec.tokens)) or 1)])  # fmt: skip
    stats = ctx.stats
    agents = [SimAgent(i, ctx, spec.site_urls[i % len(spec.site_urls)], token) for i, token in enumerate(spec.tokens)]
    lag = asyncio.create_task(_watch_lag(stats))
    try:
        # connect: evenly spread at connect_rate, as volunteers joining (or a site restart's reconnects, jittered)
        started = time.monotonic()
        for i, agent in enumerate(agents):
            delay = started + i / spec.connect_rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            agent.start()
        deadline = time.monotonic() + spec.connect_timeout_s
        while stats.connected < len(agents) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        write_json(folder / "ready.json", {"agents": len(agents), "connected": stats.connected,
                                           "connect_s": time.monotonic() - started})  # fmt: skip
        # Thousands of sockets make a big heap: keep what exists now out of the collector's full passes,
        # whose pauses would show as the site's latency.
        gc.collect()
        gc.freeze()

        # run: the window the bench measures, then a bounded drain of the cycles still under way
        go = await _wait_for_go(folder, spec.go_timeout_s)
        stats.window = (go["measure_from"], go["measure_to"])
        await _sleep_until(go["start"])
        if spec.mode == "cycle":
            stagger = spec.period_s or 1.0  # first cycles spread out, not a thundering herd at "start"
            for agent in agents:
                agent.cycle_task = asyncio.create_task(agent.cycle_forever(random.uniform(0.0, stagger)))
        await _sleep_until(go["measure_to"])
        ctx.stopping = True
        cycles = [a.cycle_task for a in agents if a.cycle_task is not None]
        if cycles:
            _, pending = await asyncio.wait(cycles, timeout=spec.drain_s)
            now = time.perf_counter()
            for agent in agents:
                if agent.asking is None:
                    continue
                stats.lease_outstanding += 1
                if stats.in_window(agent.asking[0]):
                    stats.lease_ms.append(1e3 * (now - agent.asking[1]))
                    stats.lease_unanswered += 1
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        stats.rss_mb = _rss_mb()
        return stats
    finally:
        lag.cancel()
        # leave: close every socket (bounded: a saturated site may not answer the close handshakes)
        closing = [asyncio.create_task(a.channel.close()) for a in agents]
        if closing:
            await asyncio.wait(closing, timeout=15.0)
        for agent in agents:
            if agent.task is not None:
                agent.task.cancel()
        await asyncio.gather(*(a.task for a in agents if a.task is not None), return_exceptions=True)
        await asyncio.gather(*(u.close() for u in ctx.uploaders), return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="JSON LoadSpec; ready/go/result files go next to it")
    parser.add_argument("--standalone", action="store_true", help="write go.json itself once connected")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="with --standalone: seconds before the window")
    parser.add_argument("--window-s", type=float, default=20.0, help="with --standalone: the measured window")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    soft, hard = raise_open_files_limit()
    spec = LoadSpec.from_json(json.loads(args.spec.read_text()))
    folder = args.spec.parent
    needed = len(spec.tokens) + spec.upload_connections + 64  # a control socket per agent, the uploaders, slack
    if needed > soft:
        print(f"loadgen: {len(spec.tokens)} agents need about {needed} open files; the limit is {soft} (hard {hard})",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.standalone:
        asyncio.run(_standalone(spec, folder, args.warmup_s, args.window_s))
    else:
        stats = asyncio.run(drive(spec, folder))
        write_json(folder / "result.json", {**stats.to_json(), "nofile_limit": [soft, hard], "pid": os.getpid()})
    return 0


async def _standalone(spec: LoadSpec, folder: Path, warmup_s: float, window_s: float) -> None:
    (folder / "go.json").unlink(missing_ok=True)

    async def go_when_ready() -> None:
        while not (folder / "ready.json").exists():
            await asyncio.sleep(0.05)
        start = time.time() + 0.2
        write_json(folder / "go.json", {"start": start, "measure_from": start + warmup_s,
                                        "measure_to": start + warmup_s + window_s})  # fmt: skip

    (folder / "ready.json").unlink(missing_ok=True)
    starter = asyncio.create_task(go_when_ready())
    stats = await drive(spec, folder)
    await starter
    write_json(folder / "result.json", stats.to_json())
    window = stats.window[1] - stats.window[0]
    print(json.dumps({"cycles_per_s": stats.cycles / window, "connected": stats.connected,
                      "done_rejected": stats.done_rejected, "no_lease": stats.no_lease}))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
