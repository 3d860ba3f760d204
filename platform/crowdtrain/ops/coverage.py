"""The organizer's shard coverage map: what became of each train shard's samples in the current epoch.

Every sample of the epoch is counted once, in the most advanced state any lease
gives it (``STATES``, most advanced first):

- *verified*: in a lease whose verification check passed;
- *done*: in a lease of a committed step;
- *accepted*: reported, waiting for its step to fill;
- *leased*: in a lease still out with an agent;
- *rejected*: in a lease the scheduler rejected, or whose check failed;
- *returned*: in a lease that expired or was released: waiting to be leased again;
- *untouched*: in no lease of this epoch yet.

The lease record is the database's: the scheduler writes every lease row when it
issues the lease (``scheduler.records``, a quarter of a second behind Redis at most while the database keeps up)
and its outcome when it ends, so one query over the epoch's leases sees active
leases too, without reading the hot state. Counting works on intervals, never on
single samples (a dataset has millions), and the map is cached per campaign for
``CACHE_SECONDS``: every open campaign page polls it.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from django.core.cache import cache
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile
from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import shard_table
from crowdtrain.scheduler.models import Lease
from crowdtrain.verification.models import Check

logger = logging.getLogger(__name__)

STATES = ("verified", "done", "accepted", "leased", "rejected", "returned", "untouched")
# A state's precedence: where spans overlap, the highest wins (untouched is 0, verified the highest).
_RANK = {state: len(STATES) - 1 - i for i, state in enumerate(STATES)}
_BY_RANK = tuple(reversed(STATES))
# A browser draws this many squares without trouble; a dataset with more shards gets cells of several.
MAX_CELLS = 2000
TOP_VOLUNTEERS = 3
CACHE_SECONDS = 10
# The states whose work a cell credits to its volunteers.
_DONE_STATES = frozenset({"verified", "done"})

Span = tuple[int, int, str]  # [start, end) of shard-local sample offsets, and the state a lease gives them


def shard_counts(size: int, spans: Iterable[Span]) -> dict[str, int]:
    """Samples of one shard per state, each counted once, in the most advanced state of the spans over it.

    A sweep over the spans' ends: the cost follows the number of spans, not of
    samples. Spans reaching outside ``0 : size`` are clipped to it.

    Args:
        size: the shard's number of samples.
        spans: ``(start, end, state)`` with ``state`` one of ``STATES``.

    Returns:
        A count for every state of ``STATES``; they sum to ``size``.
    """
    events: list[tuple[int, int, int]] = []  # (offset, rank, +1 opens / -1 closes)
    for start, end, state in spans:
        start, end = max(start, 0), min(end, size)
        if start < end:
            rank = _RANK[state]
            events += [(start, rank, 1), (end, rank, -1)]
    events.sort()
    counts = dict.fromkeys(STATES, 0)
    depth = [0] * len(STATES)  # open spans per rank
    at = 0
    for offset, rank, change in events:
        if offset > at:
            counts[_top(depth)] += offset - at
            at = offset
        depth[rank] += change
    counts["untouched"] += size - at
    return counts


def _top(depth: Sequence[int]) -> str:
    for rank in range(len(depth) - 1, 0, -1):
        if depth[rank] > 0:
            return _BY_RANK[rank]
    return "untouched"


def lease_state(state: str, in_step: bool, check: str | None) -> str:
    """What a lease makes of its samples, given its record and the state of its check (None: not checked)."""
    if state == Lease.State.REJECTED or check == Check.State.FAILED:
        return "rejected"
    counted = in_step or state == Lease.State.ACCEPTED
    if check == Check.State.PASSED and counted:
        return "verified"
    if in_step:
        return "done"
    if state == Lease.State.ACCEPTED:
        return "accepted"
    if state == Lease.State.ACTIVE:
        return "leased"
    # Expired or released (a rollback retires the accepted leases of its steps so too): leased again later.
    return "returned"


def coverage_map(campaign: Campaign) -> dict[str, Any]:
    """The feed of ``/api/campaigns/<id>/coverage``, at most ``CACHE_SECONDS`` old."""
    # The hot key, not the id: ids come back after a database reset, and the cache may be a shared Redis.
    key = f"campaign-coverage:{campaign.hot_key.hex}:{campaign.epoch}"
    data = cache.get(key)
    if data is None:
        data = compute_coverage(campaign)
        cache.set(key, data, CACHE_SECONDS)
    return data


def compute_coverage(campaign: Campaign) -> dict[str, Any]:
    """The coverage map of the campaign's current epoch, uncached: one query over its leases, one for names."""
    table = shard_table(campaign.dataset)
    epoch = campaign.epoch
    spans: dict[int, list[Span]] = defaultdict(list)
    done_by: dict[int, Counter[int]] = defaultdict(Counter)  # shard -> volunteer -> samples done
    for ranges, state, step_id, owner_id, check in _epoch_leases(campaign):
        kind = lease_state(state, step_id is not None, check)
        for range_epoch, shard, start, count in ranges:
            if range_epoch != epoch:
                continue  # a lease begun at the end of the last epoch: only its part in this one
            if not 0 <= shard < len(table.sizes):
                logger.debug("campaign %s: a lease names shard %s, beyond its dataset", campaign.pk, shard)
                continue
            spans[shard].append((start, start + count, kind))
            if kind in _DONE_STATES:
                done_by[shard][owner_id] += count

    num_shards = len(table.sizes)
    per_cell = max(1, math.ceil(num_shards / MAX_CELLS))
    totals = dict.fromkeys(STATES, 0)
    cells: list[dict[str, Any]] = []
    cell_volunteers: list[Counter[int]] = []
    for first in range(0, num_shards, per_cell):
        last = min(first + per_cell, num_shards) - 1
        counts = dict.fromkeys(STATES, 0)
        volunteers: Counter[int] = Counter()
        for shard in range(first, last + 1):
            size = table.sizes[shard]
            shard_spans = spans.get(shard)
            if shard_spans is None:  # most shards of a young epoch: no sweep needed
                counts["untouched"] += size
                continue
            for state, n in shard_counts(size, shard_spans).items():
                counts[state] += n
            volunteers.update(done_by.get(shard, Counter()))
        for state, n in counts.items():
            totals[state] += n
        cells.append(
            {
                "first_shard": first,
                "last_shard": last,
                "samples": sum(counts.values()),
                # In the order of "states": a list, not a dict, keeps a map of 2,000 cells a third smaller.
                "counts": [counts[state] for state in STATES],
                "state": max(STATES, key=lambda s: (counts[s], _RANK[s])),
            }
        )
        cell_volunteers.append(volunteers)
    _name_volunteers(cells, cell_volunteers)
    return {
        "campaign": campaign.pk,
        "epoch": epoch,
        "states": list(STATES),
        "totals": totals,
        "touched": any(n for state, n in totals.items() if state != "untouched"),
        "num_samples": sum(table.sizes),
        "num_shards": num_shards,
        "shards_per_cell": per_cell,
        "max_cells": MAX_CELLS,
        "cells": cells,
        "computed_at": timezone.now().isoformat(),
        "cache_seconds": CACHE_SECONDS,
    }


