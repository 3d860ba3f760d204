"""The agent's main loop: lease, fetch what it lacks, compute, upload, report, with upload overlapping compute."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from . import __version__, trainer
from .codec import Codec, get_codec
from .config import AgentConfig
from .control import AgentStopped, Backoff, ConnectionLost, ControlChannel
from .controls import ControlError, Controls, Gate, Signals, describe_controls, parse_schedule
from .credit import credit_for
from .data import ShardReader, check_tokenizer
from .device import cap_gpu_memory, describe_device, select_device
from .feedback import ErrorFeedback, SliceKey
from .fetch import FetchError, HeldParams, ShardCache, fetch_params, still_current
from .local_steps import InnerOptimizers, RebaseFailed, RoundBase, compute_pseudo_gradient, local_lease_problem
from .models import ModelConfigError, get_model
from .netmeter import METER, LeaseCost
from .precision import autocast_dtype
from .progress import AgentStatus
from .protocol import (
    PAUSED_SINCE,
    PROTOCOL_VERSION,
    AgentHello,
    ControlsChanged,
    DataSpec,
    DeviceControls,
    Lease,
    LeaseDone,
    LeaseRelease,
    LeaseRequest,
    Paused,
    ProtocolError,
    Receipt,
    SliceRoute,
    UploadBegin,
    VersionPublished,
    chunk_fragments,
    no_lease_status,
    no_lease_why,
    ticket_is_check,
)
from .ratelimit import Limits
from .trainer import CampaignModel, ComputeCancelled, GradientResult, ModelCache, model_device
from .uploader import Uploader, UploadError

logger = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_OK = 0
EXIT_INTERRUPTED = 130  # second Ctrl-C: the shell convention for "killed by SIGINT"
LEASE_ERROR_PAUSE_S = 2.0  # after a lease that could not be prepared, before asking for another
CONTROL_CHECK_S = 2.0  # how often the volunteer's controls are read while paused or computing
# How long the site may hold a lease request while the steps this agent may work on are full: a
# pipelined agent asks during its compute, and the commit that makes room answers at once.
LEASE_WAIT_S = 10.0
READER_CACHE_ITEMS = 8  # decoded shards kept in memory (a shard is a few MiB)
# Of the shards a lease says the next leases will read (the site names enough for a lease of the same size,
# at most 64): a local-steps round spans many, and each one not fetched ahead is a wait on a home link.
MAX_PREFETCH_SHARDS = 64
MAX_REPORTED_S = 1e9  # the protocol's bound on seconds (``Seconds``): a report past it would be refused whole


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _call_and_hand_back(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    try:
        result, error = fn(*args, **kwargs), None
    except BaseException as exc:  # handed to the awaiting coroutine, which decides
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:
        pass  # the loop already closed: nobody waits for this result any more


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking ``fn`` in a fresh daemon thread and await its result.

    Unlike asyncio.to_thread, a daemon thread does not keep the process alive:
    a second Ctrl-C exits at once even while a long download or a gradient
    computation is still running.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    threading.Thread(
        target=_call_and_hand_back,
        args=(loop, future, fn, args, kwargs),
        name=f"crowdtrain-{getattr(fn, '__name__', 'work')}",
        daemon=True,
    ).start()
    return await future


class DaemonWorker:
    """One long-lived daemon thread running blocking calls in order (see ``in_daemon_thread``).

    Computes and downloads run on the same thread lease after lease: it keeps
    its malloc arena, so each lease reuses the megabytes the last one freed,
    and no thread is started per lease.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the worker thread, after the calls queued before it, and await its result."""
        self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args, kwargs))
        return await future

    def post(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` without waiting for it; it must handle its own errors."""
        self._start()
        self._queue.put((fn,))

    def close(self) -> None:
        """Let the thread end once the calls already queued are done."""
        if self._thread is not None:
            self._queue.put(())
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while call := self._queue.get():
            if len(call) == 1:  # posted: nobody waits for the result
                call[0]()
            else:
                _call_and_hand_back(*call)


@dataclass(frozen=True)
class Prepared:
    """A lease ready to compute: ``flat`` holds its base version's parameters unless the model already does."""

    lease: Lease
    cm: CampaignModel
    flat: torch.Tensor | None
    x: torch.Tensor
    y: torch.Tensor
    etags: list[str] = field(default_factory=list)
    leased_at: float = 0.0  # perf_counter when the lease arrived: later waiting was for its downloads
    round_base: RoundBase | None = None  # an overlapped local lease's round base, downloading meanwhile
    arriving: trainer.ArrivingSamples | None = None  # x and y, while its later shards still download


@dataclass(frozen=True)
class Resources:
    """What the compute may use: CPU threads and GPU memory (None: PyTorch's own default, no cap)."""

    threads: int | None = None
    gpu_memory_gb: float | None = None


class LeaseFailed(RuntimeError):
    """A lease this agent cannot work on (bad data, missing parameters, unknown model)."""


