"""Each slice's torch optimizer, built from the optimizer registry, with weight decay on matrices only.

Terms: a *span* is the part of one model tensor that lies inside a slice
(the slice's elements are spans laid end to end). The aggregator finds the
spans from the model registry's parameter shapes, so it knows which elements
belong to matrices and embeddings (decayed) and which to biases and norm
gains (not decayed, unless the campaign decays every tensor).

Why the decay is not a second param group: the fused kernels round an
element differently in their vector body and in their scalar tail, and a
param group per decay rule would cut the slice where tensors end, so where
an element falls would depend on the slice's bounds. Instead the optimizer
keeps one flat parameter per slice (as the checkpoints store it), runs with
``weight_decay=0``, and a step pre-hook applies the decay span by span with
``mul_`` by a scalar or ``add_(..., alpha=)``: ops that round every element
the same way wherever it lies, and the very ops PyTorch's reference loop
uses. So N slices compose to the full-model step exactly when they did
without weight decay.

The builders here (and LAMB's in ``lamb.py``) are what the registry's
``builder`` paths name; only the aggregator imports them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from crowdtrain_agent.models import get_model
from crowdtrain_agent.optimizers import OptimizerEntry, get_optimizer, hyperparameters_of
from crowdtrain_agent.protocol import SliceAssignment
from crowdtrain_agent.torch_optimizers import decays, torch_optimizer


@dataclass(frozen=True)
class Span:
    """Elements ``start:end`` of the slice belong to one model tensor of ``ndim`` dimensions."""

    start: int
    end: int
    ndim: int
    whole: bool  # the slice holds all of the tensor
    at: tuple[int, int]  # the tensor's own elements in the flat model vector, for messages

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SliceLayout:
    """The model tensors inside one slice and which of them take weight decay."""

    spans: tuple[Span, ...]
    decayed: tuple[bool, ...]  # per span

    @property
    def segments(self) -> list[int]:
        """Element counts of the spans, in order (whole tensors for a per-tensor optimizer)."""
        return [span.size for span in self.spans]

    def decayed_ranges(self) -> list[tuple[int, int]]:
        """Slice ranges that take weight decay: consecutive decayed spans merged."""
        ranges: list[tuple[int, int]] = []
        for span, decayed in zip(self.spans, self.decayed, strict=True):
            if not decayed:
                continue
            if ranges and ranges[-1][1] == span.start:
                ranges[-1] = (ranges[-1][0], span.end)
            else:
                ranges.append((span.start, span.end))
        return ranges


# builder(param, hyperparameters, layout) -> the torch optimizer of one slice; see ``build_adamw``.
Builder = Callable[[torch.nn.Parameter, Mapping[str, Any], SliceLayout], torch.optim.Optimizer]


def tensor_spans(shapes: Sequence[tuple[int, ...]], start: int, end: int) -> list[Span]:
    """The model tensors (of ``shapes``, in flat-vector order) that overlap elements ``start:end``."""
    spans: list[Span] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        low, high = max(offset, start), min(offset + numel, end)
        if low < high:
            whole = low == offset and high == offset + numel
            spans.append(Span(low - start, high - start, len(shape), whole, (offset, offset + numel)))
        offset += numel
    return spans


def decay_rule(spans: Sequence[Span], *, decay_all: bool = False) -> tuple[bool, ...]:
    """Which spans take weight decay: the rule agents' inner optimizers follow too (``decays``)."""
    return tuple(decays(span.ndim, decay_all=decay_all) for span in spans)


def slice_layout(assignment: SliceAssignment, *, decay_all: bool = False) -> SliceLayout:
    """The layout of the assignment's slice, from the model registry's parameter shapes.

    The aggregator derives it from the registry, as it derives the initial
    parameters: the site and the aggregator share one registry (the
    parameter count check in ``initial_params`` catches a mismatch), so the
    assignment message needs no extra field.
    """
    shapes = get_model(assignment.model.architecture).param_shapes(assignment.model.config)
    spans = tensor_spans(shapes, assignment.start, assignment.end)
    return SliceLayout(tuple(spans), decay_rule(spans, decay_all=decay_all))


def require_whole_tensors(assignment: SliceAssignment, layout: SliceLayout, label: str) -> None:
    """Raise ValueError if the slice starts or ends inside a tensor (a per-tensor optimizer needs whole ones)."""
    for span in layout.spans:
        if not span.whole:
            raise ValueError(
                f"campaign {assignment.campaign_id} slice {assignment.slice_index} ({assignment.start}:"
                f"{assignment.end}) cuts the tensor at {span.at[0]}:{span.at[1]}; {label} slices must hold "
                "whole tensors, so the site has to cut slices at tensor boundaries (upgrade the site)"
            )


