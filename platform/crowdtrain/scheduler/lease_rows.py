"""A lease as the hot state records it, turned into its database row, and the sample ranges between the two.

The hot state counts samples in the campaign's global order (``[epoch, first sample, count]``);
a row, a lease message and a check name them by shard (``[epoch, shard, start, count]``). Times in
the hot state are seconds of the hot state's clock; rows hold aware datetimes.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from crowdtrain.campaigns.models import Step
from crowdtrain.datasets.models import ShardTable

from .hotrecords import LeaseRecord
from .models import Lease

if TYPE_CHECKING:
    from .configs import CampaignConfig


def moment(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def held(record: LeaseRecord) -> tuple[datetime, datetime, float]:
    """A reported lease's issue and report times, and its compute time capped by how long it was held.

    Capped again after rounding to the database's microseconds, so the stored
    compute time never exceeds the stored times' difference.
    """
    issued, finished = moment(record.issued_at), moment(record.finished_at)
    return issued, finished, min(record.compute_s, (finished - issued).total_seconds())


def lease_row(config: CampaignConfig, record: LeaseRecord, *, request_id: str = "", step: Step | None = None) -> Lease:
    """The row of a lease: active as it was issued, or, given the step that took it, accepted into that step."""
    ranges = to_shards(config.table, record.ranges)
    row = Lease(
        pk=record.id,
        campaign_id=config.id,
        device_id=record.device,
        base_version=record.base_version,
        target_step=record.step if step is None else step.index,
        ranges=ranges,
        epoch=ranges[0][0] if ranges else 0,
        num_samples=record.samples,
        state=Lease.State.ACTIVE,
        issued_at=moment(record.issued_at),
        deadline=moment(record.deadline),
        request_id=request_id[:64],
    )
    if step is not None:
        row.issued_at, row.finished_at, row.compute_s = held(record)
        row.state, row.step, row.loss_sum = Lease.State.ACCEPTED, step, record.loss
    return row


def to_global(table: ShardTable, ranges: Iterable[list[int]]) -> list[list[int]]:
    """``[epoch, shard, start, count]`` ranges as ``[epoch, first sample, count]`` in dataset order."""
    return [[e, table.first_samples[s] + start, count] for e, s, start, count in ranges]


def to_shards(table: ShardTable, ranges: Iterable[list[int]]) -> list[list[int]]:
    """Global ``[epoch, start, count]`` ranges cut at shard boundaries into ``[epoch, shard, start, count]``.

    Raises:
        ValueError: a range reaches past the dataset's last sample.
    """
    out: list[list[int]] = []
    for epoch, start, count in ranges:
        while count > 0:
            index = table.locate(start)
            offset = start - table.first_samples[index]
            take = min(count, table.sizes[index] - offset)
            if start < 0 or take <= 0:
                # A range from another dataset (a campaign read before its row was replaced): never loop on it.
                raise ValueError(f"samples {start}..{start + count - 1} are outside this dataset's shards")
            out.append([epoch, index, offset, take])
            start, count = start + take, count - take
    return out
