"""Benchmark: W1 with one agent behind a home link (20 Mbit/s up, 100 down), in sync fp32, sync int8 and local int8.

    python -m tests.benchmarks.homelink                      # or: make bench (as root)
    python -m tests.benchmarks.homelink --w1-samples 65536 --local-samples 16384 --gpt-samples 2048   # a quicker look

The whole phase (site, aggregator, agent, the plain-PyTorch baseline) runs in
a private network namespace: this command re-runs itself under ``unshare -n``
(root only, as in CI), sets the namespace's loopback MTU to a real path's 1500
and puts HTB classes on it that hold the agent's traffic to the link's rates
(``tests.benchmarks.shaping``; no added delay: this kernel has no netem). A
bulk transfer checks the link first, and its rates are printed too.

Three W1 runs, each a fresh site + aggregator (core 1) and one one-thread
agent (core 0), each over the same ``--w1-samples``, with W1's own settings
(``tests.benchmarks.w1``) except the codec and, for ``local_int8``, local
steps (``W1_LOCAL``). Prints ``bench: NAME=VALUE`` lines, all from one run:

- ``home_link_up_Mbps``, ``home_link_down_Mbps``: payload rates of the link check.
- ``home_link_baseline_samples_per_s``: plain PyTorch, one thread on core 0,
  the best of a measurement before and after the W1 runs.
- ``home_link_samples_per_s_RUN`` and ``home_link_efficiency_RUN`` (that over
  the baseline; ``unstable`` when the two baseline measurements disagree by
  over 10 %), as ``agent_efficiency`` in w1: steady state after
  ``--warmup-samples``, from the site's commit times.
- ``bytes_up_per_sample_RUN``, ``bytes_down_per_sample_RUN``: what crossed
  the agent's link per committed sample, counted by the kernel on the wire
  (TCP/IP headers and ACKs included, as a home router would count them),
  between the commit that ends the warm-up and the last-but-one commit (the
  site fetches the final parameters for validation over the same address).
- ``int8_loss_gap``, ``local_loss_gap``: held-out loss of ``sync_int8`` and
  ``local_int8`` over that of ``sync_fp32``, minus one, after the same number
  of samples (positive: worse). The site computes it at the campaign's finish
  over 4,096 held-out W1 rows.
- ``int8_loss_gap_gpt``, ``local_loss_gap_gpt``: the same on the demo's GPT
  (``crowdtrain.campaigns.demo``: 4 layers, 128 wide, 64-byte context, on the
  Python standard library), over ``--gpt-samples`` (8,192 by default: 32 steps
  of 256 in sync mode, 4 outer steps of 2,048 in local mode; the line says
  so), with its agent on the unshaped address: only the loss is compared.

A run whose campaign cannot be created (a field this site does not know
yet) prints ``skipped (campaign not created: ...)`` for its lines, a run that
breaks ``failed (...)`` (and the command exits 1); without a namespace (not
root, no ``unshare``, no HTB) every line says ``skipped`` with the reason.
Runs live in ``var/bench/homelink/`` (wiped at start; logs stay for a look).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
for _folder in (
    REPO_ROOT / "platform",
    REPO_ROOT / "agent" / "src",
    REPO_ROOT / "deploy" / "launcher",
):  # as manage.py does
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import numpy as np  # noqa: E402

from crowdtrain_launcher import LaunchError, Site, Swarm, get_json  # noqa: E402

from .baseline import W1, make_data, measure_in_process  # noqa: E402
from .figures import BaselinePair, figure_line  # noqa: E402
from .homelink_figures import (  # noqa: E402
    MODES,
    Mode,
    NoResult,
    Outcome,
    RunResult,
    figure_lines,
    link_figures,
    loss_curve,
    loss_curves_svg,
    refusal_reason,
    skipped_lines,
    warmup_steps,
)
from .shaping import (  # noqa: E402
    AGENT_HOST,
    SERVER_HOST,
    HomeLink,
    ShapingError,
    apply_shaping,
    link_problem,
    measure_link,
    read_link_bytes,
)
from .w1 import campaign_spec, steady_rate  # noqa: E402

logger = logging.getLogger("tests.benchmarks.homelink")

UNSHARE = ("unshare", "--net")
AGENT_CPUS, SERVER_CPUS = [0], [1]
W1_ROWS = 131072  # 128 MiB of features, at least: more when a run trains on more samples
W1_HELD_OUT_FRACTION = 1 / 32  # the last 1/32 of the rows (4,096 of the default 131,072) are held out
W1_VALIDATION_SAMPLES = 4096
# crowdtrain.campaigns.demo's campaign, restated: that module needs Django set up, and this one runs before
# (tests/bench_support checks that the two agree).
GPT_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}
GPT_CORPUS_BYTES = 4 << 20
GPT_LR, GPT_BATCH, GPT_MICROBATCH, GPT_SEED = 3e-3, 256, 16, 1234
GPT_HELD_OUT_FRACTION = 0.02  # ~1,290 held-out samples of 65 bytes; the site evaluates 1,024 of them


@dataclass(frozen=True)
class LocalSteps:
    """The settings of a campaign in local mode (DiLoCo): each lease trains ``samples // microbatch`` inner steps.

    ``outer`` becomes the campaign's ``optimizer``: the aggregator applies it to
    the sample-weighted mean of the leases' pseudo-gradients (base minus trained
    parameters). ``samples`` is the campaign's target batch, so with one agent
    a lease is an outer step.
    """

    samples: int
    inner: dict[str, Any]
    outer: dict[str, Any]
    inner_batch: int | None = None  # samples per inner step; None: one microbatch


# DiLoCo's outer optimizer as published (Douillard et al., 2023, with H = 500 there): SGD with Nesterov momentum
# 0.9 at lr 0.7. It treats the averaged pseudo-gradient like a gradient whose natural step size is one; a slightly
# shorter step plus momentum is what made the outer loop beat plain averaging (lr 1, no momentum) in that paper.
DILOCO_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
# W1 in local mode. Inner AdamW at sync W1's own lr 1e-3, on inner batches of 256 samples (4 microbatches of 64
# whose gradients add up). One inner step per microbatch of 64 cost the agent's core 0.30 of its time: AdamW's
# update of 1.3M parameters takes 5.5 ms next to a microbatch's 6.6 ms of forward and backward. Inner batches
# of 1,024 (sync W1's own step) were as fast on the link but ended 27% above sync fp32's held-out loss after 4
# rounds; batches of 256 ended 20% below it (both measured over 262,144 samples).
# 65,536 samples per outer step (H = 256, about 7 s of one core): what the round costs besides compute, an int8
# upload (~1.3 MB, ~0.55 s at 20 Mbit/s), the wait for the outer step and the delta download (~4.3 MB, ~0.9 s
# with the link also carrying the next shards), is then small next to it. The shards (W1's input is 1 KiB per
# sample, ~64 MiB a round) are fetched ahead while the round computes.
W1_LOCAL = LocalSteps(65536, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0}, DILOCO_OUTER, 4 * W1.microbatch)
# The GPT in local mode: inner AdamW at 1e-3, below the demo's 3e-3 because an inner step sees one microbatch
# of 16 sequences instead of the demo's 256-sample step; 2,048 samples per outer step (H = 128).
GPT_LOCAL = LocalSteps(2048, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0}, DILOCO_OUTER)


class CampaignRefused(RuntimeError):
    """``seed_run`` would not create the run's campaign (a field this site does not know); the message says why."""


