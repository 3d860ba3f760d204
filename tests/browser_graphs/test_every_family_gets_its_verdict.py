"""Each registry family's gradient graph, exported in a small config, gets the gate's verdict the family should get."""

from __future__ import annotations

import pytest

from crowdtrain.browser.gate import ERROR_FLOOR, TOLERANCE, gate
from crowdtrain.browser.graphs import export_gradient_graph
from crowdtrain.browser.report import SMALL_CONFIGS

# Families whose exported graph matches PyTorch within the gate's tolerance.
PASSING = ["mlp", "gpt", "llama", "gpt2", "resnet", "vit"]


@pytest.mark.parametrize("family", PASSING)
def test_the_familys_graph_passes_the_gate(family: str) -> None:
    config, microbatch = SMALL_CONFIGS[family]
    graph = export_gradient_graph(family, config, microbatch)

    result = gate(graph, family, config)

    assert result.passed, result.reason
    assert result.onnx is not None and result.pytorch is not None
    assert result.onnx.relative <= TOLERANCE * max(result.pytorch.relative, ERROR_FLOOR)
    assert result.reason.startswith(f"{family}: the browser graph's gradients match PyTorch's")
    assert result.sha256 == graph.sha256
