"""Pretrained weights an organizer uploads (a ``transformers`` folder, zipped) as a campaign's version 0.

The folder's ``config.json`` names a family the registry builds and the sizes
to build it with; nothing in it runs. Every setting the registry does not
carry must have the value the registry builds with, or the upload is refused
naming it: weights trained with another activation or RoPE scaling would
load and silently compute something else. The weights (one
``model.safetensors`` or an index of several) are checked tensor by tensor
against the shapes the config builds, the first that differs named, and
written as one fp32 vector in the flat order agents and aggregators use,
stored under its sha256; aggregators fetch it to start the campaign from.
A ``tokenizer.json`` beside them is stored as uploaded tokenizers are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, BinaryIO

import numpy as np
import torch
from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage

from crowdtrain_agent.models import REGISTRY, ModelConfigError, get_model
from crowdtrain_agent.models.hf import CONFIGS, FrozenBatchNorm2d
from crowdtrain_agent.models.registry import LM_MAX_BLOCK_SIZE

from .sharding import ProgressFn, store_object
from .tokenizing import TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)

# config.json keys that never change what the model computes from its weights in training (ids of
# special tokens, dtype of the file, dropout: training runs without it, the library's bookkeeping).
IGNORED_KEYS = frozenset(
    {
        "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "bos_token_id",
        "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache", "initializer_range",
        "id2label", "label2id", "attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "summary_type",
        "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "output_hidden_states", "output_attentions",
        "return_dict", "problem_type", "max_position_embeddings", "out_features", "out_indices", "stage_names",
        "pretraining_tp", "classifier_dropout", "head_dim", "tokenizer_class", "task_specific_params",
    }
)  # fmt: skip
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20


class PretrainedError(ValueError):
    """A pretrained folder this platform cannot start a campaign from; the message says what to change."""


@dataclass(frozen=True)
class Converted:
    """What a pretrained folder became: a registry model, its flat fp32 weights and its tokenizer, stored."""

    architecture: str
    config: dict[str, Any]
    param_count: int
    weights_sha256: str
    tokenizer_sha256: str
    labels: list[str]


def record_fields(converted: Converted) -> dict[str, Any]:
    """The ``Pretrained`` row of converted weights, ready to start campaigns from."""
    return {
        "status": "ready",
        "progress": 1.0,
        "error": "",
        "architecture": converted.architecture,
        "model_config": converted.config,
        "param_count": converted.param_count,
        "weights_sha256": converted.weights_sha256,
        "tokenizer_sha256": converted.tokenizer_sha256,
        "labels": converted.labels,
    }


def weights_storage_name(sha256: str) -> str:
    return f"weights/{sha256[:2]}/{sha256}"


# ------------------------------------------------------------------ config.json -> a registry config


def _lm_block(hf: dict[str, Any], key: str) -> int:
    return max(2, min(int(hf.get(key) or 2048), LM_MAX_BLOCK_SIZE))


def _llama(hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or (rope.get("rope_type") or "default") != "default":
        raise PretrainedError(
            "config.json scales RoPE (rope_scaling / rope_type); this registry builds llama with plain RoPE only"
        )
    heads = hf.get("num_attention_heads")
    return {
        "num_hidden_layers": hf.get("num_hidden_layers"),
        "hidden_size": hf.get("hidden_size"),
        "intermediate_size": hf.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        "vocab_size": hf.get("vocab_size"),
        "block_size": _lm_block(hf, "max_position_embeddings"),
    }


def _gpt2(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("n_inner") not in (None, 4 * int(hf.get("n_embd") or 0)):
        raise PretrainedError("config.json sets n_inner; this registry builds GPT-2 with an MLP of 4 x n_embd")
    positions = int(hf.get("n_positions") or 1024)
    return {
        "n_layer": hf.get("n_layer"),
        "n_head": hf.get("n_head"),
        "n_embd": hf.get("n_embd"),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "n_positions": positions,
        "vocab_size": hf.get("vocab_size"),
        "block_size": min(positions, LM_MAX_BLOCK_SIZE),
    }


def _num_labels(hf: dict[str, Any]) -> int:
    return len(hf.get("id2label") or {}) or int(hf.get("num_labels") or 2)


def _vit(hf: dict[str, Any]) -> dict[str, Any]:
    keys = ("image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")  # fmt: skip
    return {**{k: hf.get(k) for k in keys}, "num_labels": _num_labels(hf)}


def _resnet(hf: dict[str, Any]) -> dict[str, Any]:
    keys = ("num_channels", "embedding_size", "hidden_sizes", "depths", "layer_type")
    return {**{k: hf.get(k) for k in keys}, "image_size": 224, "num_labels": _num_labels(hf)}


# model_type of config.json -> (registry family, its config from config.json)
FAMILIES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "llama": ("llama", _llama),
    "gpt2": ("gpt2", _gpt2),
    "vit": ("vit", _vit),
    "resnet": ("resnet", _resnet),
}


def registry_config(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The registry family and config that build the model ``config.json`` describes.

    Raises:
        PretrainedError: for an unknown family, a size out of the registry's bounds, or a setting the
            registry builds otherwise (named, with both values).
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise PretrainedError(
            f"config.json's model_type is {model_type!r}; this platform builds {', '.join(sorted(FAMILIES))}"
        )
    architecture, convert = FAMILIES[model_type]
    raw = {k: v for k, v in convert(hf).items() if v is not None}
    try:
        config = get_model(architecture).validate(raw)
    except ModelConfigError as exc:
        raise PretrainedError(f"config.json: {exc}") from None
    built = CONFIGS[architecture](config).to_dict()
    for key, value in sorted(hf.items()):
        if key in IGNORED_KEYS or key not in built or _same(built[key], value):
            continue
        raise PretrainedError(
            f"config.json sets {key} = {json.dumps(value)[:80]}, and this registry builds {architecture} with "
            f"{json.dumps(built[key])[:80]}; a model trained that way would compute something else here"
        )
    return architecture, config


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return bool(np.isclose(float(ours), float(theirs), rtol=1e-9, atol=0.0))
        except (TypeError, ValueError):
            return False
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs, strict=True))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    return bool(ours == theirs)


# ------------------------------------------------------------------ the folder


class _Folder:
    """The files of a zipped ``transformers`` folder: the one holding ``config.json``, at any depth."""

    def __init__(self, fh: BinaryIO) -> None:
        try:
            self.archive = zipfile.ZipFile(fh)
            names = [n for n in self.archive.namelist() if not n.endswith("/")]
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise PretrainedError(
                f"not a .zip file ({exc}); zip the folder save_pretrained wrote (config.json, model.safetensors)"
            ) from None
        configs = sorted((n for n in names if PurePosixPath(n).name == "config.json"), key=lambda n: n.count("/"))
        if not configs:
            raise PretrainedError("the zip holds no config.json; zip the whole folder save_pretrained wrote")
        self.base = str(PurePosixPath(configs[0]).parent)
        self.names = {str(PurePosixPath(n).relative_to(self.base)) if self.base != "." else n: n for n in names
                      if self.base == "." or n.startswith(self.base + "/")}  # fmt: skip

    def has(self, name: str) -> bool:
        return name in self.names

    def size(self, name: str) -> int:
        """The member's unpacked size as the zip declares it (0 for a member it lacks)."""
        return self.archive.getinfo(self.names[name]).file_size if name in self.names else 0

    def read(self, name: str, limit: int) -> bytes:
        info = self.archive.getinfo(self.names[name])
        if info.file_size > limit:
            raise PretrainedError(f"{name} is {info.file_size} bytes, over the {limit} this platform reads")
        return self.archive.read(info)

    def extract(self, name: str, into: Path) -> Path:
        """A member copied to a file of its own (safetensors maps files, not zip members), streamed."""
        if name not in self.names:
            raise PretrainedError(f"the folder has no {name}, which the weights index names")
        # A name of our own: two parts may share a basename, and none may be the file the vector is written to.
        target = into / f"part-{len(list(into.iterdir()))}.safetensors"
        try:
            with self.archive.open(self.names[name]) as source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
        except (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError, zlib.error) as exc:
            raise PretrainedError(f"{name} cannot be read from the zip ({exc}); zip the folder again") from None
        return target