# ------------------------------------------------------------------ campaigns


def w1_rows(samples: int) -> int:
    """Rows enough that a run of ``samples`` never wraps its epoch: a wrapped epoch reads shards the agent
    has on disk already, and its figures would count downloads that a fresh volunteer makes as free."""
    rows = W1_ROWS
    while rows * (1 - W1_HELD_OUT_FRACTION) < samples:
        rows *= 2
    return rows


def write_w1_npz(path: Path, rows: int = W1_ROWS) -> None:
    x, y = make_data(W1, rows, seed=0)
    with path.open("wb") as fh:
        np.savez(fh, x=x, y=y)


def local_fields(local: LocalSteps) -> dict[str, Any]:
    return {
        "training_mode": "local",
        "inner_optimizer": local.inner["name"],
        "inner_lr": local.inner["lr"],
        "inner_weight_decay": local.inner["weight_decay"],
        "inner_batch_size": local.inner_batch,
        "optimizer": local.outer,
        "target_batch_size": local.samples,
        "check_fraction": 0.0,  # a local lease cannot be verified by a copy (its inner state is the agent's own)
        "staleness": 1,  # overlapped rounds: the next round trains while the last one is uploaded and published
    }


def w1_campaign(npz: Path, mode: Mode, samples: int, local: LocalSteps = W1_LOCAL) -> dict[str, Any]:
    """W1 exactly as w1 runs it, with ``mode``'s codec and training mode, stopping after ``samples``."""
    spec: dict[str, Any] = campaign_spec(npz, samples // W1.global_batch, agents=1)["campaigns"][0]
    spec["name"] = f"W1 {mode.name}"
    spec["codec"] = mode.codec
    spec["dataset"] = {**spec["dataset"], "validation_fraction": W1_HELD_OUT_FRACTION}
    if mode.training_mode == "local":
        spec.update(local_fields(local), max_steps=samples // local.samples)
    return spec


def gpt_campaign(mode: Mode, samples: int) -> dict[str, Any]:
    """The demo's GPT campaign with a held-out split, ``mode``'s codec and training mode, stopping after ``samples``."""
    spec: dict[str, Any] = {
        "name": f"GPT {mode.name}",
        "architecture": "gpt",
        "model_config": GPT_MODEL,
        "optimizer": {"name": "adamw", "lr": GPT_LR, "weight_decay": 0.0},
        "dataset": {
            "kind": "stdlib",
            "name": "python-stdlib",
            "bytes": GPT_CORPUS_BYTES,
            "sample_len": GPT_MODEL["block_size"] + 1,
            "shard_bytes": 1 << 20,
            "validation_fraction": GPT_HELD_OUT_FRACTION,
        },
        "target_batch_size": GPT_BATCH,
        "microbatch_size": GPT_MICROBATCH,
        "codec": mode.codec,
        "staleness": 1,
        "max_steps": samples // GPT_BATCH,
        "checkpoint_every": 1000,
        "validate_every": 0,  # only at the finish: the losses compared are the final version's
        "seed": GPT_SEED,
    }
    if mode.training_mode == "local":
        spec.update(local_fields(GPT_LOCAL), max_steps=samples // GPT_LOCAL.samples)
    return spec


# ------------------------------------------------------------------ one run


@dataclass
class RunSetup:
    """Where and how one campaign runs."""

    run_dir: Path
    campaign: dict[str, Any]
    shaped: bool  # the agent on the shaped address (and figures of rate and bytes) or on the plain one
    warmup: int = 1  # steps left out of the steady-state figures
    validation_samples: int = 1024
    timeout_s: float = 600.0
    site_env: dict[str, str] = field(default_factory=dict)


def run_campaign(setup: RunSetup) -> RunResult:
    """A fresh site + aggregator on core 1, one one-thread agent on core 0, until the campaign's final loss.

    Raises:
        CampaignRefused: if ``seed_run`` does not create the campaign.
        LaunchError, RuntimeError: if a process dies or the run does not finish in time.
    """
    steps = int(setup.campaign["max_steps"])
    agent_host = AGENT_HOST if setup.shaped else SERVER_HOST
    env = {
        "CROWDTRAIN_VAR_DIR": str(setup.run_dir / "var"),
        "CROWDTRAIN_TICKET_KEY": secrets.token_hex(32),
        "CROWDTRAIN_DEBUG": "false",
        # The agent asks for the site by its own address: the site must accept that Host.
        "CROWDTRAIN_ALLOWED_HOSTS": f"{SERVER_HOST},{AGENT_HOST},localhost",
        "CROWDTRAIN_VALIDATION_SAMPLES": str(setup.validation_samples),
        **setup.site_env,
    }
    with Swarm(setup.run_dir, env=env) as swarm:
        spec_path = setup.run_dir / "spec.json"
        spec_path.write_text(json.dumps({"campaigns": [setup.campaign], "aggregators": ["agg-1"], "agents": ["home"]}))
        try:
            seed = json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec_path), timeout_s=300))
        except LaunchError as exc:
            logger.warning("seed_run refused the campaign of %s: %s", setup.run_dir.name, exc)
            raise CampaignRefused(refusal_reason(str(exc))) from None
        campaign_id = seed["campaigns"][0]

        # The site listens on every loopback address; the aggregator reaches it at 127.0.0.1 (unshaped), the
        # agent at its own address. The aggregator binds and advertises the agent's address: the agent's
        # uploads and parameter downloads cross the link, the site's connection to it does not.
        site = swarm.start_site(host="0.0.0.0", cpus=SERVER_CPUS)  # noqa: S104 (a private namespace)
        server_site = Site(f"http://{SERVER_HOST}:{site.port}", site.child)
        aggregator = swarm.start_aggregator(
            server_site, token=seed["aggregators"]["agg-1"], name="agg-1", cpus=SERVER_CPUS, host=agent_host
        )
        swarm.wait_until(lambda: get_json(f"{aggregator}/healthz")["slices"], 60, "the aggregator to hold its slice")
        time.sleep(0.5)  # its slice_ready reaches the site right after

        series = [read_link_bytes()] if setup.shaped else []
        swarm.start_agent(
            Site(f"http://{agent_host}:{site.port}", site.child),
            token=seed["agents"]["home"],
            name="agent-home",
            threads=1,
            campaign_id=campaign_id,
            cpus=AGENT_CPUS,
        )
        progress_url = f"{server_site.url}/api/campaigns/{campaign_id}/progress"

        # Counters every quarter second: the byte window's ends are interpolated between them.
        def finished() -> bool:
            progress = get_json(progress_url)
            if setup.shaped:
                series.append(read_link_bytes())
            return progress["version"] >= steps and any(v["version"] >= steps for v in progress["val_loss"])

        swarm.wait_until(finished, setup.timeout_s, f"{steps} steps and the final validation loss", 0.25)
        progress = get_json(progress_url)
        dump = json.loads(swarm.manage("dump_run", "--campaign", str(campaign_id)))

    committed = dump["steps"][:steps]
    val_loss = next(v["loss"] for v in progress["val_loss"] if v["version"] >= steps)
    result = RunResult(
        samples=sum(s["num_samples"] for s in committed), val_loss=float(val_loss), curve=loss_curve(committed)
    )
    if not setup.shaped:
        return result
    up, down = link_figures(committed, series, setup.warmup)
    return RunResult(
        samples=result.samples,
        val_loss=result.val_loss,
        samples_per_s=steady_rate(committed, setup.warmup),
        bytes_up_per_sample=up,
        bytes_down_per_sample=down,
        curve=result.curve,
    )


