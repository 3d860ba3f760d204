"""The scale bench: the site under thousands of simulated agents, on PostgreSQL + Redis with two site processes.

    python -m tests.benchmarks.scale                       # every phase at the issue's sizes (make bench runs it)
    python -m tests.benchmarks.scale --agents 100,1000 --phases wide,w1like
    python -m tests.benchmarks.scale --agents 50 --cpu-agents 50,200 --idle-agents 500 --overload-agents 300 \\
        --window-s 8                                       # a quick look, about 3 minutes
    python -m tests.benchmarks.scale --backend sqlite --phases wide,w1like --agents 10,100,300,1000 \\
        --cpu-agents 10,100,300,1000                       # the embedded default, as the issue measured it

Each phase gets a fresh site: a PostgreSQL database cloned from a template
(migrated once, with every simulated volunteer's device already in it), an
emptied Redis database, two daphne processes (``--sites``; the load generator spreads
its agents over both), a committer writing the steps they fill (``--committers``;
its CPU is counted as the site's), one Celery worker with beat, and, when agents lease,
one aggregator serving a 58-parameter MLP. The agents come from
``tests.benchmarks.loadgen``: the agent's own control channel and uploader,
a fixed gradient, no compute. Everything listens on 127.0.0.1.

Phases and the ``bench: NAME=VALUE`` lines they print:

- ``wide`` (N in ``--agents``, and ``--cpu-agents``): steps of
  ``2 * N`` one-microbatch leases, so every agent always finds room.
  ``lease_cycles_per_s_N`` (lease, upload, accepted done report, per second of
  the window), ``lease_p99_ms_N`` (lease request to lease), and
  ``site_cpu_ms_per_lease_N`` (user + system CPU of both daphne processes
  over the window, from /proc/<pid>/stat, per accepted cycle; the Celery
  worker's, which judges verification checks, in its note),
  ``serving_cpu_ms_per_cycle_N`` (the same for everything that serves a
  cycle: both sites, the worker, the aggregator, PostgreSQL and Redis; it is
  also the cores that side needs per 1,000 cycles/s), ``step_publish_s_N``
  (median seconds from the start of a step's commit to its version
  published: the step's transaction, the aggregators' step, the version
  recorded; the step after next waits on it, so a pipeline slower than the
  swarm fills a step holds agents back whatever the CPU).
- ``even`` phases of the ``wide`` set (N in ``--cpu-agents``): whether the
  cost of a lease grows with the swarm. N agents offer the same
  ``--cpu-rate`` cycles per second together (each one every N / rate
  seconds), in steps of ``2 * rate`` leases, so only N changes: the sockets
  held, their heartbeats, the devices known. The wide phases cannot tell
  that apart: N agents there offer N cycles/s, so at 100 agents the site's
  fixed costs (housekeeping, timers, a step's commit) are spread over few
  leases, and at 5,000 a saturated site spends its time refusing. The same
  figures with ``_even_`` in the name, then
  ``site_cpu_ms_per_lease_spread_pct`` (largest over smallest across N) and
  ``site_cpu_ms_per_lease_band_pct`` (every N within this many percent of one
  centre, the best one: the lenient reading of "flat within ±20%").
  PostgreSQL's and Redis's CPU is what their processes alive at both ends of
  the window used, machine-wide: a backend that ends within the window is
  missed, and another program's use of those servers is counted.
- ``w1like`` (N in ``--agents``): steps of 32 leases, like W1's 1024 samples in
  microbatches of 32. The same three figures with ``_w1like_`` in the name.
  Most agents wait for room here, so its latency includes the wait the site
  holds a request for (``wait_s``), by design.
- ``idle``: ``--idle-agents`` agents join at ``--join-rate`` per second and
  only heartbeat. ``idle_cpu_pct_per_1000`` (both daphne processes' CPU, in
  percent of one core, per 1,000 connected agents) and ``connect_p99_ms_N``
  (TCP connect to welcome; an agent that never got in counts as infinite).
- ``overload``: ``--overload-agents`` agents cycling without pause against a
  site squeezed onto ``--overload-site-cpus``. ``overload_lost``: leases whose
  agent uploaded the gradient and reported done while connected, that the
  site did not count (done rejected, or expired unconfirmed; a backup twin
  whose other lease was counted is not lost), from the
  agents' acks and the database afterwards.

Each agent paces itself to one cycle per ``--period-s`` (0: back to back),
so N agents offer ``N / period_s`` cycles per second: with the default of
1 s, 1,000 agents offer exactly the 1,000 cycles/s the site should sustain,
and a site that keeps up shows at least that (each agent then completes 20 or
21 cycles in a 20 s window) with its p99 a service time, not a queue. Every phase is bounded
(``--phase-limit-s``); a phase that cannot run or did not finish prints
``NAME=skipped (why)`` for each of its figures. A figure measured while the
load generator's event loop lagged, or while other processes on this
shared machine used a sizable share of the CPU, says so in parentheses: the
site may have been faster than the figure.

The load generator costs about 1 ms of CPU per cycle (JSON, frames and
checks of the real client code), so 1,000 cycles/s keep one core busy: use
``--loadgen-procs 2`` where the site is fast enough for that to matter (a
figure says "load generator busy" when it was the limit).

``--backend sqlite`` runs the phases on the embedded default instead, as
``make demo`` does: one daphne process on SQLite (a copy of a migrated and
seeded template file per phase), the in-process channel layer and scheduler
state, no Redis and no Celery worker (verdicts are reached in the site
process). Its figures carry ``_sqlite`` in their names.

Thousands of sockets need file descriptors: the bench raises its soft
RLIMIT_NOFILE to the hard limit before it starts anything (children inherit
it) and prints the limit it ran with. Runs and logs stay in
``var/bench/scale/<phase>/``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import resource
import secrets
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
for _folder in (
    REPO_ROOT / "platform",
    REPO_ROOT / "agent" / "src",
    REPO_ROOT / "deploy" / "launcher",
):  # as manage.py does
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import numpy as np  # noqa: E402

from crowdtrain_launcher import Child, LaunchError, Swarm, get_json  # noqa: E402

from .cpu_time import cpu_between, sample_cpu  # noqa: E402
from .databases import (  # noqa: E402
    copy_sqlite,
    database_name,
    flush_redis,
    lease_states,
    recreate_database,
    step_publish_times,
    verification_counts,
    with_database,
)
from .figures import band_pct, figure_line, format_value, percentile, skipped_line, spread_pct  # noqa: E402
from .loadgen import raise_open_files_limit, write_json  # noqa: E402

logger = logging.getLogger("tests.benchmarks.scale")

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/crowdtrain_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/12"

# The campaign: a 4-8-2 MLP (58 parameters), microbatch 8, one microbatch per lease.
TINY_MLP = {"in_dim": 4, "hidden": [8], "classes": 2}
MICROBATCH = 8
NUM_SAMPLES = 1 << 16
LEASE_TARGET_S = 15.0  # the site's default; the agents claim a speed that makes one microbatch this long
WIDE_LEASES_PER_AGENT = 2  # a wide step holds two leases per agent: room for every agent, with one step ahead
W1_LEASES_PER_STEP = 32  # W1: global batch 1024 over microbatches of 32
RECORDS_SETTLE_S = 20.0  # how long the overload phase waits for the site's lease records to catch up
# A backup twin that lost the race: its samples were counted through the other lease of the pair, so
# nothing was lost, though its own report was turned away (the site's reasons, scheduler/lua/done.lua).
TWIN_RELEASES = frozenset({"released: the backup lease finished first", "released: the original lease finished first"})
SQLITE_FILE = "crowdtrain.sqlite3"  # the embedded default's database in CROWDTRAIN_VAR_DIR (settings.DATABASES)
# Beyond these, a figure may be the load generator's or the neighbours' and not the site's.
LAG_NOTE_MS = 200.0
FOREIGN_NOTE_CORES = 0.25
LOADGEN_BUSY_CORES = 0.8  # per load-generator process: one event loop, one core at most


@dataclass(frozen=True)
class Options:
    root: Path
    database_url: str  # the phase database; the template is its name + "_tpl"
    redis_url: str
    agents: list[int]
    cpu_agents: list[int]
    idle_agents: int
    join_rate: float
    overload_agents: int
    overload_site_cpus: list[int] | None
    phases: list[str]
    period_s: float
    warmup_s: float
    window_s: float
    idle_window_s: float
    overload_window_s: float
    connect_rate: float
    upload_connections: int
    loadgen_procs: int
    phase_limit_s: float
    nofile: int
    backend: str = "postgres"  # or "sqlite": the embedded default, one site process
    sites: int = 2  # daphne processes on PostgreSQL + Redis (the embedded default runs one)
    committers: int = 1  # processes writing full steps beside them (none in the embedded default)
    cpu_rate: float = 150.0  # cycles/s the even phases' agents offer together, whatever their number

    @property
    def embedded(self) -> bool:
        return self.backend == "sqlite"

    @property
    def tag(self) -> str:
        """What the figures' names carry for this backend."""
        return "_sqlite" if self.embedded else ""