class Agent:
    """One volunteer agent: connects to the site and works leases until stopped.

    Args:
        config: the validated configuration.
        status: shared with the progress display; a fresh one when None.
        backoff: reconnect policy of the control channel.
        handle_signals: install SIGINT/SIGTERM handlers (only from the main thread).
        benchmark_s: time budget of the start-up matmul benchmark.
        signals: where the volunteer's controls read the clock, idle time, CPU use and battery (tests).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        status: AgentStatus | None = None,
        backoff: Backoff | None = None,
        handle_signals: bool = False,
        benchmark_s: float = 0.2,
        signals: Signals | None = None,
    ) -> None:
        self.config = config
        self.status = status or AgentStatus()
        self.status.network = METER
        self._backoff = backoff
        self._handle_signals = handle_signals
        self._benchmark_s = benchmark_s
        self._stopping = asyncio.Event()  # first Ctrl-C: finish the lease in progress, then exit
        self._stop_now = asyncio.Event()  # second Ctrl-C: give everything back and exit
        self._abort = threading.Event()  # tells the compute thread to give up between microbatches
        # Ends the compute in flight between microbatches: a second Ctrl-C (with _abort), or a control.
        self._cancel = threading.Event()
        # The volunteer's controls (``controls``): whether it may work now, read before each lease and while
        # computing; why it is paused ("" while it works), as the panel and the site were told.
        self._signals = signals or Signals()
        self._gate = Gate(config.controls, self._signals) if config.controls.any else None
        self._paused_why = ""
        # Threads and GPU memory: the controls' wish, and what the compute thread last applied (``_use_resources``).
        self._wanted = self._applied = Resources(config.threads, config.gpu_memory_gb)
        self._device = torch.device("cpu")
        self._default_threads = torch.get_num_threads()
        Limits.set(download_kbps=config.download_kbps, upload_kbps=config.upload_kbps)
        self._version_pushed = asyncio.Event()
        self._held: dict[int, Lease] = {}  # leases taken and not yet reported or released
        self._speed: dict[int, float] = {}  # samples/s per campaign, smoothed
        self._last_campaign: int | None = None
        self._last_no_lease: str | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self._readers: dict[tuple[str, DataSpec], ShardReader] = {}
        self._readers_lock = threading.Lock()  # the fetch thread and the arriving-samples thread share them
        self._prefetching: set[str] = set()  # shards a background thread is fetching ahead
        self._tokenizers: set[tuple[str, int]] = set()  # (sha256, vocabulary) of tokenizers checked
        self.leases_taken = 0
        self._control: ControlChannel
        self._uploader = Uploader()
        self._inner = InnerOptimizers()  # local mode: each campaign's inner optimizer, kept between leases
        self._feedback = ErrorFeedback()  # int8's rounding errors, fed into the next upload of each slice
        self._computer = DaemonWorker("crowdtrain-compute")
        self._fetcher = DaemonWorker("crowdtrain-fetch")
        self._prefetcher = DaemonWorker("crowdtrain-prefetch")  # apart: a lease's own fetch never queues behind it
        self._arriver = DaemonWorker("crowdtrain-arrive")  # a computing lease's later shards
        self._rebaser = DaemonWorker("crowdtrain-rebase")  # long-polls for the versions overlapped leases await
        self._rebasing: set[asyncio.Task[None]] = set()

    def request_stop(self) -> None:
        """First call: finish the lease being computed, report it, then exit. Second call: exit now."""
        if not self._stopping.is_set():
            logger.warning("stopping after the current lease; press Ctrl-C again to stop now")
            self.status.set_status("stopping after the current lease (Ctrl-C again: stop now)")
            self._stopping.set()
        else:
            logger.warning("stopping now; giving unfinished leases back")
            self._abort.set()
            self._cancel.set()
            self._stop_now.set()

    async def run(self) -> int:
        """Work until stopped, the lease limit is reached, or the site refuses this agent.

        Returns:
            The process exit code: 0 after a clean stop, 130 after a second Ctrl-C.

        Raises:
            AgentStopped: the site closed for good (bad token, revoked device) or stayed unreachable.
            ConfigError: the requested device is missing.
        """
        # start-up: pick the device and measure it, so the site can size the first lease
        device = select_device(self.config.device)
        self._device = device
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        if self.config.gpu_memory_gb is not None:
            cap_gpu_memory(device, self.config.gpu_memory_gb)
        info = await in_daemon_thread(describe_device, device, benchmark_s=self._benchmark_s)
        self.status.device = f"{info.kind}: {info.name}"
        self._models = ModelCache(device)
        self._downloaded = HeldParams()  # each campaign's last parameters as sent: the base of the next delta
        self._shards = ShardCache(self.config.cache_dir, self.config.shards_url, self.config.token)
        self._control = ControlChannel(
            self.config.control_url,
            self.config.token,
            AgentHello(protocol_version=PROTOCOL_VERSION, agent_version=__version__, device=info),
            on_push=self._on_push,
            on_state=self._on_connection_state,
            backoff=self._backoff,
        )
        loop = asyncio.get_running_loop()
        if self._handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.request_stop)
        control = asyncio.create_task(self._control.run(), name="crowdtrain-control")
        work = asyncio.create_task(self._work(), name="crowdtrain-work")
        stop_now = asyncio.create_task(self._stop_now.wait())
        try:
            await asyncio.wait({control, work, stop_now}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            if control.done():
                control.result()  # raises AgentStopped with the hint for the volunteer
                return EXIT_OK
            # second Ctrl-C: stop computing, hand every unfinished lease back, leave
            work.cancel()
            for task in self._reports:
                task.cancel()
            await self._release_all(timeout=2.0)
            return EXIT_INTERRUPTED
        finally:
            if self._handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            self._abort.set()
            self._cancel.set()
            for pending in (work, stop_now, *self._reports):
                pending.cancel()
            await self._control.close()
            control.cancel()
            await asyncio.gather(control, work, *self._reports, return_exceptions=True)
            await self._uploader.close()
            self._computer.close()
            self._fetcher.close()
            self._prefetcher.close()
            self._arriver.close()
            self._rebaser.close()
            for task in self._rebasing:
                task.cancel()
            self.status.set_status("stopped")

    # ------------------------------------------------------------------ main loop

    async def _work(self) -> int:
        """Work leases one after another, as a pipeline.

        While lease N computes, lease N+1 is requested and its shards and
        parameters download, and lease N-1 uploads and is reported: the
        compute thread only waits when the site has nothing to give.
        """
        following = asyncio.create_task(self._next_work()) if self._may_take_more() else None
        report: asyncio.Task[None] | None = None
        unsent: tuple[Lease, GradientResult] | None = None  # computed, upload not started yet
        compute_end: float | None = None  # when the last compute finished: the gap to the next is overhead
        METER.start_working()
        try:
            while following is not None:
                if unsent is not None and not following.done():
                    # The next lease may wait for this very upload (its commit makes the room): send it now.
                    started = time.perf_counter()
                    report = await self._start_report(report, *unsent)
                    METER.waited(time.perf_counter() - started)  # the previous upload was still going
                    unsent = None
                # fetch work: the lease requested (and downloaded) while the last one computed
                waiting_from = time.perf_counter()
                work = await following
                following = None
                if work is None:
                    break  # stopping while we waited for work
                # Waiting for the site to hand out work is not the link's fault; waiting for its downloads is.
                METER.waited(time.perf_counter() - max(waiting_from, work.leased_at))
                lease = work.lease
                if self._stopping.is_set():
                    # Ctrl-C came before this lease started: the site can give it to someone else now.
                    await self._release(lease)
                    break
                why = await self._why_paused()
                if why:  # a control stopped work while this lease downloaded: nobody waits on it
                    await self._note_pause(why)
                    logger.warning("lease %d: paused (%s); giving it back unstarted", lease.lease_id, why)
                    await self._release(lease)
                    following = asyncio.create_task(self._next_work()) if self._may_take_more() else None
                    continue
                if work.flat is not None:  # between computes, so the running one never sees new weights
                    if work.flat.device == trainer.model_device(work.cm):
                        trainer.load_params_(work.cm, work.flat, lease.base_version, work.etags)  # views: instant
                    else:  # a copy to the GPU: off the event loop
                        await self._computer.run(
                            trainer.load_params_, work.cm, work.flat, lease.base_version, work.etags
                        )

                # ask for the next lease now: its request and downloads overlap this compute
                following = asyncio.create_task(self._next_work()) if self._may_take_more() else None

                # forward/backward in a worker thread; the event loop keeps heartbeats and uploads going
                self.status.set_status(f"computing lease {lease.lease_id} ({lease.num_samples} samples)")
                compute_start = time.perf_counter()
                if compute_end is not None:
                    logger.debug(
                        "lease %d: %.1f ms idle between computes", lease.lease_id, 1e3 * (compute_start - compute_end)
                    )
                if not self._abort.is_set():
                    self._cancel.clear()
                compute = asyncio.ensure_future(self._computer.run(self._compute, work))
                # Watched even with no controls: the site may push some while this lease computes (2.9).
                watcher = asyncio.create_task(self._watch_controls())
                if unsent is not None:
                    # Sent once this compute runs: the upload's CPU then overlaps it instead of delaying its start.
                    report = await self._start_report(report, *unsent)
                    unsent = None
                try:
                    result = await compute
                except ComputeCancelled:
                    if self._abort.is_set():
                        break
                    # A control stopped work: the lease goes back at once, and nothing waits on it.
                    logger.warning("lease %d: paused (%s); giving it back unfinished", lease.lease_id, self._paused_why)
                    await self._release(lease)
                    continue
                except (RebaseFailed, trainer.SamplesUnavailable, trainer.GradientNotFinite) as exc:
                    logger.warning("lease %d: %s; giving it back", lease.lease_id, exc)
                    await self._release(lease)
                    continue
                finally:
                    watcher.cancel()
                compute_end = time.perf_counter()
                if result.rebase_wait_s:
                    METER.waited(result.rebase_wait_s)  # the round's base was still on its way
                logger.debug("lease %d: computed in %.1f ms", lease.lease_id, 1e3 * result.compute_s)
                self._note_speed(lease, result)
                unsent = (lease, result)
            if unsent is not None:
                report = await self._start_report(report, *unsent)
            if report is not None:
                self.status.set_status("uploading the last lease")
                await report
        finally:
            if following is not None:
                _drop(following)
        self.status.set_status("stopped")
        return EXIT_OK

    def _compute(self, work: Prepared) -> GradientResult:
        """In the compute thread: the lease's summed gradient (sync) or pseudo-gradient of inner steps (local)."""
        self._use_resources()
        lease = work.lease
        if lease.mode == "local" and lease.inner is not None:
            optimizer = self._inner.get(lease.campaign_id, work.cm, lease.inner, lease.base_version)
            start = None if work.round_base is None else self._inner.estimate(lease.campaign_id, lease.round_base)
            result = compute_pseudo_gradient(
                work.cm, optimizer, lease.inner.lr, work.x, work.y, lease.microbatch_size,
                inner_batch_size=lease.inner_batch_size, cancel=self._cancel, start=start, rebase=work.round_base,
                rebase_wait_s=max(0.0, work.leased_at + lease.deadline_s - time.perf_counter()),
                mixed_precision=lease.mixed_precision,
            )  # fmt: skip
            try:
                trainer.finite_or_raise(result.grad, lease.codec)
            except trainer.GradientNotFinite:
                self._inner.drop(lease.campaign_id)  # its moments took the NaNs too: the next round starts afresh
                raise
            self._inner.remember(lease.campaign_id, lease.round_base, result.final_params)
            return dataclasses.replace(result, final_params=None)
        result = trainer.compute_gradient(
            work.cm, work.x, work.y, lease.microbatch_size, cancel=self._cancel, mixed_precision=lease.mixed_precision,
            arriving=work.arriving,
        )  # fmt: skip
        trainer.finite_or_raise(result.grad, lease.codec)
        return result

    async def _start_report(
        self, previous: asyncio.Task[None] | None, lease: Lease, result: GradientResult
    ) -> asyncio.Task[None]:
        """Send and report ``lease`` in the background, after the previous report: one upload at a time."""
        if previous is not None:
            await previous
        report = asyncio.create_task(self._send_and_report(lease, result))
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)
        return report

    async def _next_work(self) -> Prepared | None:
        """The next lease with everything it needs downloaded; None if the agent is stopping."""
        while True:
            lease = await self._next_lease()
            if lease is None:
                return None
            problem = local_lease_problem(lease)
            if problem:
                logger.warning("lease %d cannot be worked on: %s; giving it back", lease.lease_id, problem)
                await self._release(lease)
                await self._pause(LEASE_ERROR_PAUSE_S)
                continue
            leased_at = time.perf_counter()
            round_base = self._await_round_base(lease)
            try:
                return dataclasses.replace(await self._fetch(lease), leased_at=leased_at, round_base=round_base)
            except LeaseFailed as exc:
                logger.warning("lease %d cannot be worked on: %s; giving it back", lease.lease_id, exc)
                await self._release(lease)
                await self._pause(LEASE_ERROR_PAUSE_S)

    def _may_take_more(self) -> bool:
        limit = self.config.max_leases
        return not self._stopping.is_set() and (limit is None or self.leases_taken < limit)

    async def _next_lease(self) -> Lease | None:
        """Ask the site for a lease until it gives one; None if the agent is stopping."""
        # One id per answer wanted: a request resent after a dropped connection keeps it, so the
        # site hands back the lease it may already have issued instead of reserving a second one.
        request_id = uuid.uuid4().hex
        while not self._stopping.is_set():
            await self._wait_while_paused()
            if self._stopping.is_set():
                break
            self._version_pushed.clear()  # before asking, so a push during the request still wakes us
            campaign = self.config.campaign_id
            speed = self._speed.get(campaign if campaign is not None else self._last_campaign or -1)
            request = LeaseRequest(
                campaign_id=campaign, samples_per_s=speed, request_id=request_id, wait_s=LEASE_WAIT_S
            )
            self.status.set_status("asking for work")
            call = asyncio.create_task(self._control.call(request, "lease", timeout=LEASE_WAIT_S + 30.0, retries=3))
            stopping = asyncio.create_task(self._stopping.wait())
            try:
                # Ctrl-C must not wait for a site that is down; a lease answered late is released by the channel.
                await asyncio.wait({call, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                _drop(stopping)
                _drop(call)  # a finished call is still read below, unless this coroutine was cancelled
            if not call.done() or call.cancelled():
                return None
            try:
                reply = call.result()
            except (ConnectionLost, TimeoutError) as exc:
                logger.debug("lease request failed (%r); asking again", exc)
                continue
            if isinstance(reply, Lease):
                self._held[reply.lease_id] = reply
                self._prefetch(reply)
                self.leases_taken += 1
                self._last_no_lease = None
                if self._stopping.is_set():
                    await self._release(reply)
                    return None
                self.status.campaign_id, self.status.lease_id = reply.campaign_id, reply.lease_id
                self.status.version = max(self.status.version or 0, reply.base_version)
                return reply
            request_id = uuid.uuid4().hex  # answered: the next request is a new one
            # no lease: say why, then ask again after retry_after_s or as soon as a version is published
            why = no_lease_why(reply.reason, reply.detail)
            # The site's My devices page shows the same words (crowdtrain_agent.protocol.no_lease_status).
            self.status.set_status(no_lease_status(reply.reason, reply.detail))
            # Once per reason at INFO: a site that cannot hold requests answers "step full" every step.
            if reply.reason == "quarantined" and reply.reason != self._last_no_lease:
                logger.warning("the site refuses work: %s", reply.detail)
            elif reply.reason != self._last_no_lease:
                logger.info("no lease from the site (%s); asking again in %.1f s", why, reply.retry_after_s)
            else:
                logger.debug("no lease from the site (%s)", why)
            self._last_no_lease = reply.reason
            await _wait_any((self._version_pushed, self._stopping), timeout=reply.retry_after_s)
        return None

    async def _fetch(self, lease: Lease) -> Prepared:
        """Download what a lease lacks (shards, its base version's parameters) without touching the model.

        It runs while another lease computes on the same model, so new
        parameters are returned here and loaded only between computes.
        """

        def blocking() -> Prepared:
            # Building a large model on the GPU takes seconds: that too stays off the event loop.
            cm = self._models.get(lease.campaign_id, lease.model)
            if cm.param_count != lease.param_count:
                raise LeaseFailed(
                    f"the site says {lease.model.architecture} has {lease.param_count} parameters, this agent "
                    f"builds {cm.param_count}; upgrade crowdtrain-agent (pip install -U crowdtrain-agent)"
                )
            if lease.data.kind == "tokens":
                self._check_tokens(lease)
            # A lease of sync mode computes once its first range is read; its later shards download meanwhile,
            # next to its parameters: a volunteer on a slow link starts on what came first.
            augment, version = lease.data.augment, lease.base_version
            later = {r.shard for r in lease.ranges[1:]} - {lease.ranges[0].shard}
            arriving: trainer.ArrivingSamples | None = None
            if lease.mode == "sync" and any(not self._shards.in_memory(sha) for sha in later):
                first = lease.ranges[0]
                reader = self._reader(first.shard, lease.data)
                rows = trainer.read_range(first, reader, augment=augment, version=version)
                arriving = trainer.ArrivingSamples(lease.num_samples, rows)
                self._arriver.post(functools.partial(self._fill, lease, arriving))
                x, y = arriving.x, arriving.y
            else:
                readers = {r.shard: self._reader(r.shard, lease.data) for r in lease.ranges}
                x, y = trainer.gather_samples(lease.ranges, readers, augment=augment, version=version)
            flat: torch.Tensor | None = None
            etags: list[str] = []
            held = self._models.holds(lease.campaign_id, lease.model, lease.base_version)
            if not (held and still_current(lease.slices, lease.base_version, cm.etags, ticket=lease.ticket)):
                started = time.perf_counter()
                # A sync lease's model only reads its parameters (views of ``flat`` on a CPU): the store keeps
                # ``flat`` itself as the next delta's base, not a copy. Local steps write into theirs.
                flat = fetch_params(
                    lease.slices, lease.base_version, lease.param_count, ticket=lease.ticket, etags=etags,
                    held=self._downloaded, campaign_id=lease.campaign_id, read_only=lease.mode == "sync",
                )  # fmt: skip
                logger.debug(
                    "lease %d: parameters of version %d in %.1f ms",
                    lease.lease_id,
                    lease.base_version,
                    1e3 * (time.perf_counter() - started),
                )
            return Prepared(lease=lease, cm=cm, flat=flat, x=x, y=y, etags=etags, arriving=arriving)

        try:
            return await self._fetcher.run(blocking)
        except (FetchError, ProtocolError, ModelConfigError, ValueError, OSError) as exc:
            raise LeaseFailed(str(exc)) from None

    def _await_round_base(self, lease: Lease) -> RoundBase | None:
        """For an overlapped local lease, start downloading its round base, which may not be published yet.

        The download long-polls the aggregators (each holds a request for a
        version being made until it is published) for as long as the lease
        lasts, and goes through the same store as every parameter download: the
        next lease's fetch of that version reuses it instead of downloading it
        again.
        """
        if lease.mode != "local" or lease.rebase_to is None:
            return None
        target = RoundBase(lease.rebase_to)

        def download() -> torch.Tensor:
            return fetch_params(
                lease.slices, target.version, lease.param_count, ticket=lease.ticket,
                held=self._downloaded, campaign_id=lease.campaign_id, wait_s=lease.deadline_s,
            )  # fmt: skip

        async def fetch() -> None:
            try:
                target.deliver(await self._rebaser.run(download))
            except (FetchError, ProtocolError, ValueError, OSError) as exc:
                target.fail(str(exc))
            finally:  # anything else, or the agent stopping: the compute must not wait out the deadline
                target.fail("the download stopped")

        task = asyncio.create_task(fetch(), name=f"crowdtrain-rebase-{lease.lease_id}")
        self._rebasing.add(task)
        task.add_done_callback(self._rebasing.discard)
        return target

    def _prefetch(self, lease: Lease) -> None:
        """Fetch the shards the next leases will read in the background, so no lease waits for its data.

        A shard download takes tens of milliseconds; on the critical path it
        would leave the device idle between two leases every few leases.
        """
        wanted = [
            sha
            for sha in lease.prefetch[:MAX_PREFETCH_SHARDS]
            if sha not in self._prefetching and not self._shards.in_memory(sha)
        ]
        if not wanted:
            return
        self._prefetching.update(wanted)

        def fetch_ahead() -> None:
            for sha in wanted:
                try:
                    self._shards.get(sha)
                except FetchError as exc:  # the lease that needs it will try again and say why
                    logger.debug("prefetch of shard %s failed: %s", sha[:12], exc)
                finally:
                    self._prefetching.discard(sha)

        self._prefetcher.post(fetch_ahead)

    def _check_tokens(self, lease: Lease) -> None:
        """A tokenized campaign's model must embed every id, and its tokenizer must be the one the ids came from.

        The tokenizer is fetched and verified like a shard, once per agent.

        Raises:
            ModelConfigError, ProtocolError, FetchError: saying which of the three disagrees.
        """
        spec = lease.data
        get_model(lease.model.architecture).check_vocab(lease.model.config, spec.vocab_size)
        if (spec.tokenizer, spec.vocab_size) in self._tokenizers:
            return
        if not spec.tokenizer:
            raise ProtocolError("a lease of token data names no tokenizer; the site must be upgraded")
        check_tokenizer(spec, self._shards.get(spec.tokenizer))
        self._tokenizers.add((spec.tokenizer, spec.vocab_size))

    def _fill(self, lease: Lease, arriving: trainer.ArrivingSamples) -> None:
        """In the arriving-samples thread: read the lease's later ranges into ``arriving``, downloading their shards."""
        try:
            for r in lease.ranges[1:]:
                if self._abort.is_set():
                    arriving.fail("the agent is stopping")
                    return
                reader = self._reader(r.shard, lease.data)
                arriving.put(*trainer.read_range(r, reader, augment=lease.data.augment, version=lease.base_version))
        except (FetchError, ProtocolError, ValueError, OSError) as exc:
            arriving.fail(f"its samples could not be read: {exc}")
        except Exception as exc:  # nothing may leave the compute waiting for rows that will not come
            logger.exception("reading the samples of lease %d failed", lease.lease_id)
            arriving.fail(f"its samples could not be read: {exc!r}")

    def _reader(self, sha256: str, spec: DataSpec) -> ShardReader:
        """A decoded shard, kept for the next leases (they mostly read the same few shards)."""
        key = (sha256, spec)
        with self._readers_lock:
            reader = self._readers.pop(key, None)
        if reader is None:  # downloaded and decoded outside the lock: another thread's lease goes on meanwhile
            reader = ShardReader(spec, self._shards.get(sha256))
        with self._readers_lock:
            self._readers[key] = reader  # most recently used last
            while len(self._readers) > READER_CACHE_ITEMS:
                self._readers.pop(next(iter(self._readers)))
        return reader

    def _note_speed(self, lease: Lease, result: GradientResult) -> None:
        speed = result.num_samples / max(result.compute_s, 1e-6)
        previous = self._speed.get(lease.campaign_id)
        # Smoothed, so one slow lease (a browser tab, thermal throttling) does not halve the next lease.
        self._speed[lease.campaign_id] = speed if previous is None else 0.7 * previous + 0.3 * speed
        self._last_campaign = lease.campaign_id
        self.status.samples_per_s = self._speed[lease.campaign_id]
        self.status.last_loss = result.loss_sum / max(result.num_samples, 1)
        self.status.out_of_memory += result.out_of_memory
        cm = self._models.get(lease.campaign_id, lease.model)
        facts = []
        if cm.microbatch_cap is not None and cm.microbatch_cap < lease.microbatch_size:
            facts.append(f"microbatches of {cm.microbatch_cap} (the campaign asks {lease.microbatch_size})")
        if cm.checkpointing:
            facts.append("activation checkpointing")
        if (dtype := autocast_dtype(model_device(cm), lease.mixed_precision)) is not None:
            facts.append(f"{str(dtype).removeprefix('torch.')} autocast")
        self.status.memory = ", ".join(facts)

    # ------------------------------------------------------------- send, report

    async def _send_and_report(self, lease: Lease, result: GradientResult) -> None:
        """Upload every slice of the lease's gradient, then report the receipts to the site."""
        try:
            # send: each slice to the aggregator that owns it, all aggregators at once
            codec = get_codec(lease.codec, lease.codec_block_size)
            started = time.perf_counter()
            cost = LeaseCost()
            sends = [self._send_slice(lease, route, result.grad, codec, cost) for route in lease.slices]
            receipts = await asyncio.gather(*sends)
            logger.debug("lease %d: uploaded in %.1f ms", lease.lease_id, 1e3 * (time.perf_counter() - started))
            # report: the receipts prove that the aggregators hold this lease's gradient
            done = self._done_report(lease, result, list(receipts), cost)
            ack = await self._control.call(done, f"done:{lease.lease_id}", timeout=30.0, retries=3)
        except (UploadError, ProtocolError) as exc:
            logger.warning("lease %d: %s; giving the lease back", lease.lease_id, exc)
            self.status.rejected += 1
            await self._release(lease)
            return
        except (ConnectionLost, TimeoutError) as exc:
            logger.warning(
                "lease %d: the site did not confirm the done report (%r); it will expire", lease.lease_id, exc
            )
            self._held.pop(lease.lease_id, None)
            return
        self._held.pop(lease.lease_id, None)
        per_sample = result.loss_sum / max(result.num_samples, 1)
        if ack.accepted:
            self.status.accepted += 1
            flops = result.num_samples * get_model(lease.model.architecture).flops_per_sample(lease.model.config)
            credit = credit_for(result.num_samples, flops / max(result.num_samples, 1))
            if ack.verification == "check":
                counted, granted = "a copy to verify another volunteer's work", "(copies are not credited)"
                credit = 0.0
            elif ack.verification == "pending":
                counted = f"counted in step {ack.step}"
                granted = "pending verification (another volunteer computes the same samples)"
            else:
                counted, granted = f"counted in step {ack.step}", f"granted when step {ack.step} commits"
            self.status.credit += credit
            # The receipt: what the site accepted, and the credit it grants and when.
            logger.info(
                "lease %d done: %d samples at version %d, loss %.4f, %.1f samples/s; %s; %.3g GFLOP, %.3g credit %s",
                lease.lease_id,
                result.num_samples,
                lease.base_version,
                per_sample,
                result.num_samples / max(result.compute_s, 1e-6),
                counted,
                flops / 1e9,
                credit,
                granted,
            )
        else:
            self.status.rejected += 1
            logger.warning("lease %d was not counted: %s", lease.lease_id, ack.reason or "no reason given")

    def _done_report(self, lease: Lease, result: GradientResult, receipts: list[Receipt], cost: LeaseCost) -> LeaseDone:
        """The done report, with what the lease cost the link (``netmeter.LeaseCost``).

        Taken once the upload succeeded, right before sending: a lease given
        back instead leaves its downloads and waits to the next report.
        """
        cost.bytes_down, cost.network_s = METER.unreported()
        logger.debug(
            "lease %d: %d bytes up, %d bytes down, %.2f s waiting on the network",
            lease.lease_id,
            cost.bytes_up,
            cost.bytes_down,
            cost.network_s,
        )
        return LeaseDone(
            lease_id=lease.lease_id,
            receipts=receipts,
            num_samples=result.num_samples,
            loss_sum=result.loss_sum,
            compute_s=result.compute_s,
            bytes_up=cost.bytes_up,
            bytes_down=cost.bytes_down,
            network_s=round(min(cost.network_s, MAX_REPORTED_S), 6),
        )

    async def _send_slice(
        self, lease: Lease, route: SliceRoute, grad: torch.Tensor, codec: Codec, cost: LeaseCost | None = None
    ) -> Receipt:
        # fp32 goes out straight from the gradient's memory (chunk views, no copies); other codecs
        # encode first, which for a large slice takes a while: off the event loop, then.
        # A lossy codec (int8) adds the slice's last rounding error and keeps this one's, except for a
        # verification copy, which no step uses (``feedback``).
        piece = grad[route.start : route.end]
        if codec.name == "fp32":
            chunks = chunk_fragments(codec.view(piece))
        elif codec.lossy and not ticket_is_check(lease.ticket):
            key = SliceKey(lease.campaign_id, lease.param_count, codec.name, codec.block_size, route.start, route.end)
            chunks = await in_daemon_thread(lambda: chunk_fragments(self._feedback.encode(key, piece, codec)))
        else:
            chunks = await in_daemon_thread(lambda: chunk_fragments(codec.view(piece)))
        begin = UploadBegin(
            ticket=lease.ticket,
            slice_index=route.index,
            codec=lease.codec,
            num_elements=route.end - route.start,
            num_chunks=len(chunks),
            codec_block_size=lease.codec_block_size,
        )
        receipt = await self._uploader.upload(route.upload_url, begin, chunks, cost=cost)
        return Receipt(slice_index=route.index, token=receipt.token)

    # ------------------------------------------------------------------ helpers

    async def _release(self, lease: Lease, timeout: float = 5.0) -> None:
        """Give a lease back so its samples go to another agent at once instead of at its deadline."""
        self._held.pop(lease.lease_id, None)
        call = self._control.call(LeaseRelease(lease_id=lease.lease_id), f"release:{lease.lease_id}", timeout=timeout)
        try:
            # Bounded as a whole: while the site is unreachable, letting the lease expire is fine.
            await asyncio.wait_for(call, timeout)
            logger.info("gave lease %d back to the site", lease.lease_id)
        except (ConnectionLost, TimeoutError, AgentStopped) as exc:
            logger.debug("release of lease %d not confirmed (%r); it will expire", lease.lease_id, exc)

    async def _release_all(self, timeout: float) -> None:
        leases = list(self._held.values())
        await asyncio.gather(*(self._release(lease, timeout) for lease in leases), return_exceptions=True)

    async def _pause(self, seconds: float) -> None:
        await _wait_any((self._stopping,), timeout=seconds)

    # ------------------------------------------------------------------ the volunteer's controls

    async def _why_paused(self) -> str:
        """Why the volunteer's controls stop work now ("": they allow it); read off the loop (it may run a program)."""
        if self._gate is None:
            return ""
        return await in_daemon_thread(self._gate.why_not)

    async def _note_pause(self, why: str) -> None:
        """Say a change of pause in the log, the panel and to the site (a site of 2.8 on; older ones cannot hear it)."""
        if why == self._paused_why:
            return
        self._paused_why = why
        if why:
            logger.warning("paused: %s; no work is taken until that changes", why)
            self.status.set_status(f"paused: {why}")
        else:
            logger.info("your controls allow work again")
        await self._tell_pause()

    async def _tell_pause(self) -> None:
        if self._control.minor < PAUSED_SINCE:
            return
        try:
            await self._control.send(Paused(why=self._paused_why))
        except (ConnectionLost, AgentStopped):
            pass  # told again on the next connection (``_on_connection_state``)

    def _apply_site_controls(self, site: DeviceControls | None) -> None:
        """Take the controls set on My devices (each welcome brings them), under those set here, which win."""
        own = self.config.controls
        # Set here: named by a flag, variable or the file, or given in this agent's config at all.
        local = set(self.config.local_controls)
        local |= {"idle_minutes"} if own.idle_after_min is not None else set()
        local |= {"max_other_cpu"} if own.max_other_cpu is not None else set()
        local |= {"schedule"} if own.schedule else set()
        local |= {"pause_on_battery"} if own.pause_on_battery else set()
        local |= {"upload_kbps"} if self.config.upload_kbps else set()
        local |= {"download_kbps"} if self.config.download_kbps else set()
        given = site or DeviceControls()
        try:
            controls = Controls(
                idle_after_min=own.idle_after_min if "idle_minutes" in local else given.idle_minutes,
                max_other_cpu=own.max_other_cpu
                if "max_other_cpu" in local
                else (given.max_other_cpu_percent / 100 if given.max_other_cpu_percent else None),
                schedule=own.schedule if "schedule" in local else parse_schedule(given.schedule),
                pause_on_battery=own.pause_on_battery if "pause_on_battery" in local else given.pause_on_battery,
            )
        except ControlError as exc:
            logger.warning("the controls set on the site cannot be used (%s); this agent keeps its own", exc)
            return
        self._wanted = Resources(
            self.config.threads if self.config.threads else given.threads,
            self.config.gpu_memory_gb if self.config.gpu_memory_gb is not None else given.gpu_memory_gb,
        )
        upload = self.config.upload_kbps if "upload_kbps" in local else given.upload_kbps
        download = self.config.download_kbps if "download_kbps" in local else given.download_kbps
        current = self._gate.controls if self._gate is not None else Controls()
        if controls != current:
            logger.info("your controls now: %s", describe_controls(controls) or "none (work at any time)")
            self._gate = Gate(controls, self._signals) if controls.any else None
        Limits.set(download_kbps=download, upload_kbps=upload)

    def _use_resources(self) -> None:
        """In the compute thread, between two leases: the CPU threads and GPU memory the controls now allow."""
        wanted, applied = self._wanted, self._applied
        if wanted == applied:
            return
        self._applied = wanted
        if wanted.threads != applied.threads:
            torch.set_num_threads(wanted.threads or self._default_threads)
            logger.info("computing on %d CPU threads", torch.get_num_threads())
        if wanted.gpu_memory_gb != applied.gpu_memory_gb and self._device.type == "cuda":
            if wanted.gpu_memory_gb is None:
                torch.cuda.set_per_process_memory_fraction(1.0, self._device)
                logger.info("the GPU's memory is no longer capped")
            else:
                cap_gpu_memory(self._device, wanted.gpu_memory_gb)

    async def _wait_while_paused(self) -> None:
        """Return once the controls allow work (at once if they do), or the agent stops.

        The first time, after the site's welcome: it brings the controls set on My devices.
        """
        if self._control.welcome is None:
            welcomed = asyncio.create_task(self._control.welcomed())
            stopping = asyncio.create_task(self._stopping.wait())
            try:
                await asyncio.wait({welcomed, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this coroutine is cancelled: neither task is left unread
                _drop(stopping)
                _drop(welcomed)
            if not welcomed.done() or welcomed.cancelled() or welcomed.exception() is not None:
                return  # stopping, or the site closed for good: the control task ends the agent with its reason
        while not self._stopping.is_set():
            why = await self._why_paused()
            await self._note_pause(why)
            if not why:
                return
            await self._pause(CONTROL_CHECK_S)

    async def _recheck_controls(self) -> None:
        await self._note_pause(await self._why_paused())

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._reports.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._reports.discard)

    async def _watch_controls(self) -> None:
        """While a lease computes: once a control stops work, end the compute between two microbatches."""
        while True:
            await asyncio.sleep(CONTROL_CHECK_S)
            why = await self._why_paused()
            if why:
                await self._note_pause(why)
                self._cancel.set()
                return

    def _on_push(self, message: Any) -> None:
        if isinstance(message, ControlsChanged):  # changed on My devices while connected
            self._apply_site_controls(message.controls)
            self._background(self._recheck_controls())  # My devices shows the new state without waiting
            return
        if isinstance(message, VersionPublished):
            wanted = self.config.campaign_id
            if wanted is not None and message.campaign_id != wanted:
                return
            if self.status.campaign_id in (None, message.campaign_id):
                self.status.version = message.version
                self.status.published_loss = message.loss
            loss = "" if message.loss is None else f" (training loss {message.loss:.4f})"
            logger.info("campaign %d published version %d%s", message.campaign_id, message.version, loss)
            self._version_pushed.set()

    def _on_connection_state(self, text: str) -> None:
        # "connected" only replaces a connection status; it must not hide "computing lease 7".
        if text != "connected" or self.status.status.startswith(("starting", "reconnecting", "disconnected")):
            self.status.set_status(f"paused: {self._paused_why}" if text == "connected" and self._paused_why else text)
        if text == "connected" and self._control.welcome is not None:
            self._apply_site_controls(self._control.welcome.controls)
        if text == "connected" and self._paused_why:  # a new connection, maybe a new site process: tell it again
            self._background(self._tell_pause())


def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel a task no one will await, and read its failure when it ends.

    asyncio logs an unread failure when the garbage collector frees the task, inside whatever
    code runs at that moment: a stop must not leave one behind.
    """
    if task.done():
        _read_outcome(task)
    else:
        task.add_done_callback(_read_outcome)
        task.cancel()


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Wait until one of ``events`` is set or ``timeout`` seconds pass."""
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
