"""Two aggregators, two agents, fp32, staleness 0: the platform's parameters equal a plain PyTorch rerun.

The rerun takes, for each committed step, exactly the sample ranges the site
recorded, reads them from the shard files in storage, takes the mean loss over
the step's samples and one AdamW step with the campaign's hyperparameters
(weight decay on matrices only, as the aggregators apply it).
Only fp32 summation order differs (microbatches, leases, slices), so the
parameters agree to float rounding.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.models import get_model
from crowdtrain_agent.optimizers import stored_value
from crowdtrain_agent.protocol import DataSpec, SampleRange, Ticket, campaign_key, sign_ticket
from crowdtrain_agent.protocol.schema import from_dict
from crowdtrain_agent.trainer import gather_samples
from tests.e2e.datasets import write_projection_dataset

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

STEPS = 5
MODEL = {"in_dim": 32, "hidden": [64, 64], "classes": 4}
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.01}
# Leases of one microbatch, and idle agents asking again at once: each step of 96 samples is
# made of six leases, and both agents compete for them.
TICKET_KEY = bytes(range(32))  # known here, so the test can sign the ticket aggregators ask for parameters
SITE_ENV = {"CROWDTRAIN_LEASE_TARGET_S": "0.1", "CROWDTRAIN_MAX_LEASE_SAMPLES": "16", "CROWDTRAIN_RETRY_AFTER_S": "0.1",
            "CROWDTRAIN_TICKET_KEY": TICKET_KEY.hex(),
            # Every upload through the aggregators' spool, the path of large models: the tests that share
            # this setting then hold the spooled steps to plain PyTorch too.
            "CROWDTRAIN_BACKBONE_SPOOL_MIN_BYTES": "0"}  # fmt: skip


def write_dataset(path: Path) -> None:
    write_projection_dataset(path, 4096, MODEL)


def spec(npz: Path) -> dict[str, Any]:
    return {
        "campaigns": [{
            "name": "two-slice MLP", "architecture": "mlp", "model_config": MODEL, "optimizer": OPTIMIZER,
            "dataset": {"kind": "npz", "path": str(npz), "name": "projection", "shard_bytes": 64 << 10},
            "target_batch_size": 96, "microbatch_size": 16, "codec": "fp32", "staleness": 0,
            "num_aggregators": 2, "max_steps": STEPS, "seed": 42,
            "check_fraction": 0.0,  # copies could take one agent's whole share of a short run
        }],
        "aggregators": ["agg-1", "agg-2"],
        "agents": ["agent-1", "agent-2"],
    }  # fmt: skip


class Trained(NamedTuple):
    dump: dict[str, Any]
    params: torch.Tensor  # the platform's flat parameters at the last step trained


def rerun_in_pytorch(
    dump: dict[str, Any], steps: int = STEPS, initial: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[float]]:
    """The first ``steps`` committed steps replayed on one model (from ``initial``, else the seeded init): final
    flat parameters and each step's loss."""
    entry = get_model(dump["architecture"])
    model = entry.build(dump["model_config"], seed=dump["seed"])
    if initial is not None:
        torch.nn.utils.vector_to_parameters(initial.clone(), model.parameters())
    opt = dump["optimizer"]
    # The aggregators' weight-decay rule (nanoGPT's): matrices and embeddings decay, biases and norm
    # gains (fewer than 2 dimensions) do not, unless the campaign decays every tensor.
    decay_all = bool(stored_value(opt, "decay_all", False))
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if decay_all or p.dim() >= 2], "weight_decay": opt["weight_decay"]},
        {"params": [p for p in params if not (decay_all or p.dim() >= 2)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"],
        foreach=False,
    )  # fmt: skip
    data = from_dict(DataSpec, dump["dataset"]["spec"], "dataset")
    shards = Path(dump["media_root"]) / "shards"
    losses = []
    for step in dump["steps"][:steps]:
        readers = {sha: ShardReader(data, (shards / sha[:2] / sha).read_bytes()) for sha, _, _ in step["ranges"]}
        ranges = [SampleRange(shard=sha, start=start, count=count) for sha, start, count in step["ranges"]]
        # Augmented images are seeded by the lease's base version: the step's own index at staleness 0.
        x, y = gather_samples(ranges, readers, augment=data.augment, version=step["index"])
        assert len(x) == step["num_samples"]
        optimizer.zero_grad()
        loss = entry.loss_sum(model, x, y) / len(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), losses


def platform_params(dump: dict[str, Any], version: int, key: bytes | None = None) -> torch.Tensor:
    """Every slice of ``version`` from the aggregator that holds it, raw little-endian fp32, in slice order.

    ``key`` signs the ticket that asks for them: by default the campaign's own (a site pinned to protocol
    2.0 signs with the one site-wide key instead).
    """
    parts = []
    key = campaign_key(TICKET_KEY, dump["id"]) if key is None else key
    ticket = sign_ticket(Ticket(lease_id=0, campaign_id=dump["id"], device_id=0, base_version=version, num_samples=1,
                                expires_at=time.time() + 60), key)  # fmt: skip
    for s in sorted(dump["slices"], key=lambda s: s["index"]):
        url = f"{s['params_url']}{dump['id']}/{s['index']}/{version}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {ticket}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        assert len(body) == 4 * (s["end"] - s["start"]), f"slice {s['index']} has {len(body)} bytes"
        parts.append(torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32)))
    return torch.cat(parts)


def trained(seeded_run: Any, tmp_path: Path, make_spec: Callable[[Path], dict[str, Any]], steps: int) -> Trained:
    """Seed a run of ``make_spec``'s campaign on the projection dataset, train ``steps`` steps: its dump and params."""
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    run = seeded_run(make_spec(npz), SITE_ENV)
    run.start(agents_first=True)
    run.wait_for_version(steps, timeout_s=90)
    dump = run.dump()
    return Trained(dump, platform_params(dump, steps))


def test_two_aggregators_reach_the_parameters_of_plain_pytorch(seeded_run: Any, tmp_path: Path) -> None:
    dump, platform = trained(seeded_run, tmp_path, spec, STEPS)
    reference, reference_losses = rerun_in_pytorch(dump)

    assert len(dump["slices"]) == 2 and dump["slices"][0]["params_url"] != dump["slices"][1]["params_url"]
    # Staleness 0: every lease of step s trained on version s, which the rerun assumes.
    assert all(lease["base_version"] == step["index"] for step in dump["steps"] for lease in step["leases"])
    assert all(len(step["leases"]) >= 2 for step in dump["steps"]), "expected several leases per step"
    assert len({lease["device"] for step in dump["steps"] for lease in step["leases"]}) == 2, "both agents contribute"
    site_losses = [step["loss_sum"] / step["num_samples"] for step in dump["steps"][:STEPS]]
    np.testing.assert_allclose(site_losses, reference_losses, rtol=1e-5)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
    assert reference_losses[-1] < reference_losses[0]