SERVING_ROLES = ("site", "worker", "aggregator", "services")  # "services": PostgreSQL and Redis


def lost_leases(reported: Sequence[int], states: Mapping[int, str]) -> list[int]:
    """Reported leases the site did not count, leaving out backup twins whose other lease was counted."""
    return [i for i in reported if states.get(i) != "accepted" and states.get(i) not in TWIN_RELEASES]


@dataclass
class PhaseRun:
    """What one phase measured: merged load-generator counts and CPU per role over the window."""

    name: str
    agents: int
    window_s: float  # the window the load generators counted cycles in
    load: dict[str, Any]
    cpu_s: dict[str, float]  # role -> CPU seconds between the samples at the window's ends
    cpu_window_s: float  # between those samples: the window, give or take a few ms of sleep
    foreign_cores: float  # CPU used by processes that are not this bench's, in cores
    period_s: float = 0.0
    loadgen_procs: int = 1
    db_leases: dict[str, int] = field(default_factory=dict)
    lost: int | None = None
    step_publish: list[tuple[int, float]] = field(default_factory=list)  # (leases, s) per applied step
    verification: tuple[int, int] | None = None  # (checks opened, copies reported) in the window

    @property
    def cycles_per_s(self) -> float:
        return self.load["cycles"] / self.window_s

    @property
    def site_cpu_ms_per_lease(self) -> float:
        return 1e3 * self.cpu_s["site"] / self.load["cycles"] if self.load["cycles"] else math.inf

    @property
    def worker_cpu_ms_per_lease(self) -> float:
        """The Celery worker's share: it judges verification checks (``verification.tasks``) off the site."""
        return 1e3 * self.cpu_s.get("worker", 0.0) / self.load["cycles"] if self.load["cycles"] else math.inf

    @property
    def serving_cpu_ms_per_cycle(self) -> float:
        """What a cycle costs everything that serves it (sites, worker, aggregator, PostgreSQL, Redis), in ms.

        Numerically the cores that serving side needs per 1,000 cycles/s: what an
        operator sizes a machine by, and what says whether a target is in reach of this one.
        """
        spent = sum(self.cpu_s.get(role, 0.0) for role in SERVING_ROLES)
        return 1e3 * spent / self.load["cycles"] if self.load["cycles"] else math.inf

    def caveat(self) -> str:
        """The parenthesis a figure of this phase carries when something other than the site may have limited it."""
        notes = []
        if self.load["loop_lag_max_ms"] > LAG_NOTE_MS:
            notes.append(f"load generator's loop lagged up to {self.load['loop_lag_max_ms']:.0f} ms")
        loadgen_cores = self.cpu_s.get("loadgen", 0.0) / self.cpu_window_s
        if loadgen_cores > LOADGEN_BUSY_CORES * self.loadgen_procs:
            notes.append(f"load generator busy ({loadgen_cores:.2f} cores; try --loadgen-procs)")
        if self.foreign_cores > FOREIGN_NOTE_CORES:
            notes.append(f"other processes used {self.foreign_cores:.2f} cores")
        return "lower bound: " + ", ".join(notes) if notes else ""


