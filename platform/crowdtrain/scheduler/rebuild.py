"""Rebuild a campaign's hot state from the database's record: at first use, or after Redis lost it.

The record may trail Redis by a batch (``records``), and another process may
have died with records still queued. So nothing is taken on trust: the
cursor is the furthest any lease reached, the redo queue is every sample of
the current (and previous) epoch below it that no live or counted lease
covers, and of two live leases over the same samples only the newer is kept.
A lease the record never heard of is unknown to the rebuilt state, so its
report is refused and its samples, redone: never counted twice.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import defaultdict

from django.conf import settings
from django.db.models import Max, Q
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import shard_table

from . import seam
from .configs import hot_fields, probation_cap, publish_state, run_state
from .hotrecords import LeaseRecord, to_script
from .hotstate import hot_state
from .lease_rows import to_global
from .models import Lease
from .records import Finished, writer

logger = logging.getLogger(__name__)

Interval = tuple[int, int]  # [start, end) of global sample indexes


def merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _gaps(covered: list[Interval], end: int) -> list[Interval]:
    gaps, at = [], 0
    for start, stop in merge(covered):
        if start >= end:
            break
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    if at < end:
        gaps.append((at, end))
    return gaps


class _Taken:
    """Samples of one epoch already spoken for: the committed ones (many, merged and searched by
    bisection) and the live leases kept so far (as many as were in flight)."""

    def __init__(self, committed: list[Interval]) -> None:
        self.committed = merge(committed)
        self.starts = [s for s, _ in self.committed]
        self.live: list[Interval] = []

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        for s, e in self.committed[max(i, 0) : i + 2]:
            if s < end and start < e:
                return True
        return any(s < end and start < e for s, e in self.live)

    def intervals(self) -> list[Interval]:
        return self.committed + self.live


def load_campaign(campaign_id: int, *, force: bool = False) -> bool:
    """Put the campaign's hot state in Redis from the record; returns whether it loaded (False: already there).

    Costs one pass over the leases of the current and previous epoch: run on
    first use and after a loss of Redis, never on the lease path.
    """
    writer().flush()  # this process's own queued records first
    campaign = Campaign.objects.select_related("dataset").get(pk=campaign_id)
    table = shard_table(campaign.dataset)
    total = campaign.dataset.num_samples
    leases = Lease.objects.filter(campaign=campaign)
    epoch = max(campaign.epoch, leases.aggregate(e=Max("epoch"))["e"] or 0)
    live_q = Q(state=Lease.State.ACTIVE) | Q(
        state=Lease.State.ACCEPTED, step__isnull=True, target_step__gte=campaign.committed_steps
    )
    recent = leases.filter(epoch__gte=max(epoch - 1, 0))
    # Samples in committed steps are taken, whatever else the record says about them.
    committed: dict[int, list[Interval]] = defaultdict(list)
    for ranges in recent.filter(step__isnull=False).values_list("ranges", flat=True):
        for e, s, c in to_global(table, ranges):
            committed[e].append((s, s + c))
    taken = defaultdict(lambda: _Taken([]), {e: _Taken(spans) for e, spans in committed.items()})
    # Within an epoch a sample is leased again only once its last lease ended uncounted, so two
    # live leases over one sample mean the older one's end was not recorded yet: the newer wins.
    live, dropped = [], []
    rows = list(leases.filter(live_q).order_by("-id"))
    on_probation = _on_probation(campaign, rows)
    over_cap = _over_probation_cap(rows, on_probation)
    for lease in rows:
        spans = to_global(table, lease.ranges)
        if lease.pk in over_cap or any(taken[e].overlaps(s, s + c) for e, s, c in spans):
            dropped.append(lease)
            continue
        for e, s, c in spans:
            taken[e].live.append((s, s + c))
        live.append(_record(lease, spans, on_probation.get(lease.device_id, (0, 0))[0]))
    covered = {e: taken[e].intervals() for e in (epoch - 1, epoch)}
    cursor = max([campaign.cursor if campaign.epoch == epoch else 0, *(e for s, e in covered[epoch])])
    cursor = min(cursor, total)
    redo: list[list[int]] = []
    if epoch > 0:
        redo += [[epoch - 1, s, e - s] for s, e in _gaps(covered[epoch - 1], total)]
    redo += [[epoch, s, e - s] for s, e in _gaps(covered[epoch], cursor)]
    run, why = run_state(campaign)
    meta = {
        "open": campaign.committed_steps,
        "line": campaign.timeline,
        "cursor": cursor,
        "epoch": epoch,
        "total": total,
        **hot_fields(campaign),
        "run": int(run),
        "why": why,
        # Newer than any generation a process may have cached from before Redis lost the keys.
        "lease_s": 0,
        "gen": time.time_ns() // 1_000_000,
    }
    args = {
        "cid": campaign.pk,
        "meta": meta,
        "leases": live,
        "ret": redo,
        "force": force,
        "backup_min_s": settings.CROWDTRAIN_BACKUP_MIN_S,
    }
    loaded = bool(hot_state().run("load", campaign.hot_key.hex, args).get("loaded"))
    if loaded:
        now = timezone.now()
        for lease in dropped:
            writer().lease_finished(
                Finished(lease.pk, Lease.State.EXPIRED, "superseded when the scheduler restarted", now)
            )
        logger.info(
            "campaign %s: scheduler state loaded (epoch %s, cursor %s, %s live leases, %s ranges to redo)",
            campaign_id,
            epoch,
            cursor,
            len(live),
            len(redo),
        )
        publish_state(campaign_id)
    return loaded


def _on_probation(campaign: Campaign, live: list[Lease]) -> dict[int, tuple[int, int]]:
    """Device -> (volunteer, most leases of a step they may hold), for the devices of live leases whose
    volunteer is on probation now.

    Asks ``standing.probation`` for every volunteer, as the lease path does, rather than
    deciding here that a campaign has no cap: two places that judge probation can disagree,
    and a rebuilt state that forgot a volunteer's leases would let them fill a step.
    """
    cap = probation_cap(campaign)
    owners = Device.objects.filter(pk__in={lease.device_id for lease in live}).values_list("pk", "owner_id")
    limits = {device: (owner, seam.standing().probation(cap, campaign.owner_id, owner)) for device, owner in owners}
    return {device: limit for device, limit in limits.items() if limit[1]}


def _over_probation_cap(live: list[Lease], on_probation: dict[int, tuple[int, int]]) -> set[int]:
    """Leases the record says are live beyond what their volunteer on probation may hold of a step.

    The scripts never let a volunteer on probation hold more, so the surplus is leases whose end
    another process had queued but not written when Redis lost its keys (an expiry, say). Reported
    work is kept first, then the newest leases, as overlapping leases are judged; the rest are ended.
    """
    most = dict(on_probation.values())  # volunteer -> the limit
    by_share: dict[tuple[int, int], list[Lease]] = defaultdict(list)
    for lease in live:
        if lease.device_id in on_probation:
            by_share[(lease.target_step, on_probation[lease.device_id][0])].append(lease)
    over: set[int] = set()
    for (_, owner), held in by_share.items():
        kept = sorted(held, key=lambda lease: (lease.state != Lease.State.ACCEPTED, -lease.pk))
        over.update(lease.pk for lease in kept[most[owner] :])
    return over


def _record(lease: Lease, spans: list[list[int]], volunteer_on_probation: int = 0) -> dict[str, object]:
    """A lease row as the scripts keep it (``hotrecords.LeaseRecord``)."""
    active = lease.state == Lease.State.ACTIVE
    record = LeaseRecord(
        id=lease.pk,
        device=lease.device_id,
        step=lease.target_step,
        samples=lease.num_samples,
        base_version=lease.base_version,
        ranges=spans,
        state="active" if active else "accepted",
        issued_at=lease.issued_at.timestamp(),
        deadline=lease.deadline.timestamp(),
        loss=lease.loss_sum or 0.0,
        compute_s=lease.compute_s or 0.0,
        finished_at=lease.finished_at.timestamp() if lease.finished_at else 0.0,
        owner=volunteer_on_probation,
    )
    return to_script(record)
