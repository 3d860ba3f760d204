"""Shard formats: how datasets are cut into content-addressed shards and read back as samples.

One definition for both sides: the site's sharding task writes shards with
the ``make_*`` functions, agents read them with ``ShardReader``.

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
        if self.spec.kind == "text":
            width = self.spec.sample_len
            rows = self._rows[start * width : (start + count) * width].reshape(count, width).astype(np.int64)
            tokens = torch.from_numpy(rows)
            return tokens[:, :-1], tokens[:, 1:]
        return self._x[start : start + count], self._y[start : start + count]


def count_samples(spec: DataSpec, shard: bytes) -> int:
    """How many samples a shard holds, checking its format.

    Raises:
        ProtocolError: if the bytes are not a valid shard of that kind.
    """
    if spec.kind == "text":
        if spec.sample_len < 2:
            raise ProtocolError(f"text data needs sample_len >= 2, got {spec.sample_len}")
        return len(shard) // spec.sample_len
    return ShardReader(spec, shard).count


def _load_tensors(shard: bytes) -> dict[str, np.ndarray]:
    try:
        arrays = load_safetensors(shard)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ProtocolError(f"shard is not a valid safetensors file: {exc}") from None
    if set(arrays) != {"x", "y"} or arrays["x"].shape[0] != arrays["y"].shape[0]:
        raise ProtocolError(f"tensor shard must hold arrays x and y with equal rows, got {sorted(arrays)}")
    return arrays


def read_samples(spec: DataSpec, shard: bytes, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of samples ``start:start+count`` of one shard (decodes it; see ShardReader).

    Raises:
        ProtocolError: if the shard is invalid or the range lies outside it.
    """
    return ShardReader(spec, shard).read(start, count)