def _epoch_leases(campaign: Campaign) -> Iterable[tuple[list[list[int]], str, int | None, int, str | None]]:
    """``(ranges, state, step id, volunteer id, check state)`` of every lease with samples in the current epoch."""
    # A lease's ``epoch`` is its first range's: one that began in the last epoch may reach into this one.
    check = Check.objects.filter(lease_id=OuterRef("pk")).values("state")[:1]  # lease_id is unique
    return (
        Lease.objects.filter(campaign=campaign, epoch__gte=max(campaign.epoch - 1, 0), epoch__lte=campaign.epoch)
        .annotate(check_state=Subquery(check))
        .values_list("ranges", "state", "step_id", "device__owner_id", "check_state")
        .order_by()
        .iterator(chunk_size=5000)
    )


def _name_volunteers(cells: list[dict[str, Any]], volunteers: list[Counter[int]]) -> None:
    """Give each cell its top volunteers by public name (never an e-mail address), in one query."""
    tops = [v.most_common(TOP_VOLUNTEERS) for v in volunteers]
    ids = {user_id for top in tops for user_id, _ in top}
    # A volunteer without a profile row (an account older than profiles) shows nothing that identifies them.
    names = {p.user_id: p.public_name for p in Profile.objects.filter(user_id__in=ids)} if ids else {}
    for cell, top, everyone in zip(cells, tops, volunteers, strict=True):
        named: dict[str, int] = {}
        for user_id, samples in top:  # several anonymous volunteers make one entry
            name = names.get(user_id, ANONYMOUS_NAME)
            named[name] = named.get(name, 0) + samples
        cell["volunteers"] = [{"name": name, "samples": samples} for name, samples in named.items()]
        cell["more_volunteers"] = max(len(everyone) - len(top), 0)
