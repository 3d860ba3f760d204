"""Registry entries: config schema, validation, construction, loss and cost of each architecture."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from ..fields import ConfigError, ConfigField
from . import hf
from .gpt import GPT
from .mlp import MLP

BYTE_VOCAB = hf.BYTE_VOCAB


class ModelConfigError(ConfigError):
    """A campaign's model config that the registry cannot build; ``field`` names the config key, if one is at fault."""


@dataclass(frozen=True)
class ModelEntry:
    """How the platform knows one architecture.

    ``loss_sum`` returns the *sum* over the batch of each sample's mean loss:
    aggregators divide the summed gradient by the step's sample count, which
    makes a global step equal to a mean-loss step on one big machine.
    """

    name: str
    description: str
    data_kind: Literal["text", "tensors"]
    fields: dict[str, ConfigField]
    _build: Callable[[dict[str, Any]], nn.Module]
    _flops_forward: Callable[[dict[str, Any]], int]
    _loss_sum: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    _check: Callable[[dict[str, Any]], None] = field(default=lambda config: None)
    # Text architectures only: the bytes per sample a validated config trains on, and the most any
    # config allows. A text dataset is cut into samples of one such length, so uploads and campaign
    # checks ask these instead of assuming a field of one architecture (GPT's block_size).
    _sample_len: Callable[[dict[str, Any]], int] | None = None
    max_sample_len: int = 0
    # Text architectures whose embedding size is a field can train on a tokenized dataset; the others
    # (the byte-level GPT) only on bytes.
    vocab_field: str = ""

    def __post_init__(self) -> None:
        if self.data_kind == "text" and (self._sample_len is None or self.max_sample_len < 2):
            raise TypeError(f"text architecture {self.name!r} needs _sample_len and a max_sample_len of at least 2")

    def validate(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Fill defaults and check every field.

        Raises:
            ModelConfigError: naming the field, the value, and what is accepted.
        """
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{self.name}: config must be an object, got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.fields))
        if unknown:
            raise ModelConfigError(f"{self.name}: unknown field {unknown[0]!r}; known fields: {', '.join(self.fields)}")
        clean: dict[str, Any] = {}
        for name, spec in self.fields.items():
            value = config.get(name, spec.default)
            clean[name] = spec.check(value, f"{self.name}.{name}", field=name, error=ModelConfigError)
        self._check(clean)
        return clean

    def compact(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` without the fields at their defaults: what peers are sent.

        An older agent or aggregator refuses a field its registry lacks, and fills in a default it knows:
        a field added later at its default would otherwise stop it from training a model it can build.
        """
        clean = self.validate(config)
        return {name: value for name, value in clean.items() if value != self.fields[name].default}

    def build(self, config: Mapping[str, Any], seed: int | None = None) -> nn.Module:
        """Construct the model; with ``seed``, initial weights are the same on every machine."""
        clean = self.validate(config)
        if seed is None:
            return self._build(clean)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._build(clean)

    def param_count(self, config: Mapping[str, Any]) -> int:
        """Number of elements in the flat parameter vector, without allocating it."""
        with torch.device("meta"):
            model = self._build(self.validate(config))
        return sum(p.numel() for p in model.parameters())

    def param_shapes(self, config: Mapping[str, Any]) -> list[tuple[int, ...]]:
        """Shapes of the parameter tensors in flat-vector order (``model.parameters()``), without allocating them.

        The flat vector that aggregators slice is these tensors laid end to end;
        LAMB campaigns cut slices only where one tensor ends and the next begins.
        """
        with torch.device("meta"):
            model = self._build(self.validate(config))
        return [tuple(p.shape) for p in model.parameters()]

    def flops_per_sample(self, config: Mapping[str, Any]) -> int:
        """Forward plus backward cost of one sample (about three forwards)."""
        return 3 * self._flops_forward(self.validate(config))

    def sample_len(self, config: Mapping[str, Any]) -> int:
        """Bytes per sample of a text dataset this model trains on with ``config``.

        Returns:
            The length, at most ``max_sample_len``; 0 for architectures that train on tensor data.

        Raises:
            ModelConfigError: if ``config`` is not valid for this architecture.
        """
        clean = self.validate(config)
        return 0 if self._sample_len is None else int(self._sample_len(clean))

    def loss_sum(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss_sum(model, x, y)

    def vocab_size(self, config: Mapping[str, Any]) -> int:
        """Token ids the model embeds with ``config``: 256 for a byte-level model, 0 for tensor data.

        Raises:
            ModelConfigError: if ``config`` is not valid for this architecture.
        """
        if self.data_kind != "text":
            return 0
        return int(self.validate(config)[self.vocab_field]) if self.vocab_field else BYTE_VOCAB

    def check_vocab(self, config: Mapping[str, Any], dataset_vocab: int) -> None:
        """Refuse a model that cannot embed every id of a tokenized dataset of ``dataset_vocab`` tokens.

        Raises:
            ModelConfigError: naming the vocabulary field and the size it needs.
        """
        if not self.vocab_field:
            raise ModelConfigError(
                f"{self.name} reads bytes and cannot train on a tokenized dataset; choose "
                f"{' or '.join(n for n, e in REGISTRY.items() if e.vocab_field)}, "
                "or upload the text without a tokenizer"
            )
        own = self.vocab_size(config)
        if own < dataset_vocab:
            raise ModelConfigError(
                f"{self.name}.{self.vocab_field} is {own} but the dataset's tokenizer has {dataset_vocab} tokens; "
                f"set {self.vocab_field} to at least {dataset_vocab}",
                self.vocab_field,
            )


# ----------------------------------------------------------------------- gpt

GPT_MAX_BLOCK_SIZE = 8192  # bytes of context


def _gpt_check(config: dict[str, Any]) -> None:
    if config["n_embd"] % config["n_head"]:
        raise ModelConfigError(
            f"gpt.n_embd ({config['n_embd']}) must be divisible by gpt.n_head ({config['n_head']})", "n_embd"
        )


def _gpt_flops(config: dict[str, Any]) -> int:
    n_layer, d, t = config["n_layer"], config["n_embd"], config["block_size"]
    per_token = n_layer * (24 * d * d + 4 * t * d) + 2 * d * 256
    return per_token * t


def _gpt_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum") / y.size(1)


# ----------------------------------------------------------------------- mlp


def _mlp_flops(config: dict[str, Any]) -> int:
    widths = [config["in_dim"], *config["hidden"], config["classes"]]
    return sum(2 * a * b for a, b in pairwise(widths))


def _mlp_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="sum")


# ----------------------------------------------------------------------- transformers families

LM_MAX_BLOCK_SIZE = GPT_MAX_BLOCK_SIZE  # tokens of context; a sample is one more (the shifted target)
MAX_VOCAB = 1 << 20  # token ids a language model here may embed
IMAGE_SIZES = (8, 1024)  # the sides, in pixels, a square image of an image family may have


def _heads_divide(width: str, heads: str) -> Callable[[dict[str, Any]], None]:
    def check(config: dict[str, Any]) -> None:
        if config[width] % config[heads]:
            raise ModelConfigError(f"{width} ({config[width]}) must be divisible by {heads} ({config[heads]})", width)

    return check


def _llama_check(config: dict[str, Any]) -> None:
    _heads_divide("hidden_size", "num_attention_heads")(config)
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ModelConfigError(
            f"num_attention_heads ({config['num_attention_heads']}) must be a multiple of num_key_value_heads "
            f"({config['num_key_value_heads']}): each key/value head serves a group of query heads",
            "num_key_value_heads",
        )


def _vit_check(config: dict[str, Any]) -> None:
    _heads_divide("hidden_size", "num_attention_heads")(config)
    if config["image_size"] % config["patch_size"]:
        raise ModelConfigError(
            f"image_size ({config['image_size']}) must be a multiple of patch_size ({config['patch_size']})",
            "image_size",
        )


def _gpt2_check(config: dict[str, Any]) -> None:
    _heads_divide("n_embd", "n_head")(config)
    if config["n_positions"] and config["n_positions"] < config["block_size"]:
        raise ModelConfigError(
            f"n_positions ({config['n_positions']}) must be at least block_size ({config['block_size']}): "
            "every position of a sample needs an embedding",
            "n_positions",
        )


def _resnet_check(config: dict[str, Any]) -> None:
    if len(config["hidden_sizes"]) != len(config["depths"]):
        raise ModelConfigError(
            f"hidden_sizes has {len(config['hidden_sizes'])} stages and depths {len(config['depths'])}; "
            "give one width and one depth per stage",
            "depths",
        )


_LM_FIELDS = {
    "vocab_size": ConfigField("int", BYTE_VOCAB, BYTE_VOCAB, MAX_VOCAB, "token ids the model knows; 256 for bytes"),
    "block_size": ConfigField("int", 128, 2, LM_MAX_BLOCK_SIZE, "context length in tokens"),
}
_IMAGE_FIELDS = {
    "image_size": ConfigField("int", 32, *IMAGE_SIZES, "width and height of the (square) images, in pixels"),
    "num_channels": ConfigField("int", 3, 1, 4, "colour channels of the images"),
    "num_labels": ConfigField("int", 10, 2, 1 << 20, "classes"),
}

REGISTRY: dict[str, ModelEntry] = {
    "gpt": ModelEntry(
        name="gpt",
        description="Byte-level GPT (decoder-only transformer) for text datasets.",
        data_kind="text",
        fields={
            "n_layer": ConfigField("int", 4, 1, 96, "transformer blocks"),
            "n_head": ConfigField("int", 4, 1, 128, "attention heads per block"),
            "n_embd": ConfigField("int", 128, 8, 16384, "embedding width; a multiple of n_head"),
            "block_size": ConfigField("int", 64, 2, GPT_MAX_BLOCK_SIZE, "context length in bytes"),
        },
        _build=lambda c: GPT(c["n_layer"], c["n_head"], c["n_embd"], c["block_size"]),
        _flops_forward=_gpt_flops,
        _loss_sum=_gpt_loss_sum,
        _check=_gpt_check,
        # A sample is the context plus one byte: the targets are the inputs shifted by one.
        _sample_len=lambda c: c["block_size"] + 1,
        max_sample_len=GPT_MAX_BLOCK_SIZE + 1,
    ),
    "mlp": ModelEntry(
        name="mlp",
        description="Multi-layer perceptron classifier for tensor datasets (x: features, y: class).",
        data_kind="tensors",
        fields={
            "in_dim": ConfigField("int", 256, 1, 1 << 20, "input features"),
            "hidden": ConfigField("int_list", [1024, 1024], 1, 1 << 16, "hidden layer widths"),
            "classes": ConfigField("int", 10, 2, 1 << 20, "output classes"),
        },
        _build=lambda c: MLP(c["in_dim"], c["hidden"], c["classes"]),
        _flops_forward=_mlp_flops,
        _loss_sum=_mlp_loss_sum,
    ),
    "llama": ModelEntry(
        name="llama",
        description="Llama-family decoder from transformers (RoPE, RMSNorm, SwiGLU, grouped-query attention).",
        data_kind="text",
        fields={
            "num_hidden_layers": ConfigField("int", 4, 1, 256, "decoder layers"),
            "hidden_size": ConfigField("int", 256, 8, 32768, "width; a multiple of num_attention_heads"),
            "intermediate_size": ConfigField("int", 688, 8, 131072, "SwiGLU width"),
            "num_attention_heads": ConfigField("int", 4, 1, 256, "query heads"),
            "num_key_value_heads": ConfigField("int", 2, 1, 256, "key/value heads; divides num_attention_heads"),
            "tie_word_embeddings": ConfigField("bool", False, help="share the input and output embeddings"),
            "rms_norm_eps": ConfigField("float", 1e-6, 0.0, 1.0, "RMSNorm's epsilon", open_minimum=True),
            "rope_theta": ConfigField("float", 10000.0, 1.0, 1e9, "RoPE's base"),
            **_LM_FIELDS,
        },
        _build=hf.build_llama,
        _flops_forward=hf.counted_flops(hf.build_llama, hf.token_example, "input_ids"),
        _loss_sum=hf.lm_loss_sum,
        _check=_llama_check,
        _sample_len=lambda c: c["block_size"] + 1,
        max_sample_len=LM_MAX_BLOCK_SIZE + 1,
        vocab_field="vocab_size",
    ),
    "gpt2": ModelEntry(
        name="gpt2",
        description="GPT-2 decoder from transformers (learned positions, tied embeddings).",
        data_kind="text",
        fields={
            "n_layer": ConfigField("int", 4, 1, 256, "transformer blocks"),
            "n_head": ConfigField("int", 4, 1, 256, "attention heads per block"),
            "n_embd": ConfigField("int", 256, 8, 32768, "embedding width; a multiple of n_head"),
            "layer_norm_epsilon": ConfigField("float", 1e-5, 0.0, 1.0, "LayerNorm's epsilon", open_minimum=True),
            "n_positions": ConfigField(
                "int", 0, 0, LM_MAX_BLOCK_SIZE, "learned positions; 0: block_size (pretrained GPT-2 has 1024)"
            ),
            **_LM_FIELDS,
        },
        _build=hf.build_gpt2,
        _flops_forward=hf.counted_flops(hf.build_gpt2, hf.token_example, "input_ids"),
        _loss_sum=hf.lm_loss_sum,
        _check=_gpt2_check,
        _sample_len=lambda c: c["block_size"] + 1,
        max_sample_len=LM_MAX_BLOCK_SIZE + 1,
        vocab_field="vocab_size",
    ),
    "vit": ModelEntry(
        name="vit",
        description="Vision Transformer image classifier from transformers (images as 0..255 pixels, C x H x W).",
        data_kind="tensors",
        fields={
            "patch_size": ConfigField("int", 8, 1, 256, "side of the square patches; divides image_size"),
            "hidden_size": ConfigField("int", 192, 8, 32768, "width; a multiple of num_attention_heads"),
            "num_hidden_layers": ConfigField("int", 4, 1, 256, "encoder layers"),
            "num_attention_heads": ConfigField("int", 3, 1, 256, "attention heads"),
            "intermediate_size": ConfigField("int", 768, 8, 131072, "MLP width"),
            **_IMAGE_FIELDS,
        },
        _build=hf.build_vit,
        _flops_forward=hf.counted_flops(hf.build_vit, hf.image_example, "pixel_values"),
        _loss_sum=hf.image_loss_sum,
        _check=_vit_check,
    ),
    "resnet": ModelEntry(
        name="resnet",
        description="ResNet image classifier from transformers, batch norms frozen (images as 0..255 pixels).",
        data_kind="tensors",
        fields={
            "embedding_size": ConfigField("int", 32, 4, 4096, "channels of the stem"),
            "hidden_sizes": ConfigField("int_list", [32, 64, 128, 256], 4, 16384, "channels of each stage"),
            "depths": ConfigField("int_list", [2, 2, 2, 2], 1, 64, "blocks of each stage"),
            "layer_type": ConfigField("choice", "basic", choices=("basic", "bottleneck"), help="block kind"),
            **_IMAGE_FIELDS,
        },
        _build=hf.build_resnet,
        _flops_forward=hf.counted_flops(hf.build_resnet, hf.image_example, "pixel_values"),
        _loss_sum=hf.image_loss_sum,
        _check=_resnet_check,
    ),
}


def max_text_sample_len() -> int:
    """The longest sample any text architecture here trains on: the most an uploaded text dataset may use."""
    return max((entry.max_sample_len for entry in REGISTRY.values() if entry.data_kind == "text"), default=0)


def get_model(name: str) -> ModelEntry:
    """Look up an architecture by name.

    Raises:
        ModelConfigError: if no such architecture ships with this agent.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown architecture {name!r}; this agent knows {', '.join(sorted(REGISTRY))}. "
            "Upgrade crowdtrain-agent if the campaign needs a newer one."
        ) from None