def _weight_files(folder: _Folder, scratch: Path, budget: int) -> list[Path]:
    """The weight files, copied out of the zip; refused unread when they declare more than ``budget`` bytes.

    A zip declares each member's unpacked size and zipfile reads no further, so a small upload that would
    unpack to far more than the config's model can hold (a zip bomb) never reaches the disk.
    """
    if folder.has(WEIGHTS):
        files = [WEIGHTS]
    elif folder.has(WEIGHTS_INDEX):
        try:
            index = json.loads(folder.read(WEIGHTS_INDEX, MAX_CONFIG_BYTES))
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PretrainedError(f"{WEIGHTS_INDEX} is not a weights index (a weight_map of tensor -> file)") from None
    else:
        files = []
    declared = sum(folder.size(name) for name in files)
    if declared > budget:
        raise PretrainedError(
            f"the weight files unpack to {declared:,} bytes, more than the {budget:,} that config.json's model "
            "holds in fp32; the weights and the config are of different models"
        )
    if files:
        return [folder.extract(name, scratch) for name in files]
    raise PretrainedError(
        f"the folder has no {WEIGHTS} (nor {WEIGHTS_INDEX}); save the model with save_pretrained(..., "
        "safe_serialization=True): .bin pickles are never loaded"
    )


class _Tensors:
    """Every tensor of the weight files by name, read one at a time (the files are memory-mapped)."""

    def __init__(self, stack: ExitStack, files: list[Path]) -> None:
        from safetensors import safe_open

        self.where: dict[str, Any] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own error type for a bad header
                raise PretrainedError(f"{path.name} is not a safetensors file: {str(exc)[:200]}") from None
            for key in handle.keys():  # noqa: SIM118  (a safetensors handle is not a dict)
                self.where[key] = handle

    def find(self, name: str, prefix: str) -> str | None:
        """The file's name for the model's tensor ``name`` (checkpoints of the bare model lack ``prefix.``)."""
        if name in self.where:
            return name
        if prefix and name.startswith(prefix + "."):
            bare = name[len(prefix) + 1 :]
            if bare in self.where:
                return bare
        return None

    def get(self, key: str) -> torch.Tensor:
        try:
            return self.where[key].get_tensor(key)
        except Exception as exc:
            raise PretrainedError(f"tensor {key} cannot be read: {str(exc)[:200]}") from None


