"""Writing the ledger: grants when a step commits, reversals when it is rolled back.

Both run inside the transaction that commits or rolls back the step, so the
ledger and the step record never disagree. Both are idempotent (the unique
(lease, kind) constraint and ``ignore_conflicts``): a step written again after
a retried transaction, or a rollback noticed twice, adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from django.utils import timezone

from crowdtrain.accounts.models import Device

from .models import CreditEntry


def grant(
    campaign_id: int, flops_per_sample: float, leases: Sequence[tuple[int, int, int]], when: datetime | None = None
) -> None:
    """Credit committed leases, given as ``(lease id, device id, samples)``.

    One query finds each device's volunteer and their team, whatever the number of leases.
    """
    if not leases:
        return
    owners = {
        pk: (owner, team)
        for pk, owner, team in Device.objects.filter(pk__in={d for _, d, _ in leases}).values_list(
            "pk", "owner_id", "owner__profile__team_id"
        )
    }
    when = when or timezone.now()
    entries = [
        CreditEntry(
            lease_id=lease_id,
            kind=CreditEntry.Kind.GRANT,
            volunteer_id=owners[device_id][0],
            device_id=device_id,
            team_id=owners[device_id][1],
            campaign_id=campaign_id,
            samples=samples,
            flops=samples * flops_per_sample,
            created_at=when,
        )
        for lease_id, device_id, samples in leases
        if device_id in owners
    ]
    CreditEntry.objects.bulk_create(entries, ignore_conflicts=True)


def reverse(lease_ids: Iterable[int], reason: str, when: datetime | None = None) -> None:
    """Take back the credit of these leases with entries of their own; a lease never granted is skipped."""
    when = when or timezone.now()
    granted = CreditEntry.objects.filter(lease_id__in=list(lease_ids), kind=CreditEntry.Kind.GRANT)
    entries = [
        CreditEntry(
            lease_id=g.lease_id,
            kind=CreditEntry.Kind.REVERSAL,
            volunteer_id=g.volunteer_id,
            device_id=g.device_id,
            team_id=g.team_id,
            campaign_id=g.campaign_id,
            samples=-g.samples,
            flops=-g.flops,
            reason=reason[:200],
            created_at=when,
        )
        for g in granted.only("lease_id", "volunteer_id", "device_id", "team_id", "campaign_id", "samples", "flops")
    ]
    CreditEntry.objects.bulk_create(entries, ignore_conflicts=True)
