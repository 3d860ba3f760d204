"""The step counter against the step rows, checked by the site rather than assumed.

``Campaign.committed_steps`` is the number of step rows: rows ``0 ..
committed_steps - 1`` exist and none beyond. Commits and rollbacks keep it so
(``commits`` moves the counter in the transaction that writes the row, and only
on the row's timeline), but a counter left behind its rows once let a campaign
apply steps the site no longer counted, and then blocked it at the next restart.
So each site process looks every minute, and a campaign found off is repaired
at once: rolled back to the newest complete checkpoint at or below the last
step both agree on (the samples of every step after it are redone), or, with no
such checkpoint, blocked with the reason on its page. Each look costs two index
probes per running campaign, whatever the number of steps or volunteers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, OuterRef

from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.lib.metrics import STEP_COUNTER_REPAIRS

from . import backbone

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CounterMismatch:
    """A campaign whose step counter disagrees with its step rows, in words an operator can act on."""

    campaign_id: int
    committed_steps: int
    newest_row: int | None  # the highest step index with a row
    rows: int

    def describe(self) -> str:
        newest = "none" if self.newest_row is None else str(self.newest_row)
        return (
            f"campaign {self.campaign_id}: the step counter says {self.committed_steps} steps are committed, "
            f"but it has {self.rows} step rows (the newest is step {newest})"
        )


def counter_mismatches(campaign_id: int | None = None) -> list[CounterMismatch]:
    """Running campaigns whose counter is behind a row (a row at or past it) or ahead of them (its last row missing)."""
    running = Campaign.objects.filter(state=Campaign.State.RUNNING)
    if campaign_id is not None:
        running = running.filter(pk=campaign_id)
    rows = Step.objects.filter(campaign=OuterRef("pk"))
    suspects = running.annotate(
        ahead=Exists(rows.filter(index__gte=OuterRef("committed_steps"))),
        last=Exists(rows.filter(index=OuterRef("committed_steps") - 1)),
    ).values_list("id", "committed_steps", "ahead", "last")
    found = []
    for pk, committed, ahead, last in suspects:
        if ahead or (committed > 0 and not last):
            steps = Step.objects.filter(campaign_id=pk)
            newest = steps.order_by("-index").values_list("index", flat=True).first()
            found.append(CounterMismatch(pk, committed, newest, steps.count()))
    return found


def _consistent_prefix(campaign: Campaign) -> int:
    """The most steps ``n`` at or below the counter such that rows ``0 .. n - 1`` all exist."""
    indexes = list(
        campaign.steps.filter(index__lt=campaign.committed_steps).order_by("index").values_list("index", flat=True)
    )
    for n, index in enumerate(indexes):
        if index != n:
            return n
    return len(indexes)


def repair_step_counters() -> backbone.Outbox:
    """Repair every running campaign whose counter is off; returns the orders for its aggregators."""
    outbox: backbone.Outbox = []
    for found in counter_mismatches():
        outbox += _repair(found)
    return outbox


def _repair(found: CounterMismatch) -> backbone.Outbox:
    logger.error("%s; repairing it", found.describe(), extra={"campaign_id": found.campaign_id})
    backbone.flush_records()
    with transaction.atomic():
        campaign = backbone.locked_campaigns().filter(pk=found.campaign_id).first()
        if campaign is None or not counter_mismatches(campaign.pk):
            return []  # repaired meanwhile, by another process
        STEP_COUNTER_REPAIRS.labels(campaign=str(campaign.pk)).inc()
        agreed = _consistent_prefix(campaign)
        target = backbone.restore_target(campaign, agreed)
        if target is None:
            backbone.block(
                campaign,
                f"{found.describe()}, and no checkpoint every slice has lies at or below step {agreed}; the "
                f"site cannot repair it by itself. Restore the campaign: `manage.py restore_campaign "
                f"{campaign.pk}`, or the button on this page (staff)",
            )
            return []
        # Rows past the counter are forgotten with the rest: their leases' samples are redone once.
        campaign.committed_steps = max(campaign.committed_steps, (found.newest_row or -1) + 1)
        outbox = backbone.roll_back_everyone(campaign, target)
    logger.warning("campaign %s: step counter repaired by rolling back to version %s", found.campaign_id, target)
    return outbox
