"""Agents computing on a CUDA GPU train to the parameters plain PyTorch reaches on the CPU.

The real programs (daphne, two aggregators, two agents started with
``--device cuda``) run the two-slice campaign of
``test_two_aggregators_match_plain_pytorch``; its steps are then replayed in
one CPU process. GPU and CPU add in different orders, so the match is to
float32 rounding, not to the bit. Skipped where PyTorch sees no CUDA device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    STEPS,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(180)]


def test_gpu_agents_reach_the_parameters_of_plain_pytorch(seeded_run: Any, tmp_path: Path) -> None:
    npz = tmp_path / "projection.npz"
    write_dataset(npz)
    run = seeded_run(spec(npz), SITE_ENV)
    run.start(agents_first=True, agent_device="cuda")
    run.wait_for_version(STEPS, timeout_s=120)
    dump = run.dump()
    platform = platform_params(dump, STEPS)
    reference, reference_losses = rerun_in_pytorch(dump)

    devices = {lease["device"] for step in dump["steps"] for lease in step["leases"]}
    assert len(devices) == 2, "both agents contribute"
    kinds = {dump["hardware"][str(d)].get("kind") for d in devices}
    assert kinds == {"cuda"}, f"the agents said they computed on {kinds}"
    site_losses = [step["loss_sum"] / step["num_samples"] for step in dump["steps"][:STEPS]]
    np.testing.assert_allclose(site_losses, reference_losses, rtol=1e-4)
    error = float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))
    assert error <= 1e-4, f"relative error {error:.3g} between the GPU swarm's and plain PyTorch's parameters"
    assert reference_losses[-1] < reference_losses[0]