def slice_segments(assignment: SliceAssignment) -> list[int]:
    """Element counts of the model tensors that lie in elements ``start:end`` of the flat vector.

    Raises:
        ValueError: if the slice starts or ends inside a tensor (LAMB needs whole tensors).
    """
    layout = slice_layout(assignment)
    require_whole_tensors(assignment, layout, "LAMB")
    return layout.segments


def builder_of(entry: OptimizerEntry) -> Builder:
    """Import the builder the registry entry names.

    Raises:
        ValueError: if this aggregator has no such builder (it is older than its registry).
    """
    module_name, _, function = entry.builder.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError):
        raise ValueError(
            f"optimizer {entry.name!r}: this aggregator has no builder {entry.builder!r}; "
            "upgrade crowdtrain-backbone to the version of crowdtrain-agent it runs with"
        ) from None


def build_slice_optimizer(assignment: SliceAssignment, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    """The optimizer of the assignment's slice, built so that slices compose to the full model.

    The learning rate set here is the base rate; ``SliceState.apply_step_``
    sets each step's scheduled rate in every param group.

    Raises:
        OptimizerConfigError: for an optimizer this version does not know, or a hyperparameter out of bounds.
        ValueError: for an optimizer this aggregator cannot build, or a per-tensor one whose slice cuts a tensor.
    """
    entry = get_optimizer(assignment.optimizer.name)
    hyper = hyperparameters_of(assignment.optimizer)
    layout = slice_layout(assignment, decay_all=bool(hyper.get("decay_all", False)))
    if entry.per_tensor:
        require_whole_tensors(assignment, layout, entry.label)
    return builder_of(entry)(param, hyper, layout)


def add_weight_decay(
    optimizer: torch.optim.Optimizer,
    ranges: Sequence[tuple[int, int]],
    weight_decay: float,
    rule: Literal["decoupled", "l2"],
) -> None:
    """Decay elements ``ranges`` of the optimizer's one flat parameter before each step.

    ``decoupled`` (AdamW): ``w *= 1 - lr * weight_decay``, at the step's
    scheduled rate. ``l2`` (SGD): ``g += weight_decay * w``, so the decay
    goes through momentum. Both are the ops of PyTorch's own loops, so a
    plain PyTorch run with one param group per rule reproduces them.
    """
    if weight_decay == 0 or not ranges:
        return

    def decay(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for param in group["params"]:
                flat = param.detach().view(-1)
                if rule == "decoupled":
                    factor = 1 - group["lr"] * weight_decay
                    for start, end in ranges:
                        flat[start:end].mul_(factor)
                elif param.grad is not None:
                    grad = param.grad.view(-1)
                    for start, end in ranges:
                        grad[start:end].add_(flat[start:end], alpha=weight_decay)

    optimizer.register_step_pre_hook(decay)


# ---------------------------------------------------------------------- builders of torch.optim optimizers

# AdamW and SGD run PyTorch's fused kernels: one pass over the slice instead of one per term
# (docs/performance.md, "Fused optimizers"), and less memory traffic next to the agents that share the
# machine. Fused is elementwise, but it rounds the last few elements of its input in a scalar loop: an
# aggregator holding the whole vector and N holding slices agree bit for bit when the cuts fall on
# multiples of the vector width (8 floats with AVX2, 16 with AVX-512).


def build_adamw(param: torch.nn.Parameter, hyper: Mapping[str, Any], layout: SliceLayout) -> torch.optim.Optimizer:
    """AdamW on one slice; decoupled weight decay on the layout's decayed spans."""
    optimizer = torch_optimizer("adamw", [param], hyper, weight_decay=0.0, fused=True)
    add_weight_decay(optimizer, layout.decayed_ranges(), hyper["weight_decay"], "decoupled")
    return optimizer


def build_sgd(param: torch.nn.Parameter, hyper: Mapping[str, Any], layout: SliceLayout) -> torch.optim.Optimizer:
    """SGD with momentum (Nesterov's if asked) on one slice; L2 decay (through the momentum) on the decayed spans."""
    optimizer = torch_optimizer("sgd", [param], hyper, weight_decay=0.0, fused=True)
    add_weight_decay(optimizer, layout.decayed_ranges(), hyper["weight_decay"], "l2")
    return optimizer
