"""Exported models: a campaign's parameters as named safetensors tensors plus a JSON config.

The site writes them (``export_bytes``) from the flat parameter vector the
aggregators publish; anyone loads them back into PyTorch with ``load_exported``::

    from crowdtrain_agent.models import load_exported
    model = load_exported("model.safetensors", "config.json")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from safetensors.torch import save as save_safetensors
from torch import nn

from .registry import ModelConfigError, get_model

# Keys of config.json that load_exported needs; the site adds more (version, validation loss, dataset).
REQUIRED_KEYS = ("architecture", "model_config")


def model_from_flat(architecture: str, config: Mapping[str, Any], flat: torch.Tensor) -> nn.Module:
    """The registry's model with its parameters taken from a flat vector in ``model.parameters()`` order.

    Raises:
        ModelConfigError: if the architecture is unknown, the config invalid, or the vector the wrong size.
    """
    model = get_model(architecture).build(config, seed=0)  # a real init, so any buffers hold sane values
    expected = sum(p.numel() for p in model.parameters())
    if flat.dim() != 1 or flat.numel() != expected:
        raise ModelConfigError(
            f"{architecture} with this config has {expected} parameters but the vector holds {flat.numel()}; "
            "the parameters belong to another model config"
        )
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.to(torch.float32), model.parameters())
    return model


def export_bytes(model: nn.Module, metadata: Mapping[str, str] | None = None) -> bytes:
    """The model's state dict as safetensors bytes; a tensor shared by two names is written once."""
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue  # tied weights: load_model restores the alias
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous().clone()
    # "format": "pt" is what transformers' from_pretrained asks of a weights file it loads.
    return save_safetensors(tensors, metadata={"format": "pt", **(metadata or {})})


def load_exported(weights: str | PathLike[str], config: str | PathLike[str] | Mapping[str, Any]) -> nn.Module:
    """Build the registry's model from an exported ``config.json`` and load the ``.safetensors`` weights.

    Args:
        weights: path of the exported ``.safetensors`` file.
        config: path of the exported ``config.json``, or its decoded content.

    Returns:
        The model in eval mode, on the CPU.

    Raises:
        ModelConfigError: if the config lacks a key, names an unknown architecture, or does not match the weights.
    """
    if isinstance(config, Mapping):
        meta = dict(config)
    else:
        meta = json.loads(Path(config).read_text())
    missing = [key for key in REQUIRED_KEYS if key not in meta]
    if missing:
        raise ModelConfigError(
            f"exported config has no {missing[0]!r}; download config.json from the campaign page again"
        )
    model = get_model(meta["architecture"]).build(meta["model_config"], seed=0)
    try:
        load_model(model, str(weights), strict=True)
    except RuntimeError as exc:
        raise ModelConfigError(
            f"{weights} does not fit {meta['architecture']} with config {meta['model_config']}: {exc}"
        ) from None
    return model.eval()
