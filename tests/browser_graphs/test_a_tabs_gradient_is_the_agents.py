"""The graph computes the agent's own loss_sum and gradient for a microbatch, so a tab's lease sums with agents'."""

from __future__ import annotations

import pytest
import torch

from crowdtrain.browser.gate import run_graph
from crowdtrain.browser.graphs import export_gradient_graph
from crowdtrain.browser.samples import batch_layout, synthetic_batch
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec
from crowdtrain_agent.trainer import ModelCache, compute_gradient, load_params_

CASES = {
    "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8},
    "mlp": {"in_dim": 12, "hidden": [16], "classes": 5},
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_graphs_loss_and_gradient_equal_compute_gradients(family: str) -> None:
    config = CASES[family]
    graph = export_gradient_graph(family, config, 4)
    x, y = synthetic_batch(batch_layout(family, config, 4), seed=5)
    params = get_model(family).build(config, seed=3)
    cm = ModelCache(torch.device("cpu")).get(1, ModelSpec(architecture=family, config=config))
    load_params_(cm, torch.nn.utils.parameters_to_vector(params.parameters()).detach(), version=1)

    loss, grads = run_graph(graph, [p.detach() for p in params.parameters()], x, y)
    agent = compute_gradient(cm, x, y, microbatch_size=4)

    flat = torch.cat([torch.from_numpy(g).reshape(-1) for g in grads])
    torch.testing.assert_close(flat, agent.grad, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(agent.loss_sum, rel=1e-5)
