"""Architectures from Hugging Face ``transformers``, built from configuration only.

A campaign names a family and a few sizes; the agent builds the library's own
model class from them (never ``trust_remote_code``, never code from a
campaign). Every device must build the same parameters in the same order, so
the agent pins the library (``TRANSFORMERS_VERSION``, the version its package
requires) and refuses to train with another. Dropout is off in every family:
two volunteers computing one lease must get the same gradient (verification),
and a step must equal the same step on one machine.

``transformers`` is imported on first use only: it takes seconds, and the site,
the aggregators and the byte-level demo never need it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TRANSFORMERS_VERSION = "5.23.0"
BYTE_VOCAB = 256  # a text dataset's samples are bytes until it is tokenized: ids 0..255


class LibraryMismatch(RuntimeError):
    """The installed ``transformers`` is not the version every device of a campaign builds its model with."""


_resolving = threading.RLock()
_classes: dict[str, Any] = {}


def library(name: str) -> Any:
    """A class of the pinned ``transformers`` (``"LlamaForCausalLM"``), resolved once, under a lock.

    The library resolves its names lazily on first access, and two threads of a site process resolving
    the same name at once saw ``module 'transformers' has no attribute 'LlamaForCausalLM'``.
    """
    with _resolving:
        if name not in _classes:
            _classes[name] = getattr(transformers_module(), name)
        return _classes[name]


@functools.cache
def transformers_module() -> Any:
    """The pinned ``transformers``, imported once (callers use ``library``).

    Raises:
        LibraryMismatch: another version is installed; the message says how to fix it.
    """
    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise LibraryMismatch(
            f"this agent builds models with transformers {TRANSFORMERS_VERSION}, and {transformers.__version__} "
            f"is installed; every device of a campaign must build the same parameters: "
            f"pip install transformers=={TRANSFORMERS_VERSION}"
        )
    return transformers


# ------------------------------------------------------------------ language models


def llama_config(c: dict[str, Any]) -> Any:
    """The ``LlamaConfig`` of a validated config: RoPE, RMSNorm, SwiGLU and grouped-query attention."""
    return library("LlamaConfig")(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        max_position_embeddings=c["block_size"],
        tie_word_embeddings=c["tie_word_embeddings"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_llama(c: dict[str, Any]) -> nn.Module:
    return library("LlamaForCausalLM")(llama_config(c))


def gpt2_config(c: dict[str, Any]) -> Any:
    """The ``GPT2Config``: learned positions, LayerNorm, GELU MLP, tied input and output embeddings."""
    return library("GPT2Config")(
        vocab_size=c["vocab_size"],
        n_positions=c["n_positions"] or c["block_size"],
        layer_norm_epsilon=c["layer_norm_epsilon"],
        n_embd=c["n_embd"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_gpt2(c: dict[str, Any]) -> nn.Module:
    return library("GPT2LMHeadModel")(gpt2_config(c))


def lm_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's mean next-token loss, summed over the batch (``ModelEntry.loss_sum``)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum") / y.size(1)


# ------------------------------------------------------------------ image classifiers


def vit_config(c: dict[str, Any]) -> Any:
    return library("ViTConfig")(
        image_size=c["image_size"],
        patch_size=c["patch_size"],
        num_channels=c["num_channels"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        num_labels=c["num_labels"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def build_vit(c: dict[str, Any]) -> nn.Module:
    return library("ViTForImageClassification")(vit_config(c))


def resnet_config(c: dict[str, Any]) -> Any:
    return library("ResNetConfig")(
        num_channels=c["num_channels"],
        embedding_size=c["embedding_size"],
        hidden_sizes=c["hidden_sizes"],
        depths=c["depths"],
        layer_type=c["layer_type"],
        num_labels=c["num_labels"],
    )


def build_resnet(c: dict[str, Any]) -> nn.Module:
    """A ResNet whose batch norms are frozen (see ``FrozenBatchNorm2d``)."""
    return freeze_batch_norms(library("ResNetForImageClassification")(resnet_config(c)))


class FrozenBatchNorm2d(nn.Module):
    """A batch norm that normalizes with its stored statistics, in training too; its scale and shift train.

    Batch statistics would make a gradient depend on which samples share a
    microbatch: the sum of a step's microbatch gradients would no longer be the
    step's gradient, and a verification copy computed in other company would
    differ. The statistics are buffers, which no aggregator holds. Names match
    ``nn.BatchNorm2d``'s, so an export loads into the library's own class.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


