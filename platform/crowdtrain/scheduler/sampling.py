"""Which samples a lease gets: returned ranges first, then the epoch cursor.

State is proportional to the number of returned ranges (bounded by active
leases), never to the dataset size: a cursor plus a FIFO of ranges to redo.
A range is ``[epoch, shard_index, start, count]``.
"""

from __future__ import annotations

from crowdtrain.campaigns.models import Campaign, shard_table

from .models import ReturnedRange

Range = list[int]


def take_samples(campaign: Campaign, count: int) -> list[Range]:
    """Remove ``count`` samples from the campaign's queue and cursor, returning their ranges.

    Mutates ``campaign.cursor`` and ``campaign.epoch``; the caller saves the
    campaign inside the same transaction.
    """
    ranges: list[Range] = []
    for returned in ReturnedRange.objects.filter(campaign=campaign).order_by("id"):
        if count == 0:
            break
        take = min(returned.count, count)
        ranges.append([returned.epoch, returned.shard_index, returned.start, take])
        if take == returned.count:
            returned.delete()
        else:
            returned.start += take
            returned.count -= take
            returned.save(update_fields=["start", "count"])
        count -= take
    total = campaign.dataset.num_samples
    table = shard_table(campaign.dataset)
    if not table.sizes:  # an empty dataset cannot be started; guard against an endless loop anyway
        raise ValueError(f"campaign {campaign.pk}: dataset {campaign.dataset_id} has no shards")
    while count > 0:
        if campaign.cursor >= total:
            campaign.epoch += 1
            campaign.cursor = 0
        index = table.locate(campaign.cursor)
        offset = campaign.cursor - table.first_samples[index]
        take = min(count, table.sizes[index] - offset)
        ranges.append([campaign.epoch, index, offset, take])
        campaign.cursor += take
        count -= take
    return merge_ranges(ranges)


def merge_ranges(ranges: list[Range]) -> list[Range]:
    """Join ranges that continue each other in the same shard and epoch."""
    merged: list[Range] = []
    for epoch, shard, start, count in ranges:
        if merged and merged[-1][0] == epoch and merged[-1][1] == shard and merged[-1][2] + merged[-1][3] == start:
            merged[-1][3] += count
        else:
            merged.append([epoch, shard, start, count])
    return merged


def return_samples(campaign_id: int, ranges: list[Range]) -> None:
    """Put a lease's ranges back at the end of the redo queue, ahead of the cursor."""
    ReturnedRange.objects.bulk_create(
        ReturnedRange(campaign_id=campaign_id, epoch=e, shard_index=s, start=st, count=c) for e, s, st, c in ranges
    )
