"""Benchmark W1: the platform's throughput against plain PyTorch on the same machine, in the same run.

    python -m tests.benchmarks.w1                 # or: make bench
    python -m tests.benchmarks.w1 --steps 60 --warmup 10

W1 is an MLP 256-1024-1024-10 (1.3 M parameters), microbatch 64, global
batch 1024, Adam lr 1e-3 (AdamW with no weight decay on the aggregator),
staleness 1, on synthetic data: x ~ N(0, 1) in R^256, label = argmax(x @ W)
with W a fixed random 256x10 projection (seed 0), ingested as an .npz.

Prints one ``bench: NAME=VALUE`` line per figure:

- ``agent_efficiency``: one agent (one torch thread, ``taskset -c 0``), with
  site and aggregator on core 1, over plain PyTorch (one thread, core 0).
- ``swarm_efficiency``: two one-thread agents plus site and aggregator
  sharing both cores, over plain PyTorch with two threads.
- ``time_to_first_step_s``: from starting an agent against a running site
  (its aggregator ready) to the first committed step, which is its lease.
- ``ingest_MBps``: fp32 gradient slices (~5.3 MB) with valid tickets
  uploaded straight to the aggregator, one after another on one connection.

The plain loop neither checkpoints nor computes a validation loss, and the W1
campaign does neither (``checkpoint_every`` past the run, ``validate_every``
0): the figures compare training with training.

Platform rates are steady state: committed samples between the end of the
warm-up steps and the last step, over the commit times the site recorded.
Runs live in ``var/bench/w1/`` (wiped at start; logs stay for a look).

The machine is shared, so each baseline is measured right before and right
after the phase it divides. When the two disagree by more than 10 % the
machine changed under the phase, and the phase runs again with fresh
baselines (``--repeats``, twice by default); when they still disagree the
efficiency line says ``unstable (baselines X and Y disagree by Z%)`` instead
of a ratio that would measure the neighbours.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
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

from crowdtrain_launcher import Swarm, get_json  # noqa: E402

from .baseline import W1, Workload, make_data, measure_in_process  # noqa: E402
from .figures import BaselinePair, between_baselines, figure_line, format_value, ratio_or_unstable  # noqa: E402
from .ingest import measure_ingest  # noqa: E402

logger = logging.getLogger("tests.benchmarks.w1")

NUM_SAMPLES = 65536  # 64 MiB of features: no epoch wraps within a default run


@dataclass(frozen=True)
class PhaseResult:
    samples_per_s: float
    time_to_first_step_s: float
    ingest_mb_per_s: float | None


def steady_rate(steps: Sequence[dict[str, Any]], warmup: int) -> float:
    """Committed samples per second after ``warmup`` steps, from the site's commit times."""
    if len(steps) < warmup + 2:
        raise RuntimeError(f"only {len(steps)} steps committed; need more than warm-up {warmup} + 1")
    times = [datetime.fromisoformat(s["committed_at"]).timestamp() for s in steps]
    samples = sum(s["num_samples"] for s in steps[warmup + 1 :])
    return samples / (times[-1] - times[warmup])


def write_npz(path: Path, workload: Workload = W1) -> None:
    x, y = make_data(workload, NUM_SAMPLES, seed=0)
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    path.write_bytes(buffer.getvalue())


def campaign_spec(npz: Path, steps: int, agents: int, workload: Workload = W1) -> dict[str, Any]:
    return {
        "campaigns": [
            {
                "name": "W1",
                "architecture": "mlp",
                "model_config": workload.model_config,
                "optimizer": {"name": "adamw", "lr": workload.lr, "weight_decay": 0.0},
                "dataset": {"kind": "npz", "path": str(npz), "name": "w1", "shard_bytes": 4 << 20},
                "target_batch_size": workload.global_batch,
                "microbatch_size": workload.microbatch,
                "codec": "fp32",
                "staleness": 1,
                "max_steps": steps,
                "checkpoint_every": 1000,
                "validate_every": 0,
                "seed": 0,
            }
        ],
        "aggregators": ["agg-1"],
        "agents": [f"agent-{i + 1}" for i in range(agents)],
    }


def run_phase(
    run_dir: Path,
    npz: Path,
    *,
    agent_cpus: Sequence[Sequence[int] | None],
    server_cpus: Sequence[int] | None,
    steps: int,
    warmup: int,
    ingest_uploads: int,
    site_env: dict[str, str],
    workload: Workload = W1,
    agent_device: str = "cpu",
) -> PhaseResult:
    """One fresh site + aggregator, then the agents; steady rate, first-step latency, and optionally ingest."""
    key = secrets.token_bytes(32)
    # Production settings where they matter for speed: DEBUG off (no per-query bookkeeping).
    env = {
        "CROWDTRAIN_VAR_DIR": str(run_dir / "var"),
        "CROWDTRAIN_TICKET_KEY": key.hex(),
        "CROWDTRAIN_DEBUG": "false",
        **site_env,
    }
    # This process polls the site while the agents work: it stays off their cores, with the site.
    own_cpus = os.sched_getaffinity(0)
    if server_cpus:
        os.sched_setaffinity(0, set(server_cpus))
    try:
        return _measure_phase(
            run_dir,
            npz,
            env,
            key,
            agent_cpus=agent_cpus,
            server_cpus=server_cpus,
            steps=steps,
            warmup=warmup,
            ingest_uploads=ingest_uploads,
            workload=workload,
            agent_device=agent_device,
        )
    finally:
        os.sched_setaffinity(0, own_cpus)


