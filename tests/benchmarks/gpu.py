"""Benchmark W1 on a GPU: one agent computing on CUDA against plain PyTorch on the same GPU, in the same run.

    python -m tests.benchmarks.gpu                       # needs a CUDA GPU; prints why not elsewhere
    python -m tests.benchmarks.gpu --steps 40 --shapes 1024x64,16384x1024

For each shape (global batch x microbatch) of W1's MLP it prints
``bench: gpu_agent_efficiency_<global>x<micro>=RATIO``: one agent started with
``--device cuda`` (site and aggregator on the CPUs, as a volunteer's GPU
would see them) over plain PyTorch training the same model on the same GPU,
with data already in GPU memory. W1 as the CPU benchmark runs it (1024 x 64)
gives a GPU about 1 ms of work per step, so the ratio is the platform's
per-step cost (upload, aggregation, publication) against that millisecond; a
GPU-sized batch (16384 x 1024) shows where the per-step cost stops mattering.

Each platform phase runs between two baselines; a phase whose baselines
disagree by more than 10 % runs again, and prints ``unstable`` if they still
disagree, as in W1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .baseline import W1, Workload, measure_in_process
from .figures import between_baselines, figure_line, ratio_or_unstable
from .w1 import REPO_ROOT, PhaseResult, _attempt_dir, _unstable_note, run_phase, write_npz


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        batch, _, micro = part.strip().partition("x")
        try:
            shape = (int(batch), int(micro))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a shape is GLOBALxMICRO, e.g. 16384x1024; got {part!r}") from None
        if shape[1] < 1 or shape[0] < shape[1]:
            raise argparse.ArgumentTypeError(f"need 1 <= microbatch <= global batch, got {part!r}")
        shapes.append(shape)
    return shapes


def _measure_shape(root: Path, workload: Workload, args: argparse.Namespace) -> list[str]:
    """One agent on the GPU between two plain-PyTorch baselines on the GPU: the shape's ``bench:`` lines."""
    name = f"{workload.global_batch}x{workload.microbatch}"
    npz = root / f"w1-{name}.npz"
    write_npz(npz, workload)

    def baseline() -> float:
        return measure_in_process(threads=1, seconds=args.baseline_seconds, workload=workload, device=args.device)

    def phase(attempt: int) -> PhaseResult:
        return run_phase(
            _attempt_dir(root / name, attempt),
            npz,
            agent_cpus=[None],
            server_cpus=None,
            steps=args.steps,
            warmup=args.warmup,
            ingest_uploads=0,
            site_env={},
            workload=workload,
            agent_device=args.device,
        )

    result, base = between_baselines(f"gpu phase {name}", phase, baseline, args.repeats)
    return [
        figure_line(f"gpu_baseline_samples_per_s_{name}", base.best, _unstable_note(base)),
        figure_line(f"gpu_agent_samples_per_s_{name}", result.samples_per_s),
        ratio_or_unstable(f"gpu_agent_efficiency_{name}", result.samples_per_s, base),
        figure_line(f"gpu_time_to_first_step_s_{name}", result.time_to_first_step_s),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per platform phase (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady rate (default 5)")
    parser.add_argument("--baseline-seconds", type=float, default=5.0, help="plain PyTorch timing (default 5)")
    parser.add_argument("--shapes", type=_shapes, default=[(1024, 64), (16384, 1024)],
                        help="global batch x microbatch, comma-separated (default 1024x64,16384x1024)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="reruns of a phase whose baselines disagree")
    parser.add_argument("--device", default="cuda", help="the agent's and the baseline's device (default cuda; "
                        "cpu only to try the benchmark itself on a machine without a GPU)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench: gpu skipped (PyTorch sees no CUDA device on this machine)", flush=True)
        return 0
    if args.device == "cuda":
        print(f"bench: gpu_device={torch.cuda.get_device_name(0)!r}", flush=True)
    root = REPO_ROOT / "var" / "bench" / "gpu"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for batch, micro in args.shapes:
        for line in _measure_shape(root, dataclasses.replace(W1, global_batch=batch, microbatch=micro), args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
