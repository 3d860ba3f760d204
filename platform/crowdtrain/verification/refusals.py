"""Uploads the aggregators refused for their content count against the volunteer who sent them.

A checked lease is compared with a copy; a gradient of NaNs never gets that
far, because the aggregators refuse it on arrival. So a volunteer whose every
upload was NaN was never checked and never quarantined. The aggregator now
tells the site (``upload_refused``, protocol 2.7, for ``REFUSALS_THAT_COUNT``
only: an honest agent never sends such an upload), and each refused lease
counts once, as a failed check would, towards quarantine.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from crowdtrain.scheduler.models import Lease, SliceAssignment
from crowdtrain_agent.protocol import REFUSALS_THAT_COUNT, UploadRefused

from .models import Answer, Refusal, Standing

logger = logging.getLogger(__name__)

# A refusal whose lease row has not appeared by then names a lease this site never wrote: dropped.
UNRESOLVED_FOR_S = 600.0
RESOLVE_AT_MOST = 500  # per call: the rest wait for the next upkeep


def note(aggregator_id: int, refused: UploadRefused) -> bool:
    """Record an aggregator's refusal and count it if its volunteer is known yet; whether it was new.

    Only from an aggregator that holds that slice of that campaign, and only
    once per lease (a lease refused on every slice counts once).
    """
    if refused.code not in REFUSALS_THAT_COUNT:
        return False
    holds = SliceAssignment.objects.filter(
        campaign_id=refused.campaign_id, index=refused.slice_index, aggregator_id=aggregator_id
    ).exists()
    if not holds:
        logger.warning(
            "aggregator %s reported a refused upload for slice %s of campaign %s, which it does not hold; ignored",
            aggregator_id, refused.slice_index, refused.campaign_id,
        )  # fmt: skip
        return False
    try:
        with transaction.atomic():
            row, created = Refusal.objects.get_or_create(
                lease_id=refused.lease_id,
                defaults={
                    "campaign_id": refused.campaign_id,
                    "slice_index": refused.slice_index,
                    "code": refused.code[:40],
                    "detail": refused.detail[:300],
                },
            )
    except IntegrityError:  # the same lease's refusal from another slice, written a moment before
        return False
    if created:
        logger.info("lease %s of campaign %s refused by an aggregator: %s", row.lease_id, row.campaign_id, row.code)
        resolve([row])
    return created


def resolve(rows: list[Refusal] | None = None) -> int:
    """Count refusals whose lease's volunteer is known now (its row written); returns how many were counted.

    Drops those still unknown after ``UNRESOLVED_FOR_S``.
    """
    from .quarantine import consider

    pending = rows if rows is not None else list(Refusal.objects.filter(volunteer__isnull=True)[:RESOLVE_AT_MOST])
    if not pending:
        return 0
    ids = [row.lease_id for row in pending]
    # (campaign, volunteer) of each lease: an aggregator is believed only about its own campaign's leases.
    owners = {
        pk: (c, v) for pk, c, v in Lease.objects.filter(pk__in=ids).values_list("pk", "campaign_id", "device__owner_id")
    }
    missing = [lease_id for lease_id in ids if lease_id not in owners]
    if missing:  # a verification copy's answer row names its volunteer too
        answers = Answer.objects.filter(lease_id__in=missing).values_list(
            "lease_id", "case__campaign_id", "volunteer_id"
        )
        owners.update({lease_id: (c, v) for lease_id, c, v in answers})
    counted: list[int] = []
    for row in pending:
        campaign_id, volunteer_id = owners.get(row.lease_id, (None, None))
        if volunteer_id is None:
            continue
        if campaign_id != row.campaign_id:
            logger.warning(
                "refusal of lease %s names campaign %s, but the lease is of %s; dropped",
                row.lease_id,
                row.campaign_id,
                campaign_id,
            )
            row.delete()
            continue
        with transaction.atomic():
            if not Refusal.objects.filter(pk=row.pk, volunteer__isnull=True).update(volunteer_id=volunteer_id):
                continue  # counted by another process meanwhile
            standing, _ = Standing.objects.select_for_update().get_or_create(volunteer_id=volunteer_id)
            standing.uploads_refused += 1
            standing.streak = 0
            standing.save(update_fields=["uploads_refused", "streak"])
        counted.append(volunteer_id)
    for volunteer_id in set(counted):
        consider(volunteer_id)
    limit = timezone.now() - timedelta(seconds=UNRESOLVED_FOR_S)
    Refusal.objects.filter(volunteer__isnull=True, received_at__lt=limit).delete()
    return len(counted)
