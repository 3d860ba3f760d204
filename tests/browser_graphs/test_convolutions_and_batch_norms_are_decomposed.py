"""Convolutions (strided, grouped, dilated), overlapping max pools and batch norms in training mode export right.

Their backward operators have no ONNX form or a wrong one; the graph carries
them as forward operators, and a training batch norm normalizes with the
batch's statistics, not as the inference operator would.
"""

from __future__ import annotations

import onnx
import torch
from torch import nn
from torch.nn import functional as F

from crowdtrain.browser.gate import measure
from crowdtrain.browser.graphs import build_graph
from crowdtrain.browser.samples import BatchLayout, TensorSpec

LAYOUT = BatchLayout("pixels", TensorSpec("x", (4, 3, 9, 9), "float32"), TensorSpec("y", (4,), "int64"), 3)


def _loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x / 127.5 - 1.0), y, reduction="sum")


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),  # 9 -> 5
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=1, padding=1),  # overlapping windows: gradients add up at shared maxima
        nn.Conv2d(8, 8, 3, padding=2, dilation=2),
        nn.Conv2d(8, 8, 2, stride=2, groups=2),  # 5 -> 2, and the stride steps over the last row
        nn.Flatten(),
        nn.Linear(32, 3),
    )


def _pixels(layout: BatchLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixels and labels shaped as ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, layout.x.shape, generator=gen).float()
    return x, torch.randint(0, 3, layout.y.shape, generator=gen)


def test_a_small_cnn_in_training_mode_passes_the_gate() -> None:
    model = _small_cnn()
    graph = build_graph(model, _loss_sum, LAYOUT, model_name="cnn", model_config={})
    x, y = _pixels(LAYOUT, seed=1)

    result = measure(graph, model, _loss_sum, x, y)

    assert result.passed, result.reason


def test_the_training_batch_norm_is_not_the_inference_operator() -> None:
    graph = build_graph(_small_cnn(), _loss_sum, LAYOUT, model_name="cnn", model_config={})

    kinds = {node.op_type for node in onnx.load_from_string(graph.onnx).graph.node}

    assert "BatchNormalization" not in kinds
    assert "Conv" in kinds and "ConvTranspose" in kinds


def test_a_batch_norms_wide_graph_is_not_the_sum_of_its_microbatches() -> None:
    """A batch norm normalizes over the batch: four microbatches at once are not four microbatches summed."""
    wide = BatchLayout("pixels", TensorSpec("x", (16, 3, 9, 9), "float32"), TensorSpec("y", (16,), "int64"), 3)
    model = _small_cnn()
    graph = build_graph(model, _loss_sum, wide, model_name="cnn", model_config={})
    x, y = _pixels(wide, seed=2)

    whole = measure(graph, model, _loss_sum, x, y)
    summed = measure(graph, model, _loss_sum, x, y, parts=4)

    assert whole.passed, whole.reason  # the graph is right for a batch of 16
    assert not summed.passed and summed.onnx is not None and summed.onnx.relative > 1e-3, summed.reason
