"""The torch optimizers behind the registry's names: one builder for the aggregators' slices and agents' inner steps.

An aggregator applies a sync campaign's optimizer to its slice of the flat
vector (``crowdtrain_backbone.optimizers``); an agent in local mode runs the
inner optimizer on its own copy of the model (``local_steps``). Both build the
torch optimizer here, from the registry's validated hyperparameters, and both
decay the same tensors (``decays``), so an optimizer means one thing wherever
it runs. The registry itself (``optimizers``) stays free of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

# params (tensors or param groups), validated hyperparameters, torch options (fused, weight_decay...).
Maker = Callable[..., torch.optim.Optimizer]


def decays(ndim: int, *, decay_all: bool = False) -> bool:
    """Whether a tensor of ``ndim`` dimensions takes weight decay: nanoGPT's rule (matrices and embeddings)."""
    return decay_all or ndim >= 2


def _adamw(params: Iterable[Any], hyper: Mapping[str, Any], **options: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"], **options
    )


def _sgd(params: Iterable[Any], hyper: Mapping[str, Any], **options: Any) -> torch.optim.Optimizer:
    nesterov = bool(hyper.get("nesterov", False))
    return torch.optim.SGD(params, lr=hyper["lr"], momentum=hyper["momentum"], nesterov=nesterov, **options)


# Elementwise optimizers torch builds; every one can be a local-mode inner optimizer (``INNER_OPTIMIZERS``).
ELEMENTWISE: dict[str, Maker] = {"adamw": _adamw, "sgd": _sgd}


def torch_optimizer(
    name: str, params: Iterable[Any], hyper: Mapping[str, Any], **options: Any
) -> torch.optim.Optimizer:
    """The torch optimizer the registry calls ``name``, over ``params``.

    Args:
        name: an optimizer of ``ELEMENTWISE``.
        params: tensors, or param groups (each may set its own ``weight_decay``).
        hyper: its validated hyperparameters (``optimizers.hyperparameters_of``).
        options: passed to torch as they are (``fused=True``, ``weight_decay=0.0``).

    Raises:
        KeyError: for a name torch does not build here.
    """
    return ELEMENTWISE[name](params, hyper, **options)