def attempt(what: str, run: Callable[[int], RunResult], retries: int) -> Outcome:
    """``run(attempt)``, again up to ``retries`` times while it breaks; or why it gave nothing.

    A refused campaign is skipped at once (it would be refused again). A run
    that breaks is repeated in a fresh folder: on a shared machine another
    session's clean-up may signal our daphne (this happened), and one lost run
    should not cost the phase's figures. Each failure is logged with its traceback.
    """
    outcome: Outcome = NoResult("failed", "not run")
    for attempt_no in range(retries + 1):
        outcome = _attempt_once(what if not attempt_no else f"{what}, again ({attempt_no} of {retries})",
                                functools.partial(run, attempt_no))  # fmt: skip
        if not (isinstance(outcome, NoResult) and outcome.verdict == "failed"):
            break
    return outcome


def _attempt_once(what: str, run: Callable[[], RunResult]) -> Outcome:
    logger.info("home link: %s", what)
    started = time.monotonic()
    try:
        result = run()
    except CampaignRefused as exc:
        logger.warning("home link: %s skipped: campaign not created: %s", what, exc)
        return NoResult("skipped", f"campaign not created: {exc}")
    except (LaunchError, RuntimeError, OSError, ValueError, KeyError) as exc:
        logger.error("home link: %s failed", what, exc_info=True)
        return NoResult("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    shown = dataclasses.replace(result, curve=result.curve[-1:])  # the last point; the picture has them all
    logger.info("home link: %s done in %.0f s: %s", what, time.monotonic() - started, shown)
    return result


def _run_attempt(setup: RunSetup, attempt_no: int) -> RunResult:
    """A repeated run gets a folder of its own, so the broken attempt's logs stay for a look."""
    if attempt_no:
        setup = dataclasses.replace(setup, run_dir=setup.run_dir.with_name(f"{setup.run_dir.name}-repeat-{attempt_no}"))
    return run_campaign(setup)


# ------------------------------------------------------------------ the phase


def namespace_problem(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str | None:
    """Why no private network namespace can be made here, or None when ``unshare`` works."""
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install util-linux iproute2)"
    try:
        result = run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`{' '.join(UNSHARE)} true` could not run: {exc}"
    if result.returncode != 0:
        said = (result.stderr or "").strip().replace("\n", " ") or f"exit code {result.returncode}"
        hint = "; it needs root (CI runs as root)" if os.geteuid() != 0 else ""
        return f"no network namespace: `{' '.join(UNSHARE)}` said: {said}{hint}"
    return None


def outside(argv: Sequence[str], run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> int:
    """Re-run this benchmark in a new network namespace, or print every line as skipped when none can be made."""
    problem = namespace_problem(run)
    if problem is not None:
        for line in skipped_lines(problem):
            print(line, flush=True)
        return 0
    command = [*UNSHARE, sys.executable, "-m", "tests.benchmarks.homelink", "--inside", *argv]
    with subprocess.Popen(command, cwd=REPO_ROOT) as child:  # unshare execs python: the child is the run itself
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                # The run got the same Ctrl-C and stops its site, aggregator and agent in order: wait for that
                # instead of killing it, which would leave them to PDEATHSIG.
                continue


def inside(args: argparse.Namespace) -> int:
    """In the namespace: shape the link, check it, then the W1 runs between two baselines, then the GPT runs."""
    link = HomeLink(up_mbit=args.up_mbit, down_mbit=args.down_mbit)
    try:
        apply_shaping(link)
    except ShapingError as exc:
        for line in skipped_lines(f"no shaped link: {exc}"):
            print(line, flush=True)
        return 0
    rates = measure_link(link)
    problem = link_problem(rates, link)
    if problem is not None:
        lines = [figure_line("home_link_up_Mbps", rates.up_mbit), figure_line("home_link_down_Mbps", rates.down_mbit)]
        lines += skipped_lines(problem)[2:]
        for line in lines:
            print(line, flush=True)
        return 1

    root = REPO_ROOT / "var" / "bench" / "homelink"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    npz = root / "w1.npz"
    write_w1_npz(npz, w1_rows(args.w1_samples))
    site_env = dict(item.split("=", 1) for item in args.site_env if "=" in item)

    # This process polls the site while the agent works: it stays off the agent's core, with the servers.
    os.sched_setaffinity(0, set(SERVER_CPUS))

    def baseline() -> float:
        return measure_in_process(threads=1, cpus=AGENT_CPUS, seconds=args.baseline_seconds)

    local = dataclasses.replace(W1_LOCAL, samples=args.local_samples, inner_batch=args.inner_batch)
    not_asked = NoResult("skipped", f"--runs {','.join(args.runs)}")
    before = baseline()
    w1: dict[str, Outcome] = {mode.name: not_asked for mode in MODES}
    for mode in (m for m in MODES if m.name in args.runs):
        batch = local.samples if mode.training_mode == "local" else W1.global_batch
        setup = RunSetup(
            root / f"w1-{mode.name}",
            w1_campaign(npz, mode, args.w1_samples, local),
            shaped=True,
            warmup=warmup_steps(args.warmup_samples, batch),
            validation_samples=W1_VALIDATION_SAMPLES,
            timeout_s=args.run_timeout,
            site_env=site_env,
        )
        w1[mode.name] = attempt(
            f"W1 {mode.name}, {args.w1_samples} samples", functools.partial(_run_attempt, setup), args.retries
        )
    base: BaselinePair | NoResult = BaselinePair(before, baseline())
    if any(isinstance(o, RunResult) and o.curve for o in w1.values()):
        picture = root / "loss_curves.svg"
        picture.write_text(loss_curves_svg(w1, f"W1 over the home link, {args.w1_samples:,} samples a run"))
        print(f"home link: the W1 runs' loss curves are drawn in {picture}", flush=True)

    gpt: dict[str, Outcome] = {mode.name: not_asked for mode in MODES}
    for mode in (m for m in MODES if m.name in args.runs) if args.gpt_samples else ():
        setup = RunSetup(
            root / f"gpt-{mode.name}",
            gpt_campaign(mode, args.gpt_samples),
            shaped=False,
            timeout_s=args.run_timeout,
            site_env=site_env,
        )
        gpt[mode.name] = attempt(
            f"GPT {mode.name}, {args.gpt_samples} samples", functools.partial(_run_attempt, setup), args.retries
        )
    if not args.gpt_samples:
        gpt = {mode.name: NoResult("skipped", "--gpt-samples 0") for mode in MODES}

    gpt_note = (
        f"demo GPT, {args.gpt_samples} samples: {args.gpt_samples // GPT_BATCH} steps of {GPT_BATCH} sync, "
        f"{args.gpt_samples // GPT_LOCAL.samples} outer step(s) of {GPT_LOCAL.samples} local"
    )
    lines = figure_lines(rates, base, w1, gpt, w1_note="W1", gpt_note=gpt_note)
    for line in lines:
        print(line, flush=True)
    broke = any(isinstance(o, NoResult) and o.verdict == "failed" for o in (*w1.values(), *gpt.values()))
    return 1 if broke else 0


def _multiple_of(unit: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < 0 or value % unit:
            raise argparse.ArgumentTypeError(f"must be a multiple of {unit} (0 allowed where it skips), got {value}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.homelink", description=__doc__.splitlines()[0])
    gpt_unit = math.lcm(GPT_BATCH, GPT_LOCAL.samples)
    p.add_argument(
        "--w1-samples",
        type=int,
        default=4 * W1_LOCAL.samples,
        help=f"samples of each W1 run, a multiple of {W1.global_batch} and of --local-samples "
        f"(default {4 * W1_LOCAL.samples}: the fewest for the local run's steady-state figures)",
    )
    p.add_argument(
        "--local-samples",
        type=_multiple_of(W1.global_batch),
        default=W1_LOCAL.samples,
        help=f"samples per outer step of the W1 local run, a multiple of {W1.global_batch} "
        f"(default {W1_LOCAL.samples}: H = {W1_LOCAL.samples // W1.microbatch})",
    )
    p.add_argument(
        "--inner-batch",
        type=_multiple_of(W1.microbatch),
        default=W1_LOCAL.inner_batch,
        help=f"samples per inner step of the W1 local run, a multiple of {W1.microbatch} "
        f"(default {W1_LOCAL.inner_batch})",
    )
    p.add_argument(
        "--runs",
        type=lambda raw: raw.split(","),
        default=[mode.name for mode in MODES],
        help=f"which runs, comma-separated (default all: {','.join(mode.name for mode in MODES)}); "
        "a loss gap needs its run and sync_fp32",
    )
    p.add_argument(
        "--gpt-samples",
        type=_multiple_of(gpt_unit),
        default=4 * gpt_unit,
        help=f"samples of each GPT run, a multiple of {gpt_unit}; 0 skips them (default {4 * gpt_unit})",
    )
    p.add_argument(
        "--warmup-samples",
        type=int,
        default=8192,
        help="samples left out of the steady-state figures (default 8192; at least one step)",
    )
    p.add_argument("--up-mbit", type=float, default=20.0, help="the link's upload rate (default 20)")
    p.add_argument("--down-mbit", type=float, default=100.0, help="the link's download rate (default 100)")
    p.add_argument("--baseline-seconds", type=float, default=8.0, help="plain PyTorch timing (default 8)")
    p.add_argument("--retries", type=int, default=1, help="runs of a broken run again (default 1)")
    p.add_argument("--run-timeout", type=float, default=1500.0, help="seconds one run may take (default 1500)")
    p.add_argument(
        "--site-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra site setting, e.g. CROWDTRAIN_LEASE_TARGET_S=5 (repeatable)",
    )
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # set by the re-run under unshare
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    unknown = sorted(set(args.runs) - {mode.name for mode in MODES})
    if unknown:
        p.error(f"--runs: no run named {', '.join(unknown)}; choose from {', '.join(mode.name for mode in MODES)}")
    unit = math.lcm(W1.global_batch, args.local_samples)
    if args.w1_samples <= 0 or args.w1_samples % unit:
        p.error(f"--w1-samples must be a positive multiple of {unit} (W1's batch and --local-samples), "
                f"got {args.w1_samples}")  # fmt: skip
    for batch in (W1.global_batch, args.local_samples):
        steps, need = args.w1_samples // batch, warmup_steps(args.warmup_samples, batch) + 3
        if steps < need:  # the steady-state figures need steps after the warm-up, and one after those
            p.error(f"--w1-samples {args.w1_samples} makes {steps} steps of {batch}; with --warmup-samples "
                    f"{args.warmup_samples} they need at least {need} ({need * batch} samples)")  # fmt: skip
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # a line as each run starts and ends: the phase takes minutes
    if (os.cpu_count() or 1) < 2:
        print("bench: this benchmark pins processes to cores 0 and 1 and needs at least 2 CPUs", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    return outside([a for a in argv if a != "--inside"])


if __name__ == "__main__":
    sys.exit(main())
