"""The gate fails a graph whose gradients are not the model's, and says so in words an organizer can act on.

The exporter's own translation of a mean loss's backward loses the 1/N: traced
without the decompositions, such a graph's gradients come out times the batch
size, and the gate is what stops it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from crowdtrain.browser import graphs
from crowdtrain.browser.gate import TOLERANCE, gate, measure
from crowdtrain.browser.graphs import build_graph, export_gradient_graph
from crowdtrain.browser.samples import BatchLayout, TensorSpec, batch_layout
from crowdtrain_agent.models import get_model

CONFIG = {"in_dim": 12, "hidden": [16, 16], "classes": 5}
MICROBATCH = 8


def test_gradients_scaled_by_the_batch_size_fail_with_the_reason() -> None:
    entry = get_model("mlp")

    def times_the_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return entry.loss_sum(model, x, y) * x.shape[0]  # the trap of a lost 1/N, made on purpose

    wrong = build_graph(entry.build(CONFIG, seed=0), times_the_batch, batch_layout("mlp", CONFIG, MICROBATCH),
                        model_name="mlp", model_config=entry.validate(CONFIG))  # fmt: skip

    result = gate(wrong, "mlp", CONFIG)

    assert not result.passed
    assert result.ratio > 1000 * TOLERANCE
    assert result.reason.startswith("mlp: gradients differ from PyTorch's fp64 reference by ")
    assert "PyTorch's own fp32 error" in result.reason
    assert result.reason.endswith("the exported graph is wrong for this model; browser compute stays off")


def test_a_graph_of_another_config_is_a_callers_mistake() -> None:
    graph = export_gradient_graph("mlp", CONFIG, MICROBATCH)

    with pytest.raises(ValueError, match="exported for mlp"):
        gate(graph, "mlp", {**CONFIG, "classes": 6})


def _mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)  # the mean over the batch: its backward divides by N


def _mean_loss_case() -> tuple[nn.Module, BatchLayout, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    layout = BatchLayout("features", TensorSpec("x", (8, 12), "float32"), TensorSpec("y", (8,), "int64"), 5)
    gen = torch.Generator().manual_seed(1)
    return model, layout, torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def test_a_graph_traced_without_the_decompositions_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    model, layout, x, y = _mean_loss_case()
    monkeypatch.setattr(graphs, "gradient_decompositions", dict)  # the exporter's own nll_loss_backward
    undecomposed = build_graph(model, _mean_loss, layout, model_name="mlp", model_config={})

    result = measure(undecomposed, model, _mean_loss, x, y)

    assert not result.passed
    assert result.ratio > 1000 * TOLERANCE
    assert "the exported graph is wrong for this model" in result.reason


def test_the_same_mean_loss_traced_with_the_decompositions_passes() -> None:
    model, layout, x, y = _mean_loss_case()
    graph = build_graph(model, _mean_loss, layout, model_name="mlp", model_config={})

    result = measure(graph, model, _mean_loss, x, y)

    assert result.passed, result.reason
