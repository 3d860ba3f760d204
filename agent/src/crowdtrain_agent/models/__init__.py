"""The model registry: the only architectures an agent will ever run.

A campaign names an architecture and its keyword arguments; no code is ever
sent to a volunteer's machine. The server imports this registry too, to
validate campaign configs and count parameters.
"""

from __future__ import annotations

from .exported import export_bytes, load_exported, model_from_flat
from .registry import REGISTRY, ModelConfigError, ModelEntry, get_model, max_text_sample_len

__all__ = [
    "REGISTRY",
    "ModelConfigError",
    "ModelEntry",
    "export_bytes",
    "get_model",
    "load_exported",
    "max_text_sample_len",
    "model_from_flat",
]
