"""The gate: before the site offers browser compute for a model, its gradient graph must match PyTorch.

The graph runs in onnxruntime (the CPU provider on one thread, the nearest
thing to a tab's wasm provider) on a synthetic microbatch, with the same
parameters as a PyTorch fp32 run, the agent's computation, and both are
measured against an fp64 run of the same model. fp32 is never exact, so the
bar is PyTorch's own error: the graph passes when its error is at most
``TOLERANCE`` times PyTorch's. A wrongly exported graph (a lost 1/N, an
inference batch norm, a wrong operator) is off by far more than that.

The error of one computation is the largest, over the loss and each
parameter's gradient, of the norm of the difference from fp64 divided by the
norm of the fp64 value. A tensor whose gradient is tiny next to the whole
gradient is measured against ``GRADIENT_FLOOR`` of the whole gradient's norm
instead, so rounding in a near-zero tensor does not decide the verdict, and
PyTorch's error counts as at least ``ERROR_FLOOR``, so a lucky, tiny fp32
error does not make the gate impossible to pass.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from crowdtrain_agent.models import get_model

from .graphs import GradientGraph, GraphRefused, LossSum, cause_of, export_gradient_graph
from .samples import batch_layout, synthetic_batch

# The graph's error may be this many times PyTorch fp32's own.
TOLERANCE = 10.0
# PyTorch's error counts as at least this: about eight units in the last place of fp32 at 1.0.
ERROR_FLOOR = 1e-6
# A tensor's error is relative to at least this share of the whole gradient's norm.
GRADIENT_FLOOR = 1e-3


@dataclass(frozen=True)
class Deviation:
    """How far one fp32 computation of the loss and gradients lies from the fp64 reference."""

    relative: float  # the gate's error measure (module docstring); inf for NaN or infinite values
    max_abs: float  # the largest elementwise difference, over the loss and every gradient
    worst: str  # the output where ``relative`` is reached: "loss" or "<parameter>.grad"


@dataclass(frozen=True)
class GateResult:
    """The verdict on offering browser compute for one model; ``reason`` is for the organizer, pass or fail."""

    model_name: str
    passed: bool
    reason: str
    onnx: Deviation | None  # None when there was no graph to run, or onnxruntime could not run it
    pytorch: Deviation | None
    ratio: float  # onnx.relative / pytorch.relative; inf without a measurement
    limit: float = math.inf  # the most onnx.relative may be: TOLERANCE times PyTorch's, at least ERROR_FLOOR's
    sha256: str = ""  # the graph's, when there was one


def check_browser_compute(
    model_name: str, model_config: Mapping[str, Any], microbatch_size: int, *, seed: int = 0
) -> tuple[GradientGraph | None, GateResult]:
    """Export the model's gradient graph and gate it: what the site does when a campaign starts.

    Returns:
        The graph (None when it was refused) and the verdict, whose reason the organizer sees.
    """
    return _export_and_gate(model_name, model_config, microbatch_size, seed=seed, parts=1)


def check_wide(
    model_name: str, model_config: Mapping[str, Any], microbatch_size: int, microbatches: int, *, seed: int = 0
) -> tuple[GradientGraph | None, GateResult]:
    """Export and gate the graph of ``microbatches`` microbatches a run, against what they sum to in PyTorch.

    A tab runs it in place of that many runs of the microbatch's graph, so it
    must compute the sum of their losses and gradients: the reference is the
    agent's, microbatch by microbatch. A model whose samples meet in a batch (a
    batch norm normalizes over it) computes something else on a wider batch,
    and fails here: it is then offered the microbatch's graph alone.
    """
    size = microbatch_size * microbatches
    return _export_and_gate(model_name, model_config, size, seed=seed, parts=microbatches)


def _export_and_gate(
    model_name: str, model_config: Mapping[str, Any], size: int, *, seed: int, parts: int
) -> tuple[GradientGraph | None, GateResult]:
    try:
        graph = export_gradient_graph(model_name, model_config, size, seed=seed)
    except GraphRefused as refusal:
        return None, GateResult(model_name, False, str(refusal), None, None, math.inf)
    return graph, gate(graph, model_name, model_config, seed=seed, parts=parts)


def gate(
    graph: GradientGraph,
    model_name: str,
    model_config: Mapping[str, Any],
    *,
    seed: int = 0,
    tolerance: float = TOLERANCE,
    parts: int = 1,
) -> GateResult:
    """Run ``graph`` in onnxruntime and PyTorch fp32 against fp64, and decide whether browsers may use it.

    Args:
        graph: the exported gradient graph of ``model_name`` with ``model_config``.
        model_name: the registry's architecture.
        model_config: its config, as the campaign holds it.
        seed: the parameters are the model's initial ones with this seed; the microbatch uses ``seed + 1``.
        tolerance: how many times PyTorch's own error the graph's may be.
        parts: PyTorch computes the graph's batch as this many equal microbatches, summed.

    Returns:
        The verdict with both measurements; a failure's reason names the cause.

    Raises:
        ValueError: if the graph was exported for another model or config (a caller's mistake, not a verdict).
    """
    entry = get_model(model_name)
    config = entry.validate(model_config)
    manifest = graph.manifest
    if manifest.model_name != model_name or manifest.model_config != config:
        raise ValueError(
            f"the graph was exported for {manifest.model_name} {manifest.model_config}, not {model_name} {config}"
        )
    x, y = synthetic_batch(batch_layout(model_name, config, manifest.microbatch_size), seed + 1)
    model = entry.build(config, seed=seed)
    return measure(graph, model, entry.loss_sum, x, y, tolerance=tolerance, parts=parts)


def measure(
    graph: GradientGraph,
    model: nn.Module,
    loss_sum: LossSum,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    tolerance: float = TOLERANCE,
    parts: int = 1,
) -> GateResult:
    """The gate on any model: ``graph`` against ``loss_sum(model, x, y)`` in fp32 and fp64, with ``model``'s parameters.

    With ``parts`` above 1, PyTorch's side is the sum over that many equal microbatches of the batch.

    Returns:
        The verdict; a failure's reason names the cause.
    """
    model_name = graph.manifest.model_name
    model = model.train()  # training mode, as the agent computes
    names = [spec.name for spec in graph.manifest.gradients]
    pieces = _split(x, y, parts)
    reference = _summed([fp64_gradients(model, loss_sum, xs, ys) for xs, ys in pieces])
    pytorch = deviation(names, _summed([_gradients(model, loss_sum, xs, ys) for xs, ys in pieces]), reference)
    try:
        onnx = deviation(names, run_graph(graph, [p.detach() for p in model.parameters()], x, y), reference)
    except Exception as error:  # onnxruntime refuses the graph: the organizer reads the cause
        reason = (
            f"{model_name}: onnxruntime could not run the gradient graph ({cause_of(error)}); browser compute stays off"
        )
        return GateResult(model_name, False, reason, None, pytorch, math.inf, sha256=graph.sha256)

    ratio = onnx.relative / max(pytorch.relative, 1e-300)
    limit = tolerance * max(pytorch.relative, ERROR_FLOOR)
    passed = math.isfinite(onnx.relative) and onnx.relative <= limit
    reason = _reason(model_name, onnx, pytorch, ratio, limit, tolerance)
    return GateResult(model_name, passed, reason, onnx, pytorch, ratio, limit, graph.sha256)


def _reason(model_name: str, onnx: Deviation, pytorch: Deviation, ratio: float, limit: float, tolerance: float) -> str:
    if not math.isfinite(onnx.relative):
        return (
            f"{model_name}: the exported graph gives NaN or infinite values at {onnx.worst} where PyTorch's are "
            "finite: the exported graph is wrong for this model; browser compute stays off"
        )
    bar = (
        f"ratio {ratio:.3g}; the bar is {limit:.1e}: {tolerance:g}x PyTorch's error, counted as at least "
        f"{ERROR_FLOOR:.0e}"
    )
    if onnx.relative <= limit:
        return (
            f"{model_name}: the browser graph's gradients match PyTorch's: {onnx.relative:.1e} from its fp64 "
            f"reference at worst ({onnx.worst}), where PyTorch fp32 is {pytorch.relative:.1e} from it ({bar})"
        )
    return (
        f"{model_name}: gradients differ from PyTorch's fp64 reference by {onnx.relative:.1e} at {onnx.worst} "
        f"(PyTorch's own fp32 error: {pytorch.relative:.1e}; {bar}): the exported graph is wrong for this model; "
        "browser compute stays off"
    )


Outputs = tuple[float, list[np.ndarray]]


def deviation(names: Sequence[str], got: Outputs, reference: Outputs) -> Deviation:
    """The gate's measure of ``got`` (loss, gradients) against ``reference``, gradients named as ``names``."""
    loss, grads = got
    ref_loss, ref_grads = reference
    total = math.sqrt(sum(float(np.sum(np.square(r))) for r in ref_grads))
    floor = max(GRADIENT_FLOOR * total, 1e-30)
    worst, relative = "loss", _finite_or_inf(abs(loss - ref_loss) / max(abs(ref_loss), 1e-30))
    max_abs = _finite_or_inf(abs(loss - ref_loss))
    for name, grad, ref in zip(names, grads, ref_grads, strict=True):
        diff = np.asarray(grad, dtype=np.float64) - ref
        error = _finite_or_inf(float(np.linalg.norm(diff)) / max(float(np.linalg.norm(ref)), floor))
        max_abs = max(max_abs, _finite_or_inf(float(np.max(np.abs(diff)))) if diff.size else 0.0)
        if error > relative:
            worst, relative = name, error
    return Deviation(relative=relative, max_abs=max_abs, worst=worst)


def _split(x: torch.Tensor, y: torch.Tensor, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if parts < 1 or x.shape[0] % parts:
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into {parts} equal microbatches")
    return list(zip(x.chunk(parts), y.chunk(parts), strict=True))


def _summed(outputs: Sequence[Outputs]) -> Outputs:
    """The loss and gradients of several microbatches added up, in the order computed, as the agent adds them."""
    loss, grads = outputs[0]
    grads = [np.array(g, copy=True) for g in grads]
    for more_loss, more_grads in outputs[1:]:
        loss += more_loss
        for into, grad in zip(grads, more_grads, strict=True):
            into += grad
    return loss, grads


def _finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else math.inf


def _gradients(model: nn.Module, loss_sum: LossSum, x: torch.Tensor, y: torch.Tensor) -> Outputs:
    params = list(model.parameters())
    with torch.enable_grad():
        loss = loss_sum(model, x, y)
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return float(loss.detach().double()), [g.detach().to(torch.float64).numpy() for g in grads]


class _Float64(TorchFunctionMode):
    """Keeps a float64 computation in float64 where model code asks for float32.

    Library models cast to float32 on purpose (RMSNorm's variance, rotary
    tables, softmax in ``dtype=torch.float32``, ``hf.pixels``); in the reference
    those casts would round it back to fp32 exactly where the fp32 runs round.
    """

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if func == torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def fp64_gradients(model: nn.Module, loss_sum: LossSum, x: torch.Tensor, y: torch.Tensor) -> Outputs:
    """The loss and gradients of a float64 copy of ``model``, on the math attention backend: the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wide = copy.deepcopy(model).double()
    x = x.double() if x.is_floating_point() else x
    with _Float64(), sdpa_kernel(SDPBackend.MATH):
        return _gradients(wide, loss_sum, x, y)


def run_graph(graph: GradientGraph, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Outputs:
    """The loss and gradients the graph computes in onnxruntime's CPU provider on one thread."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: a graph it runs is not news
    session = onnxruntime.InferenceSession(graph.onnx, sess_options=options, providers=["CPUExecutionProvider"])
    manifest = graph.manifest
    values = [*params, x, y]
    feed = {spec.name: np.ascontiguousarray(value.numpy(), dtype=spec.dtype)
            for spec, value in zip(manifest.inputs, values, strict=True)}  # fmt: skip
    loss, *grads = session.run([spec.name for spec in manifest.outputs], feed)
    return float(np.asarray(loss, dtype=np.float64)), [np.asarray(g) for g in grads]
