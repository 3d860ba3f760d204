"""A model that drops activations at random is refused by name: a tab's masks can never match PyTorch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from crowdtrain.browser.graphs import GraphRefused, build_graph
from crowdtrain.browser.samples import BatchLayout, TensorSpec

LAYOUT = BatchLayout("features", TensorSpec("x", (4, 6), "float32"), TensorSpec("y", (4,), "int64"), 3)


def _loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="sum")


class _DropsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x, 0.2, training=self.training))


def test_a_dropout_layer_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Linear(8, 3))

    with pytest.raises(GraphRefused, match=r"mlp: dropout is on \(layer 1 drops with p=0.1\)") as refused:
        build_graph(model, _loss_sum, LAYOUT, model_name="mlp", model_config={})

    assert "set every dropout of the model to 0" in str(refused.value)


def test_dropout_called_in_forward_is_refused_from_the_traced_graph() -> None:
    with pytest.raises(GraphRefused, match=r"dropout is on \(the graph draws random numbers: aten\."):
        build_graph(_DropsInForward(), _loss_sum, LAYOUT, model_name="custom", model_config={})


def test_a_dropout_layer_that_drops_nothing_is_accepted() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.Linear(8, 3))

    graph = build_graph(model, _loss_sum, LAYOUT, model_name="mlp", model_config={})

    assert graph.manifest.parameters[0].name == "0.weight"
