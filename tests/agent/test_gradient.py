"""A lease's gradient is the plain summed gradient over its samples, whatever the microbatch size."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec
from crowdtrain_agent.trainer import ModelCache, compute_gradient, load_params_

GPT_CONFIG = {"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 6}
MLP_CONFIG = {"in_dim": 5, "hidden": [7, 4], "classes": 3}


def _plain_gradient(arch: str, config: dict, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model = get_model(arch).build(config)
    torch.nn.utils.vector_to_parameters(params.clone(), model.parameters())
    logits = model(x)
    if arch == "gpt":  # each sample's mean token loss, summed over samples
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none").view(y.shape).mean(1).sum()
    else:
        loss = F.cross_entropy(logits, y, reduction="sum")
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _case(arch: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if arch == "gpt":
        tokens = torch.randint(0, 256, (11, GPT_CONFIG["block_size"] + 1), generator=g)
        return GPT_CONFIG, tokens[:, :-1], tokens[:, 1:]
    return MLP_CONFIG, torch.randn(11, 5, generator=g), torch.randint(0, 3, (11,), generator=g)


@pytest.mark.parametrize("arch", ["gpt", "mlp"])
def test_lease_gradient_equals_plain_torch_summed_gradient(arch: str) -> None:
    config, x, y = _case(arch)
    cm = ModelCache(torch.device("cpu")).get(7, ModelSpec(architecture=arch, config=config))
    params = torch.nn.utils.parameters_to_vector(get_model(arch).build(config, seed=3).parameters()).detach()
    load_params_(cm, params, version=4)

    result = compute_gradient(cm, x, y, microbatch_size=4)

    torch.testing.assert_close(result.grad, _plain_gradient(arch, config, params, x, y))
    assert result.num_samples == 11 and cm.version == 4


@pytest.mark.parametrize("arch", ["gpt", "mlp"])
def test_microbatching_does_not_change_the_gradient(arch: str) -> None:
    config, x, y = _case(arch)
    cm = ModelCache(torch.device("cpu")).get(7, ModelSpec(architecture=arch, config=config))

    results = [compute_gradient(cm, x, y, microbatch_size=m) for m in (1, 3, 11, 64)]

    for other in results[1:]:
        torch.testing.assert_close(other.grad, results[0].grad)
        assert other.loss_sum == pytest.approx(results[0].loss_sum, rel=1e-5)
