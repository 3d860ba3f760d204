"""Plain PyTorch on this machine: the yardstick every platform figure is divided by.

Run it as its own process, so thread count and CPU pinning apply to it alone::

    python -m tests.benchmarks.baseline --threads 1 --seconds 5      # prints {"samples_per_s": ...}
    taskset -c 0 python -m tests.benchmarks.baseline --threads 1

The loop is what one big machine would do for workload W1: microbatches of
64 accumulate the summed loss's gradient over a global batch of 1024, then
one Adam step; the same arithmetic the agents and the aggregator split up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    """W1 by default: MLP 256-1024-1024-10, microbatch 64, global batch 1024, Adam lr 1e-3."""

    in_dim: int = 256
    hidden: tuple[int, ...] = (1024, 1024)
    classes: int = 10
    microbatch: int = 64
    global_batch: int = 1024
    lr: float = 1e-3

    @property
    def model_config(self) -> dict[str, object]:
        return {"in_dim": self.in_dim, "hidden": list(self.hidden), "classes": self.classes}


W1 = Workload()


def make_data(workload: Workload, num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """x ~ N(0, 1); label = argmax of x @ W, with W a fixed random projection drawn from ``seed``."""
    projection = np.random.default_rng(seed).standard_normal((workload.in_dim, workload.classes)).astype(np.float32)
    x = np.random.default_rng(seed + 1).standard_normal((num_samples, workload.in_dim)).astype(np.float32)
    return x, (x @ projection).argmax(axis=1).astype(np.int64)


def build_model(workload: Workload, seed: int = 0) -> torch.nn.Module:
    # The registry's MLP, so the baseline runs the very module the agents run.
    from crowdtrain_agent.models import get_model

    return get_model("mlp").build(workload.model_config, seed=seed)


def measure(
    workload: Workload = W1, *, threads: int = 1, seconds: float = 5.0, warmup_steps: int = 2, device: str = "cpu"
) -> float:
    """Samples per second of plain PyTorch training over about ``seconds``, after ``warmup_steps`` steps.

    On a GPU the data sits in its memory from the start and the clock waits for
    the GPU's queue to drain, so the figure is finished work, as the agent's is.
    """
    torch.set_num_threads(threads)
    on = torch.device(device)
    x_all, y_all = (torch.from_numpy(a).to(on) for a in make_data(workload, 8 * workload.global_batch))
    model = build_model(workload).to(on)
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.lr)

    def sync() -> None:
        if on.type == "cuda":
            torch.cuda.synchronize(on)

    micro_per_step = workload.global_batch // workload.microbatch
    step, samples, started = 0, 0, 0.0
    while True:
        if step == warmup_steps:
            sync()
            started, samples = time.perf_counter(), 0
        offset = (step * workload.global_batch) % len(x_all)
        for i in range(micro_per_step):  # accumulate the summed loss's gradient, as agents do
            lo = offset + i * workload.microbatch
            x, y = x_all[lo : lo + workload.microbatch], y_all[lo : lo + workload.microbatch]
            (F.cross_entropy(model(x), y, reduction="sum") / workload.global_batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        samples += workload.global_batch
        if step > warmup_steps and time.perf_counter() - started >= seconds:
            sync()
            return samples / (time.perf_counter() - started)


def measure_in_process(
    *,
    threads: int,
    cpus: Sequence[int] | None = None,
    seconds: float = 5.0,
    workload: Workload = W1,
    device: str = "cpu",
) -> float:
    """Run ``measure`` in a fresh process (optionally under ``taskset -c``) and return its samples/s.

    A fresh process keeps this one's thread pool and affinity untouched and
    gives the loop a cold start like an agent's.
    """
    argv = [sys.executable, "-m", "tests.benchmarks.baseline", "--threads", str(threads), "--seconds", str(seconds)]
    argv += ["--device", device, "--global-batch", str(workload.global_batch), "--microbatch", str(workload.microbatch)]
    if cpus:
        argv = ["taskset", "-c", ",".join(map(str, cpus)), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "agent" / "src"), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=seconds + 120)
    if result.returncode != 0:
        raise RuntimeError(f"baseline run failed ({result.returncode}): {result.stderr[-2000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["samples_per_s"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time after warm-up (default 5)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--global-batch", type=int, default=W1.global_batch, help="samples per optimizer step")
    parser.add_argument("--microbatch", type=int, default=W1.microbatch, help="samples per forward/backward")
    args = parser.parse_args(argv)
    workload = replace(W1, global_batch=args.global_batch, microbatch=args.microbatch)
    rate = measure(workload, threads=args.threads, seconds=args.seconds, device=args.device)
    print(json.dumps({"samples_per_s": rate, "threads": args.threads, "device": args.device}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
