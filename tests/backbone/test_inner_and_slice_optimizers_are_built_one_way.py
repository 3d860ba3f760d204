"""An agent's inner optimizer and an aggregator's slice optimizer are one builder: the same step, the same decay."""

from __future__ import annotations

import pytest
import torch

from crowdtrain_agent.local_steps import build_inner_optimizer
from crowdtrain_agent.optimizers import INNER_OPTIMIZERS, get_optimizer, hyperparameters_of
from crowdtrain_agent.protocol import OptimizerSpec
from crowdtrain_agent.torch_optimizers import ELEMENTWISE
from crowdtrain_backbone.optimizers import SliceLayout, builder_of, decay_rule, tensor_spans


def test_every_inner_optimizer_is_one_torch_builds() -> None:
    assert tuple(ELEMENTWISE) == INNER_OPTIMIZERS


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.1),
        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
)
def test_one_step_on_a_model_equals_one_step_on_its_flat_slice(spec: OptimizerSpec) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    grads = [torch.randn_like(p) for p in model.parameters()]
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    spans = tensor_spans([tuple(p.shape) for p in model.parameters()], 0, flat.numel())
    layout = SliceLayout(tuple(spans), decay_rule(spans))
    inner = build_inner_optimizer(model, spec)
    sliced = builder_of(get_optimizer(spec.name))(flat, hyperparameters_of(spec), layout)

    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.clone()
    flat.grad = torch.cat([g.reshape(-1) for g in grads])
    inner.step()
    sliced.step()

    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), flat.detach())
