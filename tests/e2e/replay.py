"""One check several end-to-end tests end with: the swarm's steps are plain PyTorch's, sample for sample."""

from __future__ import annotations

from typing import Any

import torch

from tests.e2e.test_aggregator_stops_lose_nothing import samples_committed_once
from tests.e2e.test_two_aggregators_match_plain_pytorch import platform_params, rerun_in_pytorch


def relative_error(platform: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference))


def trains_like_plain_pytorch(
    run: Any, steps: int, *, initial: torch.Tensor | None = None
) -> tuple[dict[str, Any], list[float], torch.Tensor]:
    """Start ``run``, train ``steps`` steps and check them: every sample committed once, and the aggregators'
    parameters within 1e-5 of plain PyTorch replaying the recorded steps (from ``initial`` if given).

    Returns:
        The run's dump, the replay's losses and the platform's parameters.
    """
    run.start(agents_first=True)
    run.wait_for_version(steps, timeout_s=150)
    dump = run.dump()
    samples_committed_once(dump)
    reference, losses = rerun_in_pytorch(dump, steps, initial=initial)
    platform = platform_params(dump, steps)
    error = relative_error(platform, reference)
    assert error <= 1e-5, f"relative error {error:.3g} between the platform's and plain PyTorch's parameters"
    return dump, losses, platform
