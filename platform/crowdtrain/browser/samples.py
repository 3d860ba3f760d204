"""The microbatch a gradient graph takes (its tensors' names, shapes and types) and a synthetic one to check it with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from crowdtrain_agent.models import get_model


class LayoutUnknown(ValueError):
    """An architecture whose samples browser compute does not know how to shape; the message says which."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a gradient graph, as a tab must feed or read it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy's name ("float32", "int64"), which onnxruntime understands in Python and on the web

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class BatchLayout:
    """What one microbatch of a model holds, as the agent's shard reader gives it.

    ``kind`` says what the inputs are: token ids (``0 <= id < classes``, the
    targets are the inputs shifted by one), feature vectors, or images as 0..255
    pixels in float32 (a tab turns the stored bytes into floats; the graph scales them as
    ``hf.pixels`` does). Targets are class ids below ``classes``.
    """

    kind: Literal["tokens", "features", "pixels"]
    x: TensorSpec
    y: TensorSpec
    classes: int


def batch_layout(model_name: str, model_config: Mapping[str, Any], microbatch_size: int) -> BatchLayout:
    """The microbatch of ``microbatch_size`` samples that ``model_name`` trains on with ``model_config``.

    Raises:
        ModelConfigError: for an unknown architecture or an invalid config.
        LayoutUnknown: for a tensor architecture whose sample shape is not known here.
        ValueError: for a microbatch size below 1.
    """
    if microbatch_size < 1:
        raise ValueError(f"a microbatch holds at least one sample, got {microbatch_size}")
    entry = get_model(model_name)
    config = entry.validate(model_config)
    b = microbatch_size
    if entry.data_kind == "text":
        t = entry.sample_len(config) - 1  # a sample is the context plus the one token it predicts last
        ids = (b, t)
        return BatchLayout("tokens", TensorSpec("x", ids, "int64"), TensorSpec("y", ids, "int64"),
                           entry.vocab_size(config))  # fmt: skip
    if "in_dim" in config:
        return BatchLayout("features", TensorSpec("x", (b, config["in_dim"]), "float32"),
                           TensorSpec("y", (b,), "int64"), config["classes"])  # fmt: skip
    if "image_size" in config:
        side = config["image_size"]
        return BatchLayout("pixels", TensorSpec("x", (b, config["num_channels"], side, side), "float32"),
                           TensorSpec("y", (b,), "int64"), config["num_labels"])  # fmt: skip
    raise LayoutUnknown(
        f"{model_name}: browser compute does not know the shape of this architecture's samples; "
        "give it a layout in crowdtrain/browser/samples.py"
    )


def synthetic_batch(layout: BatchLayout, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic microbatch of ``layout``: valid token ids, labels and pixel values, the same on every machine."""
    gen = torch.Generator().manual_seed(seed)
    if layout.kind == "tokens":
        b, t = layout.x.shape
        tokens = torch.randint(0, layout.classes, (b, t + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if layout.kind == "features":
        x = torch.randn(layout.x.shape, generator=gen)
    else:
        x = torch.randint(0, 256, layout.x.shape, generator=gen).to(torch.float32)
    return x, torch.randint(0, layout.classes, layout.y.shape, generator=gen)
