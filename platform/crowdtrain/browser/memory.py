"""What a tab needs in memory to run a campaign's gradient graphs: the figure the page compares with what it may use."""

from __future__ import annotations

import math
from collections.abc import Iterable

import onnx
from onnx import TensorProto, ValueInfoProto

_ITEMSIZE: dict[int, int] = {
    TensorProto.FLOAT: 4,
    TensorProto.INT64: 8,
    TensorProto.INT32: 4,
    TensorProto.BOOL: 1,
    TensorProto.DOUBLE: 8,
    TensorProto.FLOAT16: 2,
    TensorProto.BFLOAT16: 2,
    TensorProto.UINT8: 1,
    TensorProto.INT8: 1,
}


def tensor_bytes(values: Iterable[ValueInfoProto]) -> int:
    """The bytes of every value with a known shape; a dimension left symbolic counts as 1."""
    total = 0
    for value in values:
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        dims = [dim.dim_value if dim.HasField("dim_value") else 1 for dim in tensor.shape.dim]
        total += math.prod(dims) * _ITEMSIZE.get(tensor.elem_type, 4)
    return total


def graph_memory(onnx_bytes: bytes) -> tuple[int, int, int]:
    """The bytes of a graph's inputs, its outputs and its intermediate values, from ONNX shape inference.

    The intermediates are counted as if every one stayed alive for the whole run: onnxruntime frees
    and reuses buffers, so a tab needs less; an upper bound, never a guess that is too small.
    """
    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(onnx_bytes))
    graph = model.graph
    return tensor_bytes(graph.input), tensor_bytes(graph.output), tensor_bytes(graph.value_info)


def memory_bytes(graph: bytes, graph_one: bytes | None, graph_wide: bytes | None = None) -> int:
    """What a tab holds to compute a lease: the estimate ``GET /api/campaigns/<id>/browser/`` answers.

    Why this sum: the tab keeps an onnxruntime session of each graph (the
    microbatch's and, for a lease's last partial microbatch, the single
    sample's), each with the graph's bytes; it feeds the parameters and the
    microbatch (the graph's inputs) and gets the loss and every gradient back
    (its outputs), which it adds into the lease's gradient (the outputs once
    more); and the run allocates the intermediate values (activations and the
    backward's temporaries), counted from shape inference as if none were freed
    (``graph_memory``). So about three times the parameters' fp32 bytes plus
    the activations. The single-sample and wide graphs share the parameters
    and the gradient the tab already holds: only their bytes, their batch's
    inputs and their intermediates add. It leaves out the runtime itself (a
    few MB of wasm).
    """
    inputs, outputs, intermediates = graph_memory(graph)
    total = len(graph) + inputs + 2 * outputs + intermediates
    for other in (graph_one, graph_wide):
        if other is not None:
            other_inputs, _, other_intermediates = graph_memory(other)
            total += len(other) + max(0, other_inputs - inputs) + other_intermediates
    return total
