"""LAMB, the layer-wise adaptive large-batch optimizer, for whole tensors and for flat slices of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .optimizers import SliceLayout


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", 2019).

    Per parameter tensor, with gradient ``g`` at step ``t``::

        m = beta1 m + (1 - beta1) g              v = beta2 v + (1 - beta2) g^2
        r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
        u = r + weight_decay * w
        w = w - lr * (||w|| / ||u||) * u          (trust ratio 1 when either norm is 0)

    This is Algorithm 2 of the paper with the identity as the scaling function
    phi. The moments are elementwise; only the trust ratio ``||w|| / ||u||``
    looks at a whole tensor. That is why a *segment* exists: an aggregator
    holds a contiguous slice of the flattened model, one 1-D parameter made of
    several model tensors laid end to end. The param group option
    ``segments`` gives, per parameter of the group, the element counts of the
    tensors inside it (``None`` treats each parameter as one tensor). With
    segments, a slice computes exactly the trust ratios the whole model
    would, so slices compose to one big-machine LAMB step. The option
    ``decayed`` gives, per parameter, one flag per segment: whether that
    tensor takes weight decay (``None``: every one does), so biases and norm
    gains can be left undecayed inside a flat slice.

    PyTorch ships no LAMB (``torch.optim`` has none as of 2.13), hence this class.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        segments: Sequence[Sequence[int] | None] | None = None,
        decayed: Sequence[Sequence[bool] | None] | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "segments": segments,
            "decayed": decayed,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_segments(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            segments = group["segments"] or [None] * len(group["params"])
            decayed = group["decayed"] or [None] * len(group["params"])
            for param, sizes, flags in zip(group["params"], segments, decayed, strict=True):
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
                update = (exp_avg / (1.0 - beta1**t)).div_(denom)
                flat_w, flat_u = param.reshape(-1), update.view(-1)
                sizes = sizes if sizes is not None else [param.numel()]
                flags = flags if flags is not None else [True] * len(sizes)
                offset = 0
                for size, decay in zip(sizes, flags, strict=True):
                    w, u = flat_w[offset : offset + size], flat_u[offset : offset + size]
                    if decay and group["weight_decay"] != 0:
                        u.add_(w, alpha=group["weight_decay"])  # per tensor, as a whole-model step adds it
                    _scale_by_trust_ratio_(w, u)
                    offset += size
                param.add_(update, alpha=-group["lr"])
        return loss


def _scale_by_trust_ratio_(weights: torch.Tensor, update: torch.Tensor) -> None:
    """Multiply one tensor's update by ``||w|| / ||u||`` in place (by 1 when either norm is 0)."""
    w_norm = torch.linalg.vector_norm(weights)
    u_norm = torch.linalg.vector_norm(update)
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    update.mul_(ratio)


def _check_segments(group: dict[str, Any]) -> None:
    segments, decayed = group["segments"], group["decayed"]
    if decayed is not None:
        if segments is None or len(decayed) != len(segments):
            raise ValueError("decayed needs segments, with one list of flags per parameter")
        for sizes, flags in zip(segments, decayed, strict=True):
            if flags is not None and (sizes is None or len(flags) != len(sizes)):
                raise ValueError(f"decayed flags {list(flags)[:8]} must match the segments, one flag per tensor")
    if segments is None:
        return
    if len(segments) != len(group["params"]):
        raise ValueError(f"segments lists {len(segments)} parameters but the group holds {len(group['params'])}")
    for param, sizes in zip(group["params"], segments, strict=True):
        if sizes is not None and (sum(sizes) != param.numel() or any(s <= 0 for s in sizes)):
            raise ValueError(
                f"segments {list(sizes)[:8]} must be positive and add up to the parameter's {param.numel()} elements"
            )


def build_lamb(param: torch.nn.Parameter, hyper: Mapping[str, Any], layout: SliceLayout) -> Lamb:
    """The registry's builder: LAMB on one slice of whole tensors, the layout saying which ones decay."""
    return Lamb(
        [param],
        lr=hyper["lr"],
        betas=(hyper["beta1"], hyper["beta2"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        segments=[layout.segments],
        decayed=[list(layout.decayed)],
    )