def _measure_phase(
    run_dir: Path,
    npz: Path,
    env: dict[str, str],
    key: bytes,
    *,
    agent_cpus: Sequence[Sequence[int] | None],
    server_cpus: Sequence[int] | None,
    steps: int,
    warmup: int,
    ingest_uploads: int,
    workload: Workload,
    agent_device: str,
) -> PhaseResult:
    with Swarm(run_dir, env=env) as swarm:
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(campaign_spec(npz, steps, len(agent_cpus), workload)))
        seed = json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec_path), timeout_s=300))
        campaign_id = seed["campaigns"][0]
        site = swarm.start_site(cpus=server_cpus)
        aggregator = swarm.start_aggregator(site, token=seed["aggregators"]["agg-1"], name="agg-1", cpus=server_cpus)
        swarm.wait_until(lambda: get_json(f"{aggregator}/healthz")["slices"], 60, "the aggregator to hold its slice")
        time.sleep(0.5)  # its slice_ready reaches the site right after

        # time to first step: agent start -> its lease is part of a committed step
        started = time.monotonic()
        for (name, token), cpus in zip(seed["agents"].items(), agent_cpus, strict=True):
            swarm.start_agent(
                site, token=token, name=name, threads=1, campaign_id=campaign_id, cpus=cpus, device=agent_device
            )
        progress_url = f"{site.url}/api/campaigns/{campaign_id}/progress"
        swarm.wait_until(lambda: get_json(progress_url)["committed_steps"] >= 1, 180, "the first committed step", 0.05)
        first_step_s = time.monotonic() - started

        # The rate comes from the site's commit times, so a slow poll costs no precision.
        swarm.wait_until(lambda: get_json(progress_url)["version"] >= steps, 600, f"{steps} applied steps", 1.0)
        dump = json.loads(swarm.manage("dump_run", "--campaign", str(campaign_id)))
        rate = steady_rate(dump["steps"][:steps], warmup)

        ingest = None
        if ingest_uploads:
            for child in swarm.children:  # quiet machine: only the aggregator and this process work
                if child.role == "agent":
                    child.stop(grace_s=10)
            s = dump["slices"][0]
            result = measure_ingest(
                s["upload_url"],
                key,
                campaign_id=campaign_id,
                slice_index=s["index"],
                numel=s["end"] - s["start"],
                version=dump["version"],
                uploads=ingest_uploads,
            )
            ingest = result.mb_per_s
    return PhaseResult(rate, first_step_s, ingest)


def _unstable_note(pair: BaselinePair) -> str:
    return "" if pair.agrees() else f"unstable: {format_value(pair.before)} before, {format_value(pair.after)} after"


def _attempt_dir(run_dir: Path, attempt: int) -> Path:
    """A repeated phase gets a folder of its own, so the first attempt's logs stay for a look."""
    return run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-repeat-{attempt}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.w1", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per platform phase (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady rate (default 5)")
    parser.add_argument("--baseline-seconds", type=float, default=8.0, help="plain PyTorch timing (default 8)")
    parser.add_argument("--ingest-uploads", type=int, default=40, help="timed ~5 MB uploads (default 40)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of a phase again while its baselines disagree by over 10%% (default 2)",
    )
    parser.add_argument(
        "--site-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra site setting, e.g. CROWDTRAIN_RETRY_AFTER_S=0.1 (repeatable)",
    )
    args = parser.parse_args(argv)
    site_env = dict(item.split("=", 1) for item in args.site_env if "=" in item)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (os.cpu_count() or 1) < 2:
        print("bench: this benchmark pins processes to cores 0 and 1 and needs at least 2 CPUs", file=sys.stderr)
        return 2

    root = REPO_ROOT / "var" / "bench" / "w1"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    npz = root / "w1.npz"
    write_npz(npz)

    def one_thread() -> float:
        return measure_in_process(threads=1, cpus=[0], seconds=args.baseline_seconds)

    def two_threads() -> float:
        return measure_in_process(threads=2, seconds=args.baseline_seconds)

    # Each phase between two measurements of the baseline it is divided by: other load that comes
    # or goes during the phase shows as a disagreement, and the phase runs again.
    one, base_1 = between_baselines(
        "agent phase",
        lambda attempt: run_phase(
            _attempt_dir(root / "one-agent", attempt),
            npz,
            agent_cpus=[[0]],
            server_cpus=[1],
            steps=args.steps,
            warmup=args.warmup,
            ingest_uploads=0,
            site_env=site_env,
        ),
        one_thread,
        args.repeats,
    )
    two, base_2 = between_baselines(
        "swarm phase",
        lambda attempt: run_phase(
            _attempt_dir(root / "two-agents", attempt),
            npz,
            agent_cpus=[None, None],
            server_cpus=None,
            steps=args.steps,
            warmup=args.warmup,
            ingest_uploads=args.ingest_uploads,
            site_env=site_env,
        ),
        two_threads,
        args.repeats,
    )
    lines = [
        figure_line("baseline_1thread_samples_per_s", base_1.best, _unstable_note(base_1)),
        figure_line("baseline_2threads_samples_per_s", base_2.best, _unstable_note(base_2)),
        figure_line("agent_samples_per_s", one.samples_per_s),
        ratio_or_unstable("agent_efficiency", one.samples_per_s, base_1),
        figure_line("swarm_samples_per_s", two.samples_per_s),
        ratio_or_unstable("swarm_efficiency", two.samples_per_s, base_2),
        figure_line("time_to_first_step_s", one.time_to_first_step_s),
        figure_line("ingest_MBps", two.ingest_mb_per_s or 0.0),
    ]
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