def freeze_batch_norms(model: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` in place, keeping its name (and the parameters' order)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, child.eps)
            with torch.no_grad():
                frozen.weight.copy_(child.weight)
                frozen.bias.copy_(child.bias)
            setattr(model, name, frozen)
        else:
            freeze_batch_norms(child)
    return model


def pixels(x: torch.Tensor) -> torch.Tensor:
    """Image samples as stored (0..255, uint8 or float) to the model's input range, -1..1."""
    return x.to(torch.float32) / 127.5 - 1.0


def image_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(pixel_values=pixels(x)).logits, y, reduction="sum")


# ------------------------------------------------------------------ cost


def counted_flops(build: Callable[[dict[str, Any]], nn.Module], example: Callable[[dict[str, Any]], torch.Tensor],
                  keyword: str) -> Callable[[dict[str, Any]], int]:  # fmt: skip
    """Forward FLOPs of one sample, counted by PyTorch on the meta device (no memory, no arithmetic)."""

    @functools.lru_cache(maxsize=64)
    def count(frozen: str) -> int:
        from torch.utils.flop_counter import FlopCounterMode

        config = json.loads(frozen)
        counter = FlopCounterMode(display=False)
        # One count at a time: the site's threads may all read a new campaign at once, and the library's
        # first use imports parts of itself lazily (see ``library``).
        with _resolving, torch.device("meta"), counter:
            build(config)(**{keyword: example(config)})
        return int(counter.get_total_flops())

    return lambda config: count(json.dumps(config, sort_keys=True))


def token_example(c: dict[str, Any]) -> torch.Tensor:
    return torch.zeros((1, c["block_size"]), dtype=torch.long)


def image_example(c: dict[str, Any]) -> torch.Tensor:
    return torch.zeros((1, c["num_channels"], c["image_size"], c["image_size"]))


# ------------------------------------------------------------------ export

# The library config of each family, for an export that ``from_pretrained`` loads.
CONFIGS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "llama": llama_config,
    "gpt2": gpt2_config,
    "vit": vit_config,
    "resnet": resnet_config,
}


def byte_tokenizer() -> Any:
    """A tokenizer whose ids are the bytes themselves (0..255), as a byte-level text campaign trains on.

    Byte-level pre-tokenization writes each byte as one printable character (GPT-2's table, as the library
    keeps it); each such character's id is the byte it stands for, and there are no merges.
    """
    transformers_module()  # the pinned version, before anything of it is imported
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return library("PreTrainedTokenizerFast")(tokenizer_object=tokenizer)


def pretrained_files(
    architecture: str, config: dict[str, Any], *, tokenizer_json: bytes | None = None, labels: list[str] | None = None
) -> dict[str, bytes]:
    """The files beside ``model.safetensors`` that make a ``transformers`` folder of this model.

    ``config.json`` always. A language model gets the tokenizer its samples
    were made with: ``tokenizer_json`` (the dataset's ``tokenizer.json``), or
    the byte tokenizer of a byte-level dataset, so ``AutoTokenizer`` encodes
    prompts as training did. An image classifier gets its class names
    (``labels``) and a processor that scales pixels as training did, so
    ``pipeline("image-classification")`` works too. Empty for families that are
    not the library's.
    """
    make = CONFIGS.get(architecture)
    if make is None:
        return {}
    library_config = make(config)
    if architecture == "resnet":
        library_config.architectures = ["ResNetForImageClassification"]
    if labels:
        library_config.id2label = dict(enumerate(labels))
        library_config.label2id = {name: i for i, name in enumerate(labels)}
    files = {"config.json": library_config.to_json_string().encode()}
    if architecture in ("llama", "gpt2"):
        files.update(_saved(lm_tokenizer(tokenizer_json)))
    else:
        processor = library("ViTImageProcessor")(
            do_resize=True,
            size={"height": config["image_size"], "width": config["image_size"]},
            image_mean=[0.5] * config["num_channels"],  # (x / 255 - 0.5) / 0.5 = x / 127.5 - 1: ``pixels``
            image_std=[0.5] * config["num_channels"],
        )
        files.update(_saved(processor))
    return files


def lm_tokenizer(tokenizer_json: bytes | None) -> Any:
    """The ``PreTrainedTokenizerFast`` of a dataset's ``tokenizer.json``, its end-of-text token named; bytes if None."""
    if tokenizer_json is None:
        return byte_tokenizer()
    transformers_module()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    end = next((t for t in END_TOKENS if tokenizer.token_to_id(t) is not None), None)
    return library("PreTrainedTokenizerFast")(tokenizer_object=tokenizer, eos_token=end)


# Tokens that end a text in common tokenizers; the first one a tokenizer has is its end-of-text token.
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def _saved(thing: Any) -> dict[str, bytes]:
    """The files ``thing.save_pretrained`` writes, by name."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        thing.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
