"""Shards cut whole in memory, for tests: the site cuts its own streaming (``crowdtrain.datasets.sharding``).

Same formats as ``crowdtrain_agent.data`` reads; small enough to build in a test.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from safetensors.numpy import save as save_safetensors

from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.protocol import DataSpec, ProtocolError


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
    return ShardReader(spec, shard).count


def read_samples(spec: DataSpec, shard: bytes, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of samples ``start:start+count`` of one shard (decodes it; see ShardReader).

    Raises:
        ProtocolError: if the shard is invalid or the range lies outside it.
    """
    return ShardReader(spec, shard).read(start, count)
