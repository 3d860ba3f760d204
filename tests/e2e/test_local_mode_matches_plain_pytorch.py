"""Local mode (DiLoCo) with one agent, H=1 and an outer SGD of lr 1 is plain PyTorch's inner optimizer.

With one microbatch per lease and one lease per round, each round is one inner
AdamW step on the agent from the round's base version; the pseudo-gradient is
that step's change, and an outer SGD step of lr 1 without momentum applies it
whole. The inner optimizer's moments stay on the agent between leases, so the
run is plain AdamW over the same microbatches: the test replays the sample
ranges the site recorded, one AdamW step each, and compares the parameters the
aggregator publishes.

At staleness 1 the rounds overlap: the agent is leased round k+1 on version
k-1 while round k is uploaded and published, starts it where its own last
lease ended and moves onto version k when it arrives. With an outer SGD of
lr 1 that estimate is version k itself, so the run is still plain AdamW.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import DataSpec
from tests.e2e.test_two_aggregators_match_plain_pytorch import MODEL, rerun_in_pytorch, trained
from tests.shards import read_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

STEPS = 8
INNER = {"inner_optimizer": "adamw", "inner_lr": 1e-2, "inner_weight_decay": 0.01}
# What the agent's inner AdamW is, spelled as the rerun reads an optimizer (the registry's defaults elsewhere).
INNER_AS_OPTIMIZER = {"name": "adamw", "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
OUTER = {"name": "sgd", "lr": 1.0, "momentum": 0.0}


def spec(npz: Path, staleness: int = 0) -> dict[str, Any]:
    return {
        "campaigns": [{
            "name": "local MLP", "architecture": "mlp", "model_config": MODEL, "optimizer": OUTER,
            "training_mode": "local", **INNER,
            "dataset": {"kind": "npz", "path": str(npz), "name": "projection", "shard_bytes": 64 << 10},
            # One lease of one microbatch per round: H = 1.
            "target_batch_size": 16, "microbatch_size": 16, "codec": "fp32", "staleness": staleness,
            "num_aggregators": 1, "max_steps": STEPS, "seed": 7, "check_fraction": 0.0,
        }],
        "aggregators": ["agg-1"],
        "agents": ["agent-1"],
    }  # fmt: skip


@pytest.mark.parametrize("staleness", [0, 1], ids=["lock_step", "overlapped"])
def test_local_mode_with_one_inner_step_and_outer_sgd_lr_1_is_plain_adamw(
    seeded_run: Any, tmp_path: Path, staleness: int
) -> None:
    dump, platform = trained(seeded_run, tmp_path, lambda npz: spec(npz, staleness), STEPS)
    reference, reference_losses = rerun_in_pytorch({**dump, "optimizer": INNER_AS_OPTIMIZER}, STEPS)

    assert dump["optimizer"]["name"] == "sgd", "the campaign's optimizer is the outer one"
    assert all(len(step["leases"]) == 1 and step["num_samples"] == 16 for step in dump["steps"][:STEPS])
    behind = [step["index"] - lease["base_version"] for step in dump["steps"] for lease in step["leases"]]
    assert set(behind) <= {0, staleness}
    if staleness:
        assert behind.count(1) >= STEPS // 2, f"the rounds overlapped too rarely to test it: {behind}"
    site_losses = [step["loss_sum"] / step["num_samples"] for step in dump["steps"][:STEPS]]
    np.testing.assert_allclose(site_losses, reference_losses, rtol=1e-5)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between local mode's and plain AdamW's parameters"
    # Against a rerun whose AdamW forgets its moments each round, the platform is far off: the state is kept.
    forgetful = _forgetful_rerun(dump, STEPS)
    assert float(torch.linalg.vector_norm(platform - forgetful) / torch.linalg.vector_norm(reference)) > 1e-4
    assert reference_losses[-1] < reference_losses[0]


def _forgetful_rerun(dump: dict[str, Any], steps: int) -> torch.Tensor:
    """The same replay with a fresh AdamW each step (what an agent dropping its inner state would compute)."""
    entry = get_model(dump["architecture"])
    model = entry.build(dump["model_config"], seed=dump["seed"])
    params = list(model.parameters())
    for index in range(steps):
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": INNER["inner_weight_decay"]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=INNER["inner_lr"],
            foreach=False,
        )
        x, y = _step_samples(dump, index)
        optimizer.zero_grad()
        (entry.loss_sum(model, x, y) / len(x)).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(params).detach()


def _step_samples(dump: dict[str, Any], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = DataSpec(kind=dump["dataset"]["kind"], sample_len=dump["dataset"]["sample_len"])
    shards = Path(dump["media_root"]) / "shards"
    batches = [
        read_samples(data, (shards / sha[:2] / sha).read_bytes(), start, count)
        for sha, start, count in dump["steps"][index]["ranges"]
    ]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
