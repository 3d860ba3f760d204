"""How much int8 costs in loss, measured in one process over several seeds: sync gradients and DiLoCo pseudo-gradients.

    python -m tests.benchmarks.int8_gaps          # or: make bench
    python -m tests.benchmarks.int8_gaps --seeds 3 --sync-steps 64 --rounds 30

Two questions the home-link benchmark cannot answer from one platform run:

1. *Is the sync int8 loss gap the codec or the seed?* W1 with one agent at
   staleness 1 (as the platform runs it: each gradient one version stale)
   is a chaotic regime early on, where two fp32 runs of different seeds end
   15 % apart. The same steps run here in fp32 and through the int8 codec with
   the agent's error feedback, for several seeds, and the mean gap is printed
   with each seed's.
2. *Does error feedback help int8 pseudo-gradients?* It is proven for
   gradients (``crowdtrain_agent.feedback``: the sum of what aggregators
   receive stays within one scale of the true sum). A pseudo-gradient is
   already the sum of H inner steps, sent once per round, and the outer
   Nesterov momentum smooths it again. The same DiLoCo training runs three
   times on the same samples in the same order: fp32 pseudo-gradients, int8
   with ``ErrorFeedback``, and int8 without it; each worker is what an agent
   does in local mode (``crowdtrain_agent.local_steps``, the real codec and
   feedback; no network).

Prints ``bench: NAME=VALUE`` lines:

- ``sync_int8_loss_gap_seedN`` and ``sync_int8_loss_gap``: (int8 loss - fp32 loss) / fp32 loss after the same
  steps, per seed and their mean; ``sync_fp32_val_loss_seedN`` shows the seed-to-seed spread;
- per seed: the DiLoCo fp32 run's validation loss; ``..._sum_drift``: along that run, the relative error of the
  sum of all int8-decoded pseudo-gradients against the exact sum, with and without feedback (the bias
  feedback removes); ``..._loss_gap``: (int8 run's loss - fp32 run's) / fp32 run's;
- ``local_int8_feedback_loss_gap`` and ``local_int8_no_feedback_loss_gap``: the mean gap over the seeds.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
for _folder in (REPO_ROOT / "platform", REPO_ROOT / "agent" / "src", REPO_ROOT / "deploy" / "launcher"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import torch  # noqa: E402

from crowdtrain_agent.codec import get_codec  # noqa: E402
from crowdtrain_agent.feedback import ErrorFeedback, SliceKey  # noqa: E402
from crowdtrain_agent.local_steps import InnerOptimizers, compute_pseudo_gradient  # noqa: E402
from crowdtrain_agent.protocol import ModelSpec, OptimizerSpec  # noqa: E402
from crowdtrain_agent.trainer import ModelCache  # noqa: E402

from .baseline import W1, make_data  # noqa: E402
from .figures import figure_line  # noqa: E402

INNER = OptimizerSpec(name="adamw", lr=1e-3)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD
VALIDATION_SAMPLES = 4096


@dataclass(frozen=True)
class Outcome:
    val_loss: float
    params: torch.Tensor
    # Along this run, what the int8 codec with and without feedback would have delivered: the relative
    # error of the sum of every decoded pseudo-gradient against the sum of the exact ones.
    drift: dict[str, float]


def train(codec_name: str, feedback: bool, *, workers: int, rounds: int, inner_steps: int, seed: int = 0) -> Outcome:
    """DiLoCo with ``workers`` simulated agents; every variant sees the same samples in the same order."""
    torch.manual_seed(seed)
    spec = ModelSpec(architecture="mlp", config=W1.model_config)
    per_round = workers * inner_steps * W1.microbatch
    x_all, y_all = (torch.from_numpy(a) for a in make_data(W1, rounds * per_round + VALIDATION_SAMPLES, seed=seed))
    x_val, y_val = x_all[-VALIDATION_SAMPLES:], y_all[-VALIDATION_SAMPLES:]
    agents = [ModelCache(torch.device("cpu")).get(1, spec) for _ in range(workers)]
    inner = [InnerOptimizers() for _ in range(workers)]
    residuals = [ErrorFeedback() for _ in range(workers)]
    codec = get_codec(codec_name, 256)
    # The aggregator's copy and its outer optimizer: the seeded model every agent starts from.
    global_params = torch.nn.Parameter(torch.nn.utils.parameters_to_vector(agents[0].model.parameters()).detach())
    outer = torch.optim.SGD([global_params], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    n = global_params.numel()
    int8 = get_codec("int8", 256)
    shadows = {"feedback": [ErrorFeedback() for _ in range(workers)], "no_feedback": [None] * workers}
    exact_sum = torch.zeros(n)
    shadow_sums = {name: torch.zeros(n) for name in shadows}
    for round_index in range(rounds):
        total = torch.zeros(n)
        for k, cm in enumerate(agents):
            torch.nn.utils.vector_to_parameters(global_params.detach().clone(), cm.model.parameters())
            lo = round_index * per_round + k * inner_steps * W1.microbatch
            x, y = x_all[lo : lo + inner_steps * W1.microbatch], y_all[lo : lo + inner_steps * W1.microbatch]
            optimizer = inner[k].get(1, cm, INNER, round_index)
            pseudo = compute_pseudo_gradient(cm, optimizer, INNER.lr, x, y, W1.microbatch).grad
            if codec.lossy and feedback:
                data = residuals[k].encode(SliceKey(1, n, codec.name, codec.block_size, 0, n), pseudo, codec)
            else:
                data = codec.encode(pseudo)
            total += codec.decode(data, n)
            exact_sum += pseudo
            for name, holders in shadows.items():
                holder = holders[k]
                key = SliceKey(2, n, int8.name, int8.block_size, 0, n)
                shadow = holder.encode(key, pseudo, int8) if holder is not None else int8.encode(pseudo)
                shadow_sums[name] += int8.decode(shadow, n)
        global_params.grad = total / (workers * inner_steps * W1.microbatch)
        outer.step()
    model = agents[0].model
    torch.nn.utils.vector_to_parameters(global_params.detach().clone(), model.parameters())
    with torch.no_grad():
        loss = agents[0].entry.loss_sum(model, x_val, y_val).item() / len(x_val)
    norm = float(torch.linalg.vector_norm(exact_sum))
    drift = {name: float(torch.linalg.vector_norm(total - exact_sum)) / norm for name, total in shadow_sums.items()}
    return Outcome(loss, global_params.detach().clone(), drift)


def train_sync(codec_name: str, *, steps: int, seed: int) -> float:
    """W1 at staleness 1 as one agent trains it on the platform: each step's gradient from the previous version."""
    x_all, y_all = (torch.from_numpy(a) for a in make_data(W1, steps * W1.global_batch + VALIDATION_SAMPLES, seed=0))
    cm = ModelCache(torch.device("cpu")).get(1, ModelSpec(architecture="mlp", config=W1.model_config))
    torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(cm.entry.build(W1.model_config, seed=seed).parameters()).detach(),
        cm.model.parameters(),
    )
    stale = copy.deepcopy(cm.model)  # the version the next gradient is computed on
    params = list(cm.model.parameters())
    optimizer = torch.optim.AdamW(params, lr=W1.lr, weight_decay=0.0)
    codec, feedback = get_codec(codec_name, 256), ErrorFeedback()
    n = sum(p.numel() for p in params)
    for step in range(steps):
        lo = step * W1.global_batch
        stale.zero_grad()
        cm.entry.loss_sum(stale, x_all[lo : lo + W1.global_batch], y_all[lo : lo + W1.global_batch]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in stale.parameters()])
        if codec.lossy:
            grad = codec.decode(feedback.encode(SliceKey(1, n, codec.name, 256, 0, n), grad, codec), n)
        stale.load_state_dict(cm.model.state_dict())
        offset = 0
        for p in params:
            p.grad = (grad[offset : offset + p.numel()] / W1.global_batch).view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    with torch.no_grad():
        x_val, y_val = x_all[-VALIDATION_SAMPLES:], y_all[-VALIDATION_SAMPLES:]
        return cm.entry.loss_sum(cm.model, x_val, y_val).item() / VALIDATION_SAMPLES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sync-steps", type=int, default=64, help="as many as homelink's default W1 run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sync_gaps = []
    for seed in range(args.seeds):
        exact, quantized = (train_sync(codec, steps=args.sync_steps, seed=seed) for codec in ("fp32", "int8"))
        sync_gaps.append((quantized - exact) / exact)
        print(figure_line(f"sync_fp32_val_loss_seed{seed}", exact), flush=True)
        print(figure_line(f"sync_int8_loss_gap_seed{seed}", sync_gaps[-1]), flush=True)
    note = f"mean over {args.seeds} seeds, W1 at staleness 1, {args.sync_steps} steps of {W1.global_batch}"
    print(figure_line("sync_int8_loss_gap", sum(sync_gaps) / len(sync_gaps), note), flush=True)
    options = {"workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps}
    gaps: dict[str, list[float]] = {"feedback": [], "no_feedback": []}
    for seed in range(args.seeds):
        exact = train("fp32", False, seed=seed, **options)
        print(figure_line(f"local_fp32_val_loss_seed{seed}", exact.val_loss), flush=True)
        for name in gaps:
            # Drifts are small: printed in scientific notation rather than w1's three decimals.
            print(f"bench: local_int8_{name}_sum_drift_seed{seed}={exact.drift[name]:.2e}", flush=True)
            got = train("int8", name == "feedback", seed=seed, **options)
            gaps[name].append((got.val_loss - exact.val_loss) / exact.val_loss)
            print(figure_line(f"local_int8_{name}_loss_gap_seed{seed}", gaps[name][-1]), flush=True)
    for name, values in gaps.items():
        mean = sum(values) / len(values)
        note = f"mean over {len(values)} seeds, {args.rounds} rounds of {args.workers} workers x H={args.inner_steps}"
        print(figure_line(f"local_int8_{name}_loss_gap", mean, note), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
