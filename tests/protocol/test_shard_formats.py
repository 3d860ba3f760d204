from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.protocol import DataSpec, ProtocolError
from tests.shards import count_samples, make_tensor_shards, make_text_shards, read_samples


@given(text=st.binary(min_size=0, max_size=400), sample_len=st.integers(2, 20), per_shard=st.integers(1, 9))
def test_text_shards_hold_every_whole_sample_in_order(text: bytes, sample_len: int, per_shard: int) -> None:
    spec = DataSpec(kind="text", sample_len=sample_len)

    shards = list(make_text_shards(text, sample_len, per_shard))

    rows = [read_samples(spec, data, 0, n) for data, n in shards if n]
    rebuilt = b"".join(bytes(torch.cat([x, y[:, -1:]], 1).flatten().tolist()) for x, y in rows)
    assert rebuilt == text[: len(text) - len(text) % sample_len]
    assert all(count_samples(spec, data) == n for data, n in shards)


def test_tensor_shards_are_deterministic_and_read_back() -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    y = np.arange(10) % 3

    first = list(make_tensor_shards(x, y, 4))
    again = list(make_tensor_shards(x.copy(), y.copy(), 4))
    xs, ys = read_samples(DataSpec(kind="tensors"), first[1][0], 1, 2)

    assert [data for data, _ in first] == [data for data, _ in again]
    torch.testing.assert_close(xs, torch.from_numpy(x[5:7]))
    assert ys.tolist() == [2, 0]


def test_it_rejects_a_range_outside_the_shard() -> None:
    data, _ = next(make_text_shards(b"x" * 50, 5, 10))

    with pytest.raises(ProtocolError, match="outside a shard of 10 samples"):
        read_samples(DataSpec(kind="text", sample_len=5), data, 8, 3)


def test_it_rejects_bytes_that_are_not_a_tensor_shard() -> None:
    with pytest.raises(ProtocolError, match="not a valid safetensors file"):
        read_samples(DataSpec(kind="tensors"), b"\x00" * 20, 0, 1)


@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), min_size=1, max_size=8))
def test_a_decoded_shard_reads_every_range_like_the_arrays_it_was_made_from(ranges: list[tuple[int, int]]) -> None:
    x = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)
    y = np.arange(12) % 5
    ((data, _),) = make_tensor_shards(x, y, 12)
    reader = ShardReader(DataSpec(kind="tensors"), data)

    for start, count in ranges:
        if start + count > 12:
            with pytest.raises(ProtocolError, match="outside a shard of 12 samples"):
                reader.read(start, count)
            continue
        xs, ys = reader.read(start, count)
        torch.testing.assert_close(xs, torch.from_numpy(x[start : start + count]))
        assert ys.dtype == torch.int64 and ys.tolist() == y[start : start + count].tolist()
