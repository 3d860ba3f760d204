"""Gradient graphs: a registry model's loss and every parameter's gradient for one microbatch shape, as ONNX.

A tab cannot run PyTorch, but it can run a standard ONNX graph (onnxruntime-web).
The site builds the graph once per campaign: it traces the agent's own loss
(``ModelEntry.loss_sum``, the sum over the microbatch of each sample's mean loss)
and its backward with ``make_fx``, every parameter a graph input, so a tab's
gradient is the agent's and a lease computed in a tab sums with the others.
Then ``torch.onnx.export`` writes the traced graph as ONNX.

What the trace must get right, each of which otherwise gives wrong numbers
without an error: backward operators decomposed before the exporter sees them
(``decompositions``), attention traced on PyTorch's math backend (the fused
kernels' backward has no ONNX form), and batch norms in training mode written
out in arithmetic (the exporter writes the inference operator). Dropout is
refused: a tab's random masks can never equal PyTorch's.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from crowdtrain_agent.models import ModelConfigError, get_model

from .decompositions import gradient_decompositions
from .samples import BatchLayout, LayoutUnknown, TensorSpec, batch_layout, synthetic_batch

logger = logging.getLogger(__name__)

# The operator set onnxruntime-web runs and the exporter writes natively (no version conversion).
OPSET = 18

LossSum = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class GraphRefused(ValueError):
    """A model the site will not offer to browser tabs; the message is the reason, for the organizer."""


@dataclass(frozen=True)
class GraphManifest:
    """How a tab feeds a gradient graph and reads its answer.

    Inputs, in order: every parameter (``model.named_parameters()`` order, which
    is the flat vector's, in torch layout), then the microbatch's ``x`` and
    ``y``. Outputs: the loss (the sum over the microbatch of each sample's mean
    loss, as the agent reports it), then each parameter's gradient in the same order.
    """

    model_name: str
    model_config: dict[str, Any]
    microbatch_size: int
    batch_kind: str  # BatchLayout.kind: what x holds
    classes: int  # token ids or labels are below this
    parameters: tuple[TensorSpec, ...]
    x: TensorSpec
    y: TensorSpec
    gradients: tuple[TensorSpec, ...]
    loss: TensorSpec = TensorSpec("loss", (), "float32")
    opset: int = OPSET
    exporter: str = field(default_factory=lambda: f"torch {torch.__version__}")

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (*self.parameters, self.x, self.y)

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (self.loss, *self.gradients)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON-ready data, for the page that will hand it to a tab."""
        return {
            "model_name": self.model_name,
            "model_config": self.model_config,
            "microbatch_size": self.microbatch_size,
            "batch_kind": self.batch_kind,
            "classes": self.classes,
            "opset": self.opset,
            "exporter": self.exporter,
            "inputs": [spec.to_dict() for spec in self.inputs],
            "outputs": [spec.to_dict() for spec in self.outputs],
        }


@dataclass(frozen=True)
class GradientGraph:
    onnx: bytes = field(repr=False)
    sha256: str
    manifest: GraphManifest


def export_gradient_graph(
    model_name: str, model_config: Mapping[str, Any], microbatch_size: int, *, seed: int = 0
) -> GradientGraph:
    """The gradient graph of a registry model for microbatches of ``microbatch_size`` samples.

    Args:
        model_name: the registry's architecture (``"mlp"``, ``"gpt"``, ``"llama"``, ...).
        model_config: its config, as a campaign holds it (defaults are filled in).
        microbatch_size: samples per graph run; the graph's shapes are fixed to it.
        seed: initial weights used as example values while tracing (the graph does not depend on them).

    Returns:
        The ONNX bytes, their SHA-256 and the manifest of inputs and outputs.

    Raises:
        GraphRefused: the model cannot be offered to browsers; the message says why, for the organizer.
    """
    try:
        entry = get_model(model_name)
        config = entry.validate(model_config)
        layout = batch_layout(model_name, config, microbatch_size)
    except (ModelConfigError, LayoutUnknown, ValueError) as error:  # a bad config, shape or microbatch size
        raise GraphRefused(str(error)) from error
    model = entry.build(config, seed=seed)
    return build_graph(model, entry.loss_sum, layout, model_name=model_name, model_config=config)


def build_graph(
    model: nn.Module, loss_sum: LossSum, layout: BatchLayout, *, model_name: str, model_config: dict[str, Any]
) -> GradientGraph:
    """The gradient graph of ``loss_sum(model, x, y)`` for microbatches shaped as ``layout``.

    Raises:
        GraphRefused: naming the cause (dropout, a parameter that is not fp32, an operator with no ONNX form, ...).
    """
    refuse_dropout(model, model_name)
    named = list(model.named_parameters())
    odd = [(name, p.dtype) for name, p in named if p.dtype != torch.float32]
    if odd:
        raise GraphRefused(f"{model_name}: parameter {odd[0][0]} is {odd[0][1]}, and browser graphs take fp32 only")
    clash = {layout.x.name, layout.y.name} & {name for name, _ in named}
    if clash:
        raise GraphRefused(f"{model_name}: a parameter is named {sorted(clash)[0]!r}, as a batch input is")
    manifest = GraphManifest(
        model_name=model_name,
        model_config=dict(model_config),
        microbatch_size=layout.x.shape[0],
        batch_kind=layout.kind,
        classes=layout.classes,
        parameters=tuple(TensorSpec(name, tuple(p.shape), "float32") for name, p in named),
        x=layout.x,
        y=layout.y,
        gradients=tuple(TensorSpec(f"{name}.grad", tuple(p.shape), "float32") for name, p in named),
    )
    x, y = synthetic_batch(layout)
    traced = trace_gradient_graph(model, loss_sum, x, y, label=model_name)
    example = (*(p.detach() for _, p in named), x, y)
    onnx_bytes = _to_onnx(traced, example, manifest)
    logger.info("exported the gradient graph of %s: %d bytes", model_name, len(onnx_bytes))
    return GradientGraph(onnx=onnx_bytes, sha256=hashlib.sha256(onnx_bytes).hexdigest(), manifest=manifest)


def refuse_dropout(model: nn.Module, model_name: str) -> None:
    """Refuse a model with a dropout layer that drops anything.

    Raises:
        GraphRefused: naming the layer and its probability.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise GraphRefused(_dropout_reason(model_name, f"layer {name} drops with p={module.p}"))


def _dropout_reason(model_name: str, where: str) -> str:
    return (
        f"{model_name}: dropout is on ({where}); a tab's random masks cannot match PyTorch's, so its gradients "
        "could not be checked against an agent's: set every dropout of the model to 0 to offer browser compute"
    )


class _LossOf(nn.Module):
    """The agent's loss of ``model`` as a module: ``functional_call`` swaps the graph's inputs in as parameters."""

    def __init__(self, model: nn.Module, loss_sum: LossSum) -> None:
        super().__init__()
        self.model = model
        self.loss_sum = loss_sum

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(self.model, x, y)


def trace_gradient_graph(
    model: nn.Module, loss_sum: LossSum, x: torch.Tensor, y: torch.Tensor, *, label: str = "model"
) -> fx.GraphModule:
    """``(*parameters, x, y) -> (loss, *gradients)`` traced in core ATen operators, on a copy of ``model``.

    The copy is in training mode, as the agent's model is; its batch norms lose
    their running statistics, which changes no output or gradient (training
    normalizes with the batch's) and leaves the graph a pure function, with no
    buffer updated in place.

    Raises:
        GraphRefused: if the model draws random numbers or cannot be traced.
    """
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = copy.deepcopy(model).train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean = module.running_var = module.num_batches_tracked = None
    names = [name for name, _ in model.named_parameters()]
    loss_module = _LossOf(model, loss_sum)

    def gradient_step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = flat[: len(names)]
        # Tied parameters appear once in named_parameters(); functional_call ties the other names to them.
        state = {f"model.{name}": p for name, p in zip(names, params, strict=True)}
        loss = torch.func.functional_call(loss_module, state, (flat[-2], flat[-1]))
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        return (loss, *grads)

    example = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    try:
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            traced = make_fx(gradient_step, decomposition_table=gradient_decompositions())(*example, x, y)
    except Exception as error:  # any failure to trace is a reason to refuse, and the organizer reads it
        raise GraphRefused(
            f"{label}: its forward and backward could not be traced ({cause_of(error)}); browser compute stays off"
        ) from error
    drawn = sorted(
        {str(node.target) for node in traced.graph.nodes if node.op == "call_function" and _draws_random(node.target)}
    )
    if drawn:
        raise GraphRefused(_dropout_reason(label, f"the graph draws random numbers: {', '.join(drawn)}"))
    return traced


def _draws_random(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _to_onnx(traced: fx.GraphModule, example: tuple[torch.Tensor, ...], manifest: GraphManifest) -> bytes:
    label = manifest.model_name
    input_names = [spec.name for spec in manifest.inputs]
    output_names = [spec.name for spec in manifest.outputs]
    traced.eval()  # the graph has no training switch left; this only keeps the exporter from warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                traced,
                example,
                dynamo=True,
                opset_version=OPSET,
                input_names=input_names,
                output_names=output_names,
                verbose=False,
            )
        if program is None:  # only without dynamo=True; kept for the type checker
            raise RuntimeError("torch.onnx.export returned no program")
        proto = program.model_proto
        onnx_bytes: bytes = proto.SerializeToString()
    except Exception as error:  # as in tracing: the organizer reads the cause
        raise GraphRefused(
            f"{label}: its gradient graph could not be written as ONNX ({cause_of(error)}); browser compute stays off"
        ) from error
    got_inputs = [value.name for value in proto.graph.input]
    got_outputs = [value.name for value in proto.graph.output]
    if got_inputs != input_names or got_outputs != output_names:
        raise GraphRefused(
            f"{label}: the exported graph has {len(got_inputs)} inputs and {len(got_outputs)} outputs where "
            f"{len(input_names)} and {len(output_names)} were expected; browser compute stays off"
        )
    return onnx_bytes


def cause_of(error: BaseException) -> str:
    """A line a person can read out of an exporter's long error: the operators it names, else its last line."""
    text = str(error)
    operators = sorted(set(re.findall(r"aten[.:]{1,2}[A-Za-z0-9_]+", text)))
    if operators:
        return f"{type(error).__name__} at {', '.join(operators[:3])}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:240] if lines else 'no message'}"
