"""A gradient graph's manifest names its inputs and outputs in the order a tab feeds and reads them."""

from __future__ import annotations

import hashlib

import onnx

from crowdtrain.browser.graphs import OPSET, export_gradient_graph
from crowdtrain_agent.models import get_model

CONFIG = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}


def test_parameters_come_first_in_torch_order_then_the_batch() -> None:
    graph = export_gradient_graph("gpt", CONFIG, 3)

    manifest = graph.manifest
    model = get_model("gpt").build(CONFIG)
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert [(spec.name, spec.shape) for spec in manifest.parameters] == named
    assert [(spec.name, spec.shape, spec.dtype) for spec in (manifest.x, manifest.y)] == [
        ("x", (3, 8), "int64"),
        ("y", (3, 8), "int64"),
    ]
    assert [spec.name for spec in manifest.outputs] == ["loss", *(f"{name}.grad" for name, _ in named)]
    assert manifest.classes == 256 and manifest.batch_kind == "tokens"


def test_the_onnx_model_has_the_manifests_names_and_shapes() -> None:
    graph = export_gradient_graph("mlp", {"in_dim": 6, "hidden": [5], "classes": 3}, 4)

    proto = onnx.load_from_string(graph.onnx)

    assert graph.sha256 == hashlib.sha256(graph.onnx).hexdigest()
    assert [value.name for value in proto.graph.input] == [spec.name for spec in graph.manifest.inputs]
    assert [value.name for value in proto.graph.output] == [spec.name for spec in graph.manifest.outputs]
    shapes = [[d.dim_value for d in value.type.tensor_type.shape.dim] for value in proto.graph.input]
    assert shapes == [list(spec.shape) for spec in graph.manifest.inputs]
    assert any(opset.domain in ("", "ai.onnx") and opset.version == OPSET for opset in proto.opset_import)
    assert graph.manifest.to_dict()["inputs"][-1] == {"name": "y", "shape": [4], "dtype": "int64"}