class PhaseSkipped(RuntimeError):
    """A phase that could not run or finish; the message is the reason printed with its figures."""


# ------------------------------------------------------------------ one phase


def write_npz(path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_SAMPLES, TINY_MLP["in_dim"])).astype(np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=(x[:, 0] > 0).astype(np.int64))
    path.write_bytes(buffer.getvalue())


def campaign_spec(npz: Path, target_batch_size: int) -> dict[str, Any]:
    return {
        "campaigns": [{
            "name": "scale", "architecture": "mlp", "model_config": TINY_MLP,
            "optimizer": {"name": "sgd", "lr": 0.01}, "dataset": {"kind": "npz", "path": str(npz), "name": "scale"},
            "target_batch_size": target_batch_size, "microbatch_size": MICROBATCH, "codec": "fp32", "staleness": 1,
            "checkpoint_every": 1_000_000, "validate_every": 0, "seed": 0,
        }],
        "aggregators": ["agg-1"],
    }  # fmt: skip


@dataclass(frozen=True)
class PhasePlan:
    name: str
    agents: int
    mode: str  # "cycle" or "idle"
    leases_per_step: int | None = None  # None: wide (every agent fits)
    window_s: float = 20.0
    connect_rate: float = 200.0
    period_s: float = 1.0
    site_cpus: list[int] | None = None
    drain_s: float = 15.0
    lost_check: bool = False
    warmup_s: float | None = None  # cycling before the window; None: --warmup-s