# ------------------------------------------------------------------ conversion


def convert(fh: BinaryIO, progress: ProgressFn) -> Converted:
    """Check a zipped ``transformers`` folder and store its weights as a flat fp32 vector (and its tokenizer).

    Raises:
        PretrainedError: naming what is wrong: the family, a setting, the first tensor that differs.
    """
    folder = _Folder(fh)
    try:
        hf = json.loads(folder.read("config.json", MAX_CONFIG_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PretrainedError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise PretrainedError("config.json must hold a JSON object")
    try:
        architecture, config = registry_config(hf)
        labels = [str(v) for _, v in sorted((int(k), v) for k, v in (hf.get("id2label") or {}).items())]
    except (ValueError, TypeError, AttributeError) as exc:
        if isinstance(exc, PretrainedError):
            raise
        raise PretrainedError(
            f"config.json holds a value of the wrong type ({exc}); save it with save_pretrained"
        ) from None
    tokenizer_sha = ""
    if folder.has("tokenizer.json"):
        data = folder.read("tokenizer.json", settings.CROWDTRAIN_MAX_TOKENIZER_BYTES)
        try:
            load_tokenizer(data)
        except TokenizerError as exc:
            raise PretrainedError(f"tokenizer.json: {exc}") from None
        tokenizer_sha = store_object(data)
    with (
        tempfile.TemporaryDirectory(prefix="crowdtrain-pretrained-") as scratch,
        tempfile.TemporaryDirectory(prefix="crowdtrain-flat-") as flat_dir,
        ExitStack() as stack,
    ):
        # fp32 is the widest dtype a checkpoint has; the headers and the index take little next to it.
        budget = 4 * get_model(architecture).param_count(config) + (16 << 20)
        tensors = _Tensors(stack, _weight_files(folder, Path(scratch), budget))
        progress(0.3)
        sha, count = _write_flat(architecture, config, tensors, Path(flat_dir) / "flat.f32",
                                 lambda f: progress(0.3 + 0.7 * f))  # fmt: skip
    logger.info("pretrained %s: %d parameters, weights %s", architecture, count, sha[:12])
    return Converted(architecture, config, count, sha, tokenizer_sha, labels)


def _write_flat(
    architecture: str, config: dict[str, Any], tensors: _Tensors, path: Path, progress: ProgressFn
) -> tuple[str, int]:
    """The file's tensors in the model's parameter order, as little-endian fp32, stored; returns (sha256, count).

    Batch norms: the registry's are frozen at their statistics (mean 0, variance 1 in a fresh model), so a
    pretrained one's statistics are folded into its scale and shift, which then compute the same thing.
    """
    entry = REGISTRY[architecture]
    with torch.device("meta"):
        model = entry.build(config)
    named = list(model.named_parameters())
    frozen = {name: module.eps for name, module in model.named_modules() if isinstance(module, FrozenBatchNorm2d)}
    prefix = getattr(model, "base_model_prefix", "")
    digest = hashlib.sha256()
    count = 0
    with path.open("wb") as out:
        for index, (name, parameter) in enumerate(named):
            key = tensors.find(name, prefix)
            if key is None:
                raise PretrainedError(
                    f"model.safetensors has no tensor {name}, which config.json's {architecture} has; the weights "
                    "and the config are of different models"
                )
            value = tensors.get(key)
            if tuple(value.shape) != tuple(parameter.shape):
                raise PretrainedError(
                    f"tensor {name} is {list(value.shape)} in the weights, but config.json's {architecture} builds "
                    f"{list(parameter.shape)}; the weights and the config are of different models"
                )
            value = value.to(torch.float32)
            owner, _, leaf = name.rpartition(".")
            if owner in frozen:
                value = _folded(tensors, prefix, owner, leaf, value, frozen[owner])
            if not torch.isfinite(value).all():
                raise PretrainedError(f"tensor {name} holds NaN or infinite values")
            data = value.contiguous().numpy()
            data = data.astype("<f4", copy=False) if sys.byteorder == "big" else data
            raw = data.tobytes()
            digest.update(raw)
            out.write(raw)
            count += value.numel()
            progress((index + 1) / len(named))
    sha = digest.hexdigest()
    name = weights_storage_name(sha)
    if not default_storage.exists(name):
        with path.open("rb") as stored:
            default_storage.save(name, File(stored))
    return sha, count


def _folded(tensors: _Tensors, prefix: str, owner: str, leaf: str, value: torch.Tensor, eps: float) -> torch.Tensor:
    stats = []
    for buffer in ("running_mean", "running_var"):
        key = tensors.find(f"{owner}.{buffer}", prefix)
        stats.append(tensors.get(key).to(torch.float32) if key else None)
    mean, var = stats
    if mean is None or var is None:
        return value  # no statistics saved: the fresh ones (0 and 1) are the model's
    if mean.shape != value.shape or var.shape != value.shape:
        raise PretrainedError(
            f"the batch statistics of {owner} are {list(mean.shape)} and {list(var.shape)}, its weights "
            f"{list(value.shape)}; the weights are damaged"
        )
    weight_key = tensors.find(f"{owner}.weight", prefix)
    assert weight_key is not None  # found before its bias, in parameter order
    scale = tensors.get(weight_key).to(torch.float32) * torch.rsqrt(var + eps)
    if leaf == "weight":
        return scale * (1.0 + eps) ** 0.5  # the frozen norm divides by sqrt(1 + eps) at variance 1
    return value - mean * scale


# Config fields that size only an image classifier's head: a campaign may give pretrained weights a new one.
HEAD_FIELDS = ("num_labels",)


def campaign_weights(
    weights_sha256: str, architecture: str, theirs: dict[str, Any], ours: dict[str, Any], seed: int
) -> str:
    """Version 0 of a campaign from pretrained weights whose model differs only in its head: every tensor of
    the same name and shape is the weights', the rest (the classifier for another number of classes) the
    campaign's seeded initialisation. Stored like the weights; returns its sha256 (the weights' own when
    nothing differs).
    """
    entry = REGISTRY[architecture]
    with torch.device("meta"):
        their_model, our_model = entry.build(theirs), entry.build(ours)
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    at = 0
    for name, parameter in their_model.named_parameters():
        offsets[name] = (at, tuple(parameter.shape))
        at += parameter.numel()
    ours_named = list(our_model.named_parameters())
    if all(offsets.get(name, (0, ()))[1] == tuple(p.shape) for name, p in ours_named) and len(ours_named) == len(
        offsets
    ):
        return weights_sha256
    fresh = dict(entry.build(ours, seed=seed).named_parameters())
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-head-") as scratch, open_weights(weights_sha256) as source:
        path = Path(scratch) / "flat.f32"
        with path.open("wb") as out:
            for name, parameter in ours_named:
                place = offsets.get(name)
                if place is not None and place[1] == tuple(parameter.shape):
                    source.seek(place[0] * 4)
                    raw = source.read(parameter.numel() * 4)
                else:
                    raw = fresh[name].detach().contiguous().numpy().astype("<f4").tobytes()
                digest.update(raw)
                out.write(raw)
        sha = digest.hexdigest()
        name = weights_storage_name(sha)
        if not default_storage.exists(name):
            with path.open("rb") as stored:
                default_storage.save(name, File(stored))
    return sha


def open_weights(sha256: str) -> IO[bytes]:
    """The stored flat fp32 weights of ``sha256`` (aggregators stream them from the site)."""
    return default_storage.open(weights_storage_name(sha256), "rb")


def flat_weights(sha256: str) -> torch.Tensor:
    """The whole stored vector, for tests and small models; aggregators stream theirs."""
    with open_weights(sha256) as fh:
        return torch.from_numpy(np.frombuffer(fh.read(), dtype="<f4").astype(np.float32))
