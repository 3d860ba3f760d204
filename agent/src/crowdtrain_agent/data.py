"""Shard formats: how datasets are cut into content-addressed shards and read back as samples.

One definition for both sides: the site's sharding task writes shards with
the ``make_*`` functions, agents read them with ``read_samples``.

- text: raw bytes, ``sample_len`` bytes per sample. A byte-level language
  model reads inputs ``s[:-1]`` and targets ``s[1:]``.
- tensors: a safetensors file with ``x`` (features) and ``y`` (labels), one
  row per sample. safetensors rather than ``.npz``: it is deterministic (the
  same rows give the same bytes, hence the same sha256) and loads no pickle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from .protocol import DataSpec, ProtocolError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_text_shards(text: bytes, sample_len: int, samples_per_shard: int) -> Iterator[tuple[bytes, int]]:
    """Cut a byte corpus into shards of whole samples; a ragged tail shorter than one sample is dropped.

    Yields:
        (shard bytes, number of samples in it), in corpus order.
    """
    if sample_len < 2:
        raise ValueError(f"sample_len must be at least 2 bytes, got {sample_len}")
    shard_bytes = sample_len * samples_per_shard
    usable = len(text) - len(text) % sample_len
    for offset in range(0, usable, shard_bytes):
        chunk = text[offset : min(offset + shard_bytes, usable)]
        yield chunk, len(chunk) // sample_len


def make_tensor_shards(x: np.ndarray, y: np.ndarray, samples_per_shard: int) -> Iterator[tuple[bytes, int]]:
    """Cut feature and label arrays into safetensors shards of ``samples_per_shard`` rows.

    Yields:
        (shard bytes, number of samples in it), in row order.
    """
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)}; they must match")
    for start in range(0, len(x), samples_per_shard):
        xs = np.ascontiguousarray(x[start : start + samples_per_shard])
        ys = np.ascontiguousarray(y[start : start + samples_per_shard])
        yield save_safetensors({"x": xs, "y": ys}), len(xs)


def count_samples(spec: DataSpec, shard: bytes) -> int:
    """How many samples a shard holds, checking its format.

    Raises:
        ProtocolError: if the bytes are not a valid shard of that kind.
    """
    if spec.kind == "text":
        if spec.sample_len < 2:
            raise ProtocolError(f"text data needs sample_len >= 2, got {spec.sample_len}")
        return len(shard) // spec.sample_len
    arrays = _load_tensors(shard)
    return int(arrays["x"].shape[0])


def _load_tensors(shard: bytes) -> dict[str, np.ndarray]:
    try:
        arrays = load_safetensors(shard)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ProtocolError(f"shard is not a valid safetensors file: {exc}") from None
    if set(arrays) != {"x", "y"} or arrays["x"].shape[0] != arrays["y"].shape[0]:
        raise ProtocolError(f"tensor shard must hold arrays x and y with equal rows, got {sorted(arrays)}")
    return arrays


def read_samples(spec: DataSpec, shard: bytes, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of samples ``start:start+count`` of one shard.

    Raises:
        ProtocolError: if the range lies outside the shard.
    """
    total = count_samples(spec, shard)
    if start < 0 or count <= 0 or start + count > total:
        raise ProtocolError(f"sample range {start}+{count} lies outside a shard of {total} samples")
    if spec.kind == "text":
        rows = np.frombuffer(shard, dtype=np.uint8, count=count * spec.sample_len, offset=start * spec.sample_len)
        rows = torch.from_numpy(rows.reshape(count, spec.sample_len).astype(np.int64))
        return rows[:, :-1], rows[:, 1:]
    arrays = _load_tensors(shard)
    x = torch.from_numpy(np.ascontiguousarray(arrays["x"][start : start + count]))
    y = torch.from_numpy(np.ascontiguousarray(arrays["y"][start : start + count]))
    if x.is_floating_point():
        x = x.float()
    return x, y.long()
