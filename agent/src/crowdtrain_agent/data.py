"""Shard formats: how content-addressed shards lay out their samples, and how they are read back.

The site's sharding (``crowdtrain.datasets.sharding``) writes shards in these
formats, streaming; agents and the site's referee read them with ``ShardReader``.

- text: raw bytes, ``sample_len`` bytes per sample. A byte-level language
  model reads inputs ``s[:-1]`` and targets ``s[1:]``.
- tensors: a safetensors file with ``x`` (features) and ``y`` (labels), one
  row per sample. safetensors rather than ``.npz``: it is deterministic (the
  same rows give the same bytes, hence the same sha256) and loads no pickle.
- tokens: token ids of a tokenized text, little-endian unsigned integers of
  ``token_bytes`` (2 while the vocabulary fits, else 4), ``sample_len`` ids
  per sample, read like text. The tokenizer that made them travels beside
  them (``check_tokenizer``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from safetensors.numpy import load as load_safetensors

from .protocol import DataSpec, ProtocolError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token_dtype(token_bytes: int) -> np.dtype:
    """The stored type of a token id: the narrowest of uint16 and uint32 its shards use.

    Raises:
        ProtocolError: for any other width.
    """
    if token_bytes not in (2, 4):
        raise ProtocolError(f"token shards hold 2- or 4-byte ids, not {token_bytes}-byte ones")
    return np.dtype("<u2" if token_bytes == 2 else "<u4")


def token_bytes_for(vocab_size: int) -> int:
    """Bytes per stored id of a vocabulary of ``vocab_size`` tokens."""
    return 2 if vocab_size <= 1 << 16 else 4


def check_tokenizer(spec: DataSpec, tokenizer_json: bytes) -> int:
    """Parse the ``tokenizer.json`` a token dataset names and check it matches the lease; returns its vocabulary.

    The agent trains on ids, not text, but a campaign whose shards, tokenizer
    and model disagree trains a model nobody can use: it is refused before
    any compute.

    Raises:
        ProtocolError: if the file is not a tokenizer or its vocabulary differs from the lease's.
    """
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # the library raises its own exception type for a malformed file
        raise ProtocolError(
            f"tokenizer {spec.tokenizer[:12]} is not a tokenizer.json the library reads: {exc}"
        ) from None
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab != spec.vocab_size:
        raise ProtocolError(
            f"tokenizer {spec.tokenizer[:12]} has {vocab} tokens but the lease says {spec.vocab_size}; "
            "the site's dataset and its tokenizer disagree, the lease is given back"
        )
    return vocab


class ShardReader:
    """A shard checked and decoded once, read many times.

    Agents read many leases from the same few shards; parsing a safetensors
    file per lease cost more than the lease's data itself.

    Raises:
        ProtocolError: if the bytes are not a valid shard of ``spec``'s kind.
    """

    def __init__(self, spec: DataSpec, shard: bytes) -> None:
        self.spec = spec
        if spec.kind == "text":
            if spec.sample_len < 2:
                raise ProtocolError(f"text data needs sample_len >= 2, got {spec.sample_len}")
            self.count = len(shard) // spec.sample_len
            self._rows = np.frombuffer(shard, dtype=np.uint8, count=self.count * spec.sample_len)
            return
        if spec.kind == "tokens":
            self._rows = _token_rows(spec, shard)
            self.count = len(self._rows) // spec.sample_len
            return
        arrays = _load_tensors(shard)
        x = torch.from_numpy(arrays["x"])
        self._x = x.float() if x.is_floating_point() else x
        self._y = torch.from_numpy(arrays["y"]).long()
        self.count = int(self._x.shape[0])

    def read(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of samples ``start:start+count``.

        Raises:
            ProtocolError: if the range lies outside the shard.
        """
        if start < 0 or count <= 0 or start + count > self.count:
            raise ProtocolError(f"sample range {start}+{count} lies outside a shard of {self.count} samples")
        if self.spec.kind in ("text", "tokens"):
            width = self.spec.sample_len
            rows = self._rows[start * width : (start + count) * width].reshape(count, width).astype(np.int64)
            tokens = torch.from_numpy(rows)
            return tokens[:, :-1], tokens[:, 1:]
        return self._x[start : start + count], self._y[start : start + count]


def sample_seed(shard: str, index: int, version: int) -> int:
    """The seed of one sample's augmentation: the same on every device, different in each epoch's version."""
    digest = hashlib.blake2b(f"{shard}:{index}:{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def augment_images(x: torch.Tensor, mode: str, seeds: Sequence[int]) -> torch.Tensor:
    """Images (N, C, H, W) flipped left-right at random (``flip``), and shifted by up to an eighth of their side
    with the uncovered edge black (``flip_crop``, the padded random crop of image classifiers), one seed per image.

    Raises:
        ProtocolError: for samples that are not images, or an unknown mode.
    """
    if mode == "none":
        return x
    if mode not in ("flip", "flip_crop"):
        raise ProtocolError(f"unknown augmentation {mode!r}; this agent knows flip and flip_crop")
    if x.dim() != 4 or len(seeds) != len(x):
        raise ProtocolError(f"augmentation applies to images (N, C, H, W); these samples are {tuple(x.shape)}")
    out = x.clone()
    pad = max(1, x.shape[-1] // 8)
    for i, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        flip = int(torch.randint(0, 2, (1,), generator=generator))  # a fair coin
        dx, dy = (torch.randint(0, 2 * pad + 1, (2,), generator=generator) - pad).tolist()
        image = x[i].flip(-1) if flip else x[i]
        if mode == "flip_crop":
            image = _shifted(image, dx, dy)
        out[i] = image
    return out


def _shifted(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """``image`` (C, H, W) moved right by ``dx`` and down by ``dy`` pixels; what comes in is zero."""
    out = torch.zeros_like(image)
    height, width = image.shape[-2:]
    out[:, max(0, dy) : height + min(0, dy), max(0, dx) : width + min(0, dx)] = image[
        :, max(0, -dy) : height - max(0, dy), max(0, -dx) : width - max(0, dx)
    ]
    return out


def _token_rows(spec: DataSpec, shard: bytes) -> np.ndarray:
    """A token shard's ids, checked: whole samples, and every id one the model has an embedding for."""
    if spec.sample_len < 2:
        raise ProtocolError(f"token data needs sample_len >= 2, got {spec.sample_len}")
    dtype = token_dtype(spec.token_bytes)
    width = spec.sample_len * dtype.itemsize
    if len(shard) % width:
        raise ProtocolError(f"a token shard of {len(shard)} bytes is not whole samples of {width} bytes")
    ids = np.frombuffer(shard, dtype=dtype)
    if len(ids) and int(ids.max()) >= spec.vocab_size:
        first = int(np.argmax(ids >= spec.vocab_size))
        raise ProtocolError(
            f"token {first} of the shard is id {int(ids[first])}, outside the vocabulary of {spec.vocab_size}"
        )
    return ids


def _load_tensors(shard: bytes) -> dict[str, np.ndarray]:
    try:
        arrays = load_safetensors(shard)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ProtocolError(f"shard is not a valid safetensors file: {exc}") from None
    if set(arrays) != {"x", "y"} or arrays["x"].shape[0] != arrays["y"].shape[0]:
        raise ProtocolError(f"tensor shard must hold arrays x and y with equal rows, got {sorted(arrays)}")
    return arrays
