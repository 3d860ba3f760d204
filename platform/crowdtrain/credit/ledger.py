"""Writing the ledger: grants when a step commits, reversals when it is rolled back.

Both run inside the transaction that commits or rolls back the step, so the
ledger and the step record never disagree. Both are idempotent (the unique
(lease, kind) constraint and ``ignore_conflicts``): a step written again after
a retried transaction, or a rollback noticed twice, adds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from crowdtrain.accounts.models import Device

from . import boards
from .models import FLOPS_PER_CREDIT, CreditEntry

logger = logging.getLogger(__name__)


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
    already = set(
        CreditEntry.objects.filter(
            lease_id__in=[lease for lease, _, _ in leases], kind=CreditEntry.Kind.GRANT
        ).values_list("lease_id", flat=True)
    )
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
        if device_id in owners and lease_id not in already
    ]
    CreditEntry.objects.bulk_create(entries, ignore_conflicts=True)
    _project(entries)


def reverse(lease_ids: Iterable[int], reason: str, when: datetime | None = None) -> None:
    """Take back the credit of these leases with entries of their own; a lease never granted is skipped."""
    when = when or timezone.now()
    granted = CreditEntry.objects.filter(lease_id__in=list(lease_ids), kind=CreditEntry.Kind.GRANT).exclude(
        lease__credit_entries__kind=CreditEntry.Kind.REVERSAL
    )
    grants = list(
        granted.only(
            "lease_id", "volunteer_id", "device_id", "team_id", "campaign_id", "samples", "flops", "created_at"
        )
    )
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
        for g in grants
    ]
    hours = {g.lease_id: boards.hour_of(g.created_at) for g in grants}
    CreditEntry.objects.bulk_create(entries, ignore_conflicts=True)
    _project(entries, hours)


def _project(entries: list[CreditEntry], hours: dict[int, int] | None = None) -> None:
    """Once the transaction commits, the leaderboards count the entries (a reversal in its grant's hour)."""
    deltas = [
        boards.Delta(
            e.volunteer_id,
            e.team_id,
            e.campaign_id,
            e.flops / FLOPS_PER_CREDIT,
            hours[e.lease_id] if hours is not None else boards.hour_of(e.created_at),
        )
        for e in entries
    ]
    if deltas:
        transaction.on_commit(lambda: _add_to_boards(deltas))


def _add_to_boards(deltas: list[boards.Delta]) -> None:
    try:
        boards.add(deltas)
    except Exception:  # the ledger has them: a rebuild (nightly, or manage.py rebuild_leaderboards) repairs it
        logger.exception("the leaderboards missed %s credit entries; they are in the ledger", len(deltas))