class Bench:
    """The state shared by the phases of one run: paths, services, the template database and its tokens."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.root = options.root
        self.npz = self.root / "scale.npz"
        self.tokens: list[str] = []

    def prepare(self, most_agents: int) -> None:
        """Write the dataset; migrate the template database and seed every simulated volunteer into it once."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        write_npz(self.npz)
        spec = self.root / "template-spec.json"
        spec.write_text(json.dumps({"bulk_agents": most_agents}))
        if self.options.embedded:
            env = self._env(None)
        else:
            template = database_name(self.options.database_url) + "_tpl"
            recreate_database(self.options.database_url, template)
            env = self._env(with_database(self.options.database_url, template))
        swarm = Swarm(self.root / "template", env=env)
        started = time.monotonic()
        seeded = json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec), timeout_s=600))
        self.tokens = seeded["bulk_agents"]
        logger.info("template database: migrated, %d devices, in %.1f s", len(self.tokens),
                    time.monotonic() - started)  # fmt: skip

    def _env(self, database_url: str | None, var_dir: Path | None = None) -> dict[str, str]:
        """A site's environment; no database URL: the embedded default's SQLite file in ``var_dir``."""
        env = {
            "CROWDTRAIN_VAR_DIR": str(var_dir or self.root / "template" / "var"),
            "CROWDTRAIN_TICKET_KEY": secrets.token_hex(32), "CROWDTRAIN_DEBUG": "false",
            "CROWDTRAIN_LEASE_TARGET_S": str(LEASE_TARGET_S),
        }  # fmt: skip
        if database_url is not None:
            env.update({"DATABASE_URL": database_url, "REDIS_URL": self.options.redis_url})
        return env

    def run(self, plan: PhasePlan) -> PhaseRun:
        """One phase on a fresh site; raises PhaseSkipped with the reason when it cannot run or finish."""
        opts = self.options
        needed = plan.agents + opts.upload_connections + 256
        if needed > opts.nofile:
            raise PhaseSkipped(f"{plan.agents} agents need about {needed} open files, the limit is {opts.nofile}")
        if plan.agents > len(self.tokens):
            raise PhaseSkipped(f"only {len(self.tokens)} devices were seeded")
        deadline = time.monotonic() + opts.phase_limit_s
        run_dir = self.root / plan.name
        shutil.rmtree(run_dir, ignore_errors=True)
        if opts.embedded:
            database = None
            (run_dir / "var").mkdir(parents=True)
            copy_sqlite(self.root / "template" / "var" / SQLITE_FILE, run_dir / "var" / SQLITE_FILE)
        else:
            database = opts.database_url
            recreate_database(database, database_name(database), template=database_name(database) + "_tpl")
            flush_redis(opts.redis_url)
        with Swarm(run_dir, env=self._env(database, run_dir / "var")) as swarm:
            try:
                return self._run_in(swarm, run_dir, plan, deadline)
            except LaunchError as exc:
                first_line = str(exc).splitlines()[0]
                raise PhaseSkipped(f"a process failed: {first_line}; logs in {run_dir / 'logs'}") from None

    def _run_in(self, swarm: Swarm, run_dir: Path, plan: PhasePlan, deadline: float) -> PhaseRun:
        opts = self.options
        # the site: two daphne processes (--sites), one worker (with the first), an aggregator for leasing phases
        campaign_id = None
        seed: dict[str, Any] = {}
        if plan.mode == "cycle":
            target = MICROBATCH * (plan.leases_per_step or WIDE_LEASES_PER_AGENT * plan.agents)
            spec_path = run_dir / "spec.json"
            spec_path.write_text(json.dumps(campaign_spec(self.npz, target)))
            seed = json.loads(swarm.manage("seed_run", "--spec", str(spec_path), timeout_s=120))
            campaign_id = seed["campaigns"][0]
        sites = [swarm.start_site(name="site-1", cpus=plan.site_cpus)]
        if not opts.embedded:  # the embedded default's channel layer is in-process: one site process only
            for k in range(2, opts.sites + 1):
                sites.append(swarm.start_site(name=f"site-{k}", cpus=plan.site_cpus, worker=False))
            for k in range(1, opts.committers + 1):
                swarm.start_committer(name=f"committer-{k}", cpus=plan.site_cpus)
        if plan.mode == "cycle":
            aggregator = swarm.start_aggregator(sites[0], token=seed["aggregators"]["agg-1"], name="agg-1")
            swarm.wait_until(
                lambda: get_json(f"{aggregator}/healthz")["slices"], 60, "the aggregator to hold its slice"
            )
            time.sleep(0.5)  # its slice_ready reaches the site right after

        # the load: agents split over a few load-generator processes, and those over both site processes
        procs = max(1, min(opts.loadgen_procs, plan.agents))
        tokens = self.tokens[: plan.agents]
        loadgens: list[tuple[Child, Path]] = []
        for k in range(procs):
            folder = run_dir / f"loadgen-{k}"
            folder.mkdir(parents=True)
            spec = {
                "site_urls": [s.url for s in sites], "tokens": tokens[k::procs], "mode": plan.mode,
                "campaign_id": campaign_id, "connect_rate": plan.connect_rate / procs,
                "connect_timeout_s": plan.agents / plan.connect_rate + 60.0, "period_s": plan.period_s,
                "samples_per_s": MICROBATCH / LEASE_TARGET_S,
                "upload_connections": max(1, opts.upload_connections // procs), "drain_s": plan.drain_s,
                "go_timeout_s": opts.phase_limit_s,
            }  # fmt: skip
            write_json(folder / "spec.json", spec)
            argv = [swarm.python, "-m", "tests.benchmarks.loadgen", "--spec", str(folder / "spec.json")]
            child = swarm.start(f"loadgen-{k}", argv, role="agent", expected_exit=True)
            loadgens.append((child, folder))

        ready = [_wait_file(folder / "ready.json", child, deadline, swarm) for child, folder in loadgens]
        connected = sum(r["connected"] for r in ready)
        logger.info("%s: %d of %d agents connected in %.1f s", plan.name, connected, plan.agents,
                    max(r["connect_s"] for r in ready))  # fmt: skip

        # the window: every load generator starts together; CPU is read at its two ends
        start = time.time() + 0.5
        warmup = (opts.warmup_s if plan.warmup_s is None else plan.warmup_s) if plan.mode == "cycle" else 1.0
        window = (start + warmup, start + warmup + plan.window_s)
        if window[1] + plan.drain_s + 30 > time.time() + (deadline - time.monotonic()):
            raise PhaseSkipped(f"no time left for the {plan.window_s:.0f} s window within --phase-limit-s")
        for _, folder in loadgens:
            write_json(folder / "go.json", {"start": start, "measure_from": window[0], "measure_to": window[1]})
        roles = {
            # A committer's step writes are site work moved out of the daphne processes: counted with them.
            "site": [c.pid for c in swarm.children if c.name.startswith(("site-", "committer-"))],
            "worker": [c.pid for c in swarm.children if c.name == "worker"],
            "aggregator": [c.pid for c in swarm.children if c.role == "aggregator"],
            "loadgen": [c.pid for c, _ in loadgens],
        }
        _sleep_until(window[0])
        first = sample_cpu(roles)
        _sleep_until(window[1])
        last = sample_cpu(roles)
        cpu_s, foreign = cpu_between(first, last)

        results = [_wait_file(folder / "result.json", child, deadline, swarm) for child, folder in loadgens]
        load = merge_results(results)
        run = PhaseRun(plan.name, plan.agents, plan.window_s, load, cpu_s, last.at - first.at, foreign, plan.period_s,
                       procs)  # fmt: skip
        where = str(run_dir / "var" / SQLITE_FILE) if opts.embedded else opts.database_url
        if plan.mode == "cycle":
            run.step_publish = step_publish_times(where)
            run.verification = verification_counts(where, *window)
        if plan.lost_check:
            # The site writes lease records in batches behind the acks (``scheduler.records``), and a
            # saturated one lags: seen on SQLite, 45 leases acked as accepted still read "active" when
            # the load ended, and "accepted" once written. A lease lost stays lost past the wait.
            settled = time.monotonic() + RECORDS_SETTLE_S
            while True:
                run.db_leases, states = lease_states(where, load["reported"])
                run.lost = len(lost_leases(load["reported"], states))
                if not run.lost or time.monotonic() > settled:
                    break
                time.sleep(1.0)
        _log_phase(run)
        return run


def merge_results(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One load generator's counts from several processes' result.json: sums, concatenations and maxima."""
    merged: dict[str, Any] = {}
    for result in results:
        for name, value in result.items():
            if name in ("window", "nofile_limit", "pid"):
                merged[name] = value
            elif isinstance(value, list):
                merged.setdefault(name, []).extend(value)
            elif isinstance(value, dict):
                merged.setdefault(name, Counter()).update(value)
            elif name.endswith("_max_ms") or name == "rss_mb":
                merged[name] = max(merged.get(name, 0.0), value)
            else:
                merged[name] = merged.get(name, 0) + value
    return merged


def _log_phase(run: PhaseRun) -> None:
    load = run.load
    cores = {role: round(seconds / run.cpu_window_s, 2) for role, seconds in run.cpu_s.items()}
    logger.warning(
        "phase %s: %d agents, %d connected (%d reconnects, %d disconnects, fatal %s); window %.1f s: %d cycles "
        "(%d in all), %d lease requests unanswered, no_lease %s, lease errors %s, uploads failed %s, "
        "done rejected %s, done unconfirmed %d, future-version retries %d; CPU in cores %s, other processes %.2f; "
        "load generator loop lag max %.0f ms, RSS %.0f MB; leases in the database %s",
        run.name, run.agents, load["connected"], load["reconnects"], load["disconnects"], dict(load["fatal"]),
        run.window_s, load["cycles"], load["cycles_total"], load["lease_unanswered"], dict(load["no_lease"]),
        dict(load["lease_errors"]),
        dict(load["upload_failed"]), dict(load["done_rejected"]), load["done_unconfirmed"],
        load["future_version_retries"], cores, run.foreign_cores, load["loop_lag_max_ms"], load["rss_mb"],
        run.db_leases or "(not read)",
    )  # fmt: skip


def _wait_file(path: Path, child: Child, deadline: float, swarm: Swarm) -> dict[str, Any]:
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if not child.alive():
            if path.exists():
                return json.loads(path.read_text())
            raise PhaseSkipped(f"{child.name} exited with code {child.popen.returncode}; see {child.log_path}")
        swarm.check()
        time.sleep(0.1)
    raise PhaseSkipped(f"no {path.name} from {child.name} within --phase-limit-s; see {child.log_path}")


def _sleep_until(wall: float) -> None:
    delay = wall - time.time()
    if delay > 0:
        time.sleep(delay)


# ------------------------------------------------------------------ figures


def cycle_figures(run: PhaseRun | str, agents: int, infix: str) -> list[str]:
    """A leasing phase's cycles/s, p99 lease latency, site CPU per lease, rejected reports and missing agents."""
    names = [f"lease_cycles_per_s{infix}_{agents}", f"lease_p99_ms{infix}_{agents}",
             f"site_cpu_ms_per_lease{infix}_{agents}", f"serving_cpu_ms_per_cycle{infix}_{agents}",
             f"done_rejected{infix}_{agents}", f"agents_not_connected{infix}_{agents}",
             f"step_publish_s{infix}_{agents}", f"verification_per_cycle{infix}_{agents}"]  # fmt: skip
    if isinstance(run, str):
        return [skipped_line(name, run) for name in names]
    load = run.load
    offered = f"{agents} agents offer {agents / run.period_s:g}/s" if run.period_s > 0 else ""
    note = "; ".join(filter(None, [offered, run.caveat()]))
    rejected = sum(load["done_rejected"].values()) + load["done_unconfirmed"]
    reasons = ", ".join(f"{reason}: {n}" for reason, n in load["done_rejected"].most_common())
    if load["done_unconfirmed"]:
        reasons = ", ".join(filter(None, [reasons, f"no answer: {load['done_unconfirmed']}"]))
    lines = [figure_line(names[0], run.cycles_per_s, note)]
    note = run.caveat()
    if load["lease_ms"]:
        unanswered = f"{load['lease_unanswered']} requests still unanswered after the drain count at their age"
        lease_note = "; ".join(filter(None, [unanswered if load["lease_unanswered"] else "", note]))
        lines.append(figure_line(names[1], percentile(load["lease_ms"], 99), lease_note))
    else:
        lines.append(
            skipped_line(
                names[1],
                f"no lease request sent in the window was answered; "
                f"{load['lease_outstanding']} requests still waited after the drain",
            )
        )
    if load["cycles"]:
        worker = f"the Celery worker, which judges checks, used {run.worker_cpu_ms_per_lease:.3f} ms more"
        lines.append(figure_line(names[2], run.site_cpu_ms_per_lease, worker))
        cores = f"= cores it takes per 1,000 cycles/s; this machine has {os.cpu_count()}, load generator included"
        lines.append(figure_line(names[3], run.serving_cpu_ms_per_cycle, cores))
    else:
        lines.extend(skipped_line(name, "no cycle completed in the window") for name in names[2:4])
    lines.append(f"bench: {names[4]}={rejected}" + (f" ({reasons})" if reasons else ""))
    lines.append(not_connected_line(f"agents_not_connected{infix}_{agents}", load))
    lines.append(step_publish_line(names[6], run.step_publish))
    lines.append(verification_line(names[7], run.verification, load["cycles"]))
    return lines


def verification_line(name: str, counts: tuple[int, int] | None, cycles: int) -> str:
    """Checks opened and copies reported per cycle of the window: verification's share of the site's work."""
    if counts is None:
        return skipped_line(name, "the phase's database was not read")
    if not cycles:
        return skipped_line(name, "no cycle completed in the window")
    opened, reported = counts
    note = (f"{opened} checks opened and {reported} copies reported over {cycles} cycles; every bench volunteer "
            f"is a newcomer, checked at 4 x the campaign's rate until their first checks pass")  # fmt: skip
    return figure_line(name, (opened + reported) / cycles, note)


def step_publish_line(name: str, steps: list[tuple[int, float]]) -> str:
    """The median commit pipeline of the phase's steps (write, aggregators, version), with its worst and size."""
    if not steps:
        return skipped_line(name, "no step was applied")
    seconds = [s for _, s in steps]
    leases = sorted(n for n, _ in steps)[len(steps) // 2]
    return figure_line(
        name,
        percentile(seconds, 50),
        f"median of {len(steps)} steps of about {leases} leases, worst {max(seconds):.2f} s: from the start of a "
        "step's commit to its version published; the step after next waits on it",
    )


def not_connected_line(name: str, load: dict[str, Any]) -> str:
    """How many agents never got a welcome, and which of them gave up for good (and on which close code)."""
    missing = load["agents"] - load["connected"]
    fatal = ", ".join(f"{n} stopped on {why}" for why, n in load["fatal"].most_common())
    return f"bench: {name}={missing}" + (f" ({fatal})" if fatal else "")


def run_all(bench: Bench) -> list[str]:
    """Every phase the options ask for, in order; returns the ``bench:`` lines (also printed as they come)."""
    opts = bench.options
    lines: list[str] = []

    def emit(new: Iterable[str]) -> None:
        for line in new:
            print(line, flush=True)
            lines.append(line)

    def attempt(plan: PhasePlan) -> PhaseRun | str:
        logger.warning("phase %s: %d agents ...", plan.name, plan.agents)
        try:
            return bench.run(plan)
        except PhaseSkipped as exc:
            logger.warning("phase %s skipped: %s", plan.name, exc)
            return str(exc)

    common = {"window_s": opts.window_s, "connect_rate": opts.connect_rate, "period_s": opts.period_s}
    cpu_per_lease: dict[int, float] = {}
    for n in opts.agents if "wide" in opts.phases else []:
        emit(cycle_figures(attempt(PhasePlan(f"wide-{n}", n, "cycle", **common)), n, opts.tag))
    for n in opts.cpu_agents if "wide" in opts.phases else []:
        # The same offered rate and step for every N: what changes with N is only the swarm's size.
        # Each agent cycles once a period, so the window starts after every agent's first cycle, whose
        # report reads the volunteer's record once per process (a cost of joining, not of a lease).
        period = n / opts.cpu_rate
        steps = round(WIDE_LEASES_PER_AGENT * opts.cpu_rate)
        even = {**common, "period_s": period, "warmup_s": period + opts.warmup_s}
        run = attempt(PhasePlan(f"even-{n}", n, "cycle", leases_per_step=steps, **even))
        emit(cycle_figures(run, n, f"{opts.tag}_even"))
        if isinstance(run, PhaseRun) and run.load["cycles"]:
            cpu_per_lease[n] = run.site_cpu_ms_per_lease
    if "wide" in opts.phases:
        sizes = f"over N = {', '.join(map(str, sorted(cpu_per_lease)))} offering {opts.cpu_rate:g} cycles/s together"
        if len(cpu_per_lease) >= 2:
            centre = (max(cpu_per_lease.values()) + min(cpu_per_lease.values())) / 2
            emit([figure_line(f"site_cpu_ms_per_lease{opts.tag}_spread_pct", spread_pct(cpu_per_lease.values()),
                              f"largest over smallest, {sizes}"),
                  figure_line(f"site_cpu_ms_per_lease{opts.tag}_band_pct", band_pct(cpu_per_lease.values()),
                              f"every size within this many percent of {centre:.3f} ms, {sizes}")])  # fmt: skip
        else:
            emit([skipped_line(f"site_cpu_ms_per_lease{opts.tag}_{what}_pct", "fewer than two sizes measured")
                  for what in ("spread", "band")])  # fmt: skip
    if "w1like" in opts.phases:
        for n in opts.agents:
            run = attempt(PhasePlan(f"w1like-{n}", n, "cycle", leases_per_step=W1_LEASES_PER_STEP, **common))
            emit(cycle_figures(run, n, f"{opts.tag}_w1like"))
    if "idle" in opts.phases:
        n = opts.idle_agents
        run = attempt(PhasePlan(f"idle-{n}", n, "idle", window_s=opts.idle_window_s, connect_rate=opts.join_rate))
        emit(idle_figures(run, n, opts.join_rate, opts.tag))
    if "overload" in opts.phases:
        n = opts.overload_agents
        plan = PhasePlan(f"overload-{n}", n, "cycle", window_s=opts.overload_window_s, connect_rate=opts.connect_rate,
                         period_s=0.0, site_cpus=opts.overload_site_cpus, drain_s=45.0, lost_check=True)  # fmt: skip
        emit(overload_figures(attempt(plan), n, opts.overload_site_cpus, opts.tag))
    return lines


def idle_figures(run: PhaseRun | str, agents: int, join_rate: float, tag: str = "") -> list[str]:
    names = [f"idle_cpu_pct{tag}_per_1000", f"connect_p99_ms{tag}_{agents}", f"agents_not_connected_idle{tag}_{agents}"]
    if isinstance(run, str):
        return [skipped_line(name, run) for name in names]
    load = run.load
    connected = load["connected"]
    lines = []
    if connected:
        pct = 100.0 * run.cpu_s["site"] / run.cpu_window_s / (connected / 1000.0)
        lines.append(figure_line(names[0], pct, f"{connected} agents connected; {run.caveat()}".rstrip("; ")))
    else:
        lines.append(skipped_line(names[0], "no agent connected"))
    # An agent that never got in waited forever: it counts, as infinity, in the percentile.
    times = load["connect_ms"] + [math.inf] * (agents - connected)
    note = f"joining at {join_rate:g}/s"
    if connected < agents:
        note += f"; {agents - connected} never connected"
        if connected:
            note += f", p99 of the {connected} that did {format_value(percentile(load['connect_ms'], 99))} ms"
    lines.append(figure_line(names[1], percentile(times, 99), note))
    lines.append(not_connected_line(names[2], load))
    return lines


def overload_figures(run: PhaseRun | str, agents: int, site_cpus: list[int] | None, tag: str = "") -> list[str]:
    names = [f"overload_lost{tag}", f"overload_cycles_per_s{tag}_{agents}",
             f"agents_not_connected_overload{tag}_{agents}"]  # fmt: skip
    if isinstance(run, str):
        return [skipped_line(name, run) for name in names]
    load = run.load
    rejected = ", ".join(f"{reason}: {n}" for reason, n in load["done_rejected"].most_common())
    note = (f"of {len(load['reported'])} leases uploaded and reported by {agents} agents; done rejected "
            f"{sum(load['done_rejected'].values())}" + (f" ({rejected})" if rejected else "")
            + f", unanswered {load['done_unconfirmed']}"
            + (f"; site on CPU {','.join(map(str, site_cpus))}" if site_cpus else ""))  # fmt: skip
    return [
        f"bench: {names[0]}={run.lost} ({note})",
        figure_line(names[1], run.cycles_per_s, run.caveat()),
        not_connected_line(names[2], load),
    ]


# ------------------------------------------------------------------ main


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated agent counts, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"agent counts must be at least 1, got {text!r}")
    return sizes


PHASES = ("wide", "w1like", "idle", "overload")


def parse_options(argv: Sequence[str] | None) -> tuple[Options, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.scale", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = parser.add_argument
    add("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)} (default: all)")
    add("--backend", choices=("postgres", "sqlite"), default="postgres",
        help="postgres: two site processes on PostgreSQL + Redis with a Celery worker (default); sqlite: the "
             "embedded default, one site process")  # fmt: skip
    add("--sites", type=int, default=2,
        help="daphne processes on PostgreSQL + Redis (default 2; more where there are more cores)")  # fmt: skip
    add("--committers", type=int, default=1,
        help="committer processes writing the steps the sites fill (default 1; 0: the sites write them)")  # fmt: skip
    add("--agents", type=_sizes, default=[100, 1000], help="agents of the wide and w1like phases (default 100,1000)")
    add(
        "--cpu-agents",
        type=_sizes,
        default=[100, 1000, 5000],
        help="agents of the even phases, whose CPU per lease must stay flat across N (default 100,1000,5000)",
    )
    add(
        "--cpu-rate",
        type=float,
        default=150.0,
        help="cycles/s the --cpu-agents agents offer together, below what the site serves (default 150)",
    )
    add("--idle-agents", type=int, default=10_000, help="connected idle agents (default 10000)")
    add("--join-rate", type=float, default=200.0, help="idle agents joining per second (default 200)")
    add("--overload-agents", type=int, default=5000, help="agents against the saturated site (default 5000)")
    add("--overload-site-cpus", default="0", help="CPUs the site gets in the overload phase ('' for all; default 0)")
    add(
        "--period-s",
        type=float,
        default=1.0,
        help="each agent's shortest cycle, 0 for back to back (default 1: N agents offer N cycles/s)",
    )
    add("--warmup-s", type=float, default=5.0, help="cycling before the window (default 5)")
    add("--window-s", type=float, default=20.0, help="measured window of the leasing phases (default 20)")
    add("--idle-window-s", type=float, default=30.0, help="measured window of the idle phase (default 30)")
    add("--overload-window-s", type=float, default=60.0, help="window of the overload phase (default 60)")
    add("--connect-rate", type=float, default=200.0, help="agents joining per second in leasing phases (default 200)")
    add("--upload-connections", type=int, default=64, help="aggregator sockets the agents share (default 64)")
    add("--loadgen-procs", type=int, default=1, help="load-generator processes (default 1)")
    add("--phase-limit-s", type=float, default=300.0, help="a phase still running after this is cut off (default 300)")
    add("--database-url", default=os.environ.get("CROWDTRAIN_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL),
        help="the phases' database, dropped and recreated for each; its name + '_tpl' is the template "
             f"(default $CROWDTRAIN_BENCH_DATABASE_URL or {DEFAULT_DATABASE_URL})")  # fmt: skip
    add(
        "--redis-url",
        default=os.environ.get("CROWDTRAIN_BENCH_REDIS_URL", DEFAULT_REDIS_URL),
        help=f"emptied before each phase (default $CROWDTRAIN_BENCH_REDIS_URL or {DEFAULT_REDIS_URL})",
    )
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; choose from {', '.join(PHASES)}")
    cpus = [int(c) for c in args.overload_site_cpus.split(",") if c.strip()] or None
    options = Options(
        root=REPO_ROOT / "var" / "bench" / "scale", database_url=args.database_url, redis_url=args.redis_url,
        agents=args.agents, cpu_agents=args.cpu_agents, idle_agents=args.idle_agents, join_rate=args.join_rate,
        overload_agents=args.overload_agents, overload_site_cpus=cpus, phases=phases, period_s=args.period_s,
        warmup_s=args.warmup_s, window_s=args.window_s, idle_window_s=args.idle_window_s,
        overload_window_s=args.overload_window_s, connect_rate=args.connect_rate,
        upload_connections=args.upload_connections, loadgen_procs=args.loadgen_procs,
        phase_limit_s=args.phase_limit_s, nofile=0, backend=args.backend, sites=max(1, args.sites),
        committers=max(0, args.committers), cpu_rate=args.cpu_rate,
    )  # fmt: skip
    return options, args


def main(argv: Sequence[str] | None = None) -> int:
    options, _ = parse_options(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before any child starts: daphne, the worker and the load generators inherit the raised limit.
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = raise_open_files_limit()
    print(f"bench: open_files_limit={soft} (RLIMIT_NOFILE soft limit raised from {before[0]} to the hard limit "
          f"{hard} with setrlimit before starting the site and the load generators, which inherit it)",
          flush=True)  # fmt: skip
    if options.embedded:
        print("bench: backend=sqlite (the embedded default: one site process on SQLite, in-process channel layer "
              "and scheduler state, no Celery worker)", flush=True)  # fmt: skip
        options = Options(**{**options.__dict__, "nofile": soft})
    else:
        from tests.services import ensure_postgres, ensure_redis

        # A private PostgreSQL or Redis (none answering here) comes back under its own URL: keep our names in it.
        server = ensure_postgres(options.database_url)
        database_url = with_database(server, database_name(options.database_url))
        redis_url = ensure_redis(options.redis_url)
        redis_url = urlunsplit(urlsplit(redis_url)._replace(path=urlsplit(options.redis_url).path))
        options = Options(**{**options.__dict__, "database_url": database_url, "redis_url": redis_url, "nofile": soft})
    if options.embedded:
        options = Options(**{**options.__dict__, "root": options.root.with_name("scale-sqlite")})
    bench = Bench(options)
    wanted = {
        "wide": [*options.agents, *options.cpu_agents],
        "w1like": options.agents,
        "idle": [options.idle_agents],
        "overload": [options.overload_agents],
    }
    bench.prepare(max(n for phase in options.phases for n in wanted[phase]))
    run_all(bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
