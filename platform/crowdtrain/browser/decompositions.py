"""The operator decompositions a traced gradient graph needs before it can be written as standard ONNX.

Backward operators are where exports go wrong silently. The ONNX exporter
translates some of them with functions of its own and decomposes the rest with
PyTorch's table, and at least one such path loses the mean's 1/N of
``nll_loss_backward`` (gradients come out times the batch size). So the graph is
traced already in PyTorch's core ATen operators, with every backward operator
written out in forward ones, and the exporter sees no backward operator at all.
Three that the registry's models use have no decomposition in that table:
``convolution_backward`` and ``_adaptive_avg_pool2d_backward`` (written here),
and ``max_pool2d_with_indices_backward`` (PyTorch's own scatter-add
decomposition, outside the core table). A backward operator left over is
named by the exporter's error, and the model is refused with it. Batch norm's
forward operators are decomposed too: the exporter writes a training batch norm
as ONNX's inference ``BatchNormalization``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten


def gradient_decompositions() -> dict[Any, Callable[..., Any]]:
    """The table ``make_fx`` traces a gradient graph with: the core ATen decompositions and those above."""
    # A plain dict: core_aten_decompositions() is a lazily filled mapping whose own storage is empty.
    table: dict[Any, Callable[..., Any]] = dict(core_aten_decompositions().items())
    table.update(get_decompositions([aten.max_pool2d_with_indices_backward, aten._adaptive_avg_pool2d]))
    batch_norms = [aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
                   aten._native_batch_norm_legit_no_training, aten._batch_norm_with_update]  # fmt: skip
    table.update(get_decompositions(batch_norms))
    table[aten.convolution_backward.default] = convolution_backward
    table[aten._adaptive_avg_pool2d_backward.default] = adaptive_avg_pool2d_backward
    return table


def _per_dim(value: int | Sequence[int], dims: int) -> list[int]:
    """A stride, padding or dilation given once for every spatial dimension, or once for each."""
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    return values * dims if len(values) == 1 else values


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    """The gradients of a (not transposed) convolution, written as convolutions.

    The input's gradient is the transposed convolution of the output's gradient
    with the same weight; ``output_padding`` gives back the rows and columns a
    stride stepped over. The weight's gradient is a convolution too, with batch
    and channels swapped: each input channel becomes an image whose channels are
    the samples, each output channel's gradient a kernel, and stride and dilation
    trade places. A transposed convolution's backward is left alone, and the
    export then names it.
    """
    if transposed:
        return NotImplemented
    dims = weight.dim() - 2
    stride, padding, dilation = (_per_dim(v, dims) for v in (stride, padding, dilation))
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        reached = [
            (grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1
            for i in range(dims)
        ]
        skipped = [input.shape[2 + i] - reached[i] for i in range(dims)]
        grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True, skipped,
                                              groups)  # fmt: skip
    if output_mask[1]:
        in_group, out_group = input.shape[1] // groups, grad_output.shape[1] // groups
        pieces = []
        for g in range(groups):
            images = input[:, g * in_group : (g + 1) * in_group].transpose(0, 1)
            kernels = grad_output[:, g * out_group : (g + 1) * out_group].transpose(0, 1)
            piece = aten.convolution.default(images, kernels, None, dilation, padding, stride, False, [0] * dims, 1)
            # The result covers every offset the input allows, at least the kernel's; the kernel's are the first.
            for i in range(dims):
                piece = piece.narrow(2 + i, 0, kernel[i])
            pieces.append(piece.transpose(0, 1))
        grad_weight = pieces[0] if groups == 1 else torch.cat(pieces, dim=0)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> Any:
    """The input's gradient of an adaptive average pool whose windows tile the input evenly (ResNet's last pool).

    Each input position gets its window's gradient divided by the window's size. Uneven windows are left
    alone, and the export then names the operator.
    """
    (h, w), (out_h, out_w) = input.shape[-2:], grad_output.shape[-2:]
    if h % out_h or w % out_w:
        return NotImplemented
    kh, kw = h // out_h, w // out_w
    lead = list(grad_output.shape[:-2])
    spread = grad_output.reshape(*lead, out_h, 1, out_w, 1).expand(*lead, out_h, kh, out_w, kw)
    return spread.reshape(*lead, h, w) / (kh * kw)
