"""A lease range that does not fit the dataset (a campaign read before its row was replaced) is an error, never a
loop: cutting it at shard boundaries once grew a site process by 150 MB a second until the kernel killed it."""

from __future__ import annotations

import pytest

from crowdtrain.datasets.models import ShardTable
from crowdtrain.scheduler.lease_rows import to_shards

TABLE = ShardTable(first_samples=(0, 30, 60), sizes=(30, 30, 10), sha256s=("a" * 64, "b" * 64, "c" * 64))


def test_ranges_are_cut_at_shard_boundaries() -> None:
    assert to_shards(TABLE, [[0, 25, 10], [1, 65, 5]]) == [[0, 0, 25, 5], [0, 1, 0, 5], [1, 2, 5, 5]]


@pytest.mark.parametrize("ranges", [[[0, 65, 10]], [[0, 70, 1]], [[0, -1, 2]]])
def test_a_range_past_the_dataset_is_refused(ranges: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="outside this dataset's shards"):
        to_shards(TABLE, ranges)
