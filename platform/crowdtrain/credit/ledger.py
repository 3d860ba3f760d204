"""Writing the ledger: grants when a step commits, reversals when it is rolled back or its volunteer quarantined.

Grants and rollback reversals run inside the transaction that commits or rolls
back the step, so the ledger and the step record never disagree. Every write is
idempotent (the unique (lease, kind) constraint and ``ignore_conflicts``): a step
written again after a retried transaction, or a rollback noticed twice, adds
nothing. Credit is only ever taken back from a lease whose entries still sum to
more than nothing, so a rollback after a quarantine takes nothing twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Sum
from django.utils import timezone

from crowdtrain.accounts.models import Device, Profile
from crowdtrain.lib import batchsql

from . import boards
from .models import FLOPS_PER_CREDIT, CreditEntry

if TYPE_CHECKING:
    from django.db.models import QuerySet

logger = logging.getLogger(__name__)


def grant(
    campaign_id: int, flops_per_sample: float, leases: Sequence[tuple[int, int, int]], when: datetime | None = None
) -> None:
    """Credit committed leases, given as ``(lease id, device id, samples)``.

    A fixed number of statements whatever the number of leases: a step's commit grants thousands at once.
    """
    if not leases:
        return
    when = when or timezone.now()
    written = batchsql.insert_grants(
        CreditEntry,
        Device,
        Profile,
        kind=CreditEntry.Kind.GRANT,
        campaign_id=campaign_id,
        flops_per_sample=flops_per_sample,
        leases=leases,
        when=when,
    )
    hour = boards.hour_of(when)
    credit = [(owner, team, flops / FLOPS_PER_CREDIT) for owner, team, flops in written]
    _project_deltas([boards.Delta(owner, team, campaign_id, amount, hour) for owner, team, amount in credit])


def reverse(lease_ids: Iterable[int], reason: str, when: datetime | None = None) -> None:
    """Take back the credit of these leases (a rolled-back step); a lease with no credit left is skipped."""
    _take_back(CreditEntry.objects.filter(lease_id__in=list(lease_ids)), CreditEntry.Kind.REVERSAL, reason, when)


def quarantine(volunteer_id: int, reason: str, when: datetime | None = None) -> int:
    """Take back all of a quarantined volunteer's credit; returns how many leases lost theirs."""
    return _take_back(CreditEntry.objects.filter(volunteer_id=volunteer_id), CreditEntry.Kind.QUARANTINE, reason, when)


def restore(volunteer_id: int, reason: str, when: datetime | None = None) -> int:
    """Give back what a quarantine took from a volunteer an admin cleared (not what rollbacks took)."""
    when = when or timezone.now()
    entries = CreditEntry.objects.filter(volunteer_id=volunteer_id)
    taken = list(
        entries.filter(kind=CreditEntry.Kind.QUARANTINE, lease__step__isnull=False)  # still in a committed step
        .exclude(Exists(entries.filter(lease_id=OuterRef("lease_id"), kind=CreditEntry.Kind.RESTORE)))
        .exclude(Exists(entries.filter(lease_id=OuterRef("lease_id"), kind=CreditEntry.Kind.REVERSAL)))
        .only("lease_id", "volunteer_id", "device_id", "team_id", "campaign_id", "samples", "flops")
    )
    grants = dict(
        entries.filter(kind=CreditEntry.Kind.GRANT, lease_id__in=[t.lease_id for t in taken]).values_list(
            "lease_id", "created_at"
        )
    )
    back = [_entry(t, CreditEntry.Kind.RESTORE, -1, reason, when) for t in taken]
    CreditEntry.objects.bulk_create(back, ignore_conflicts=True)
    _project(back, {lease: boards.hour_of(at) for lease, at in grants.items()})
    return len(back)


def _entry(source: CreditEntry, kind: str, sign: int, reason: str, when: datetime) -> CreditEntry:
    return CreditEntry(
        lease_id=source.lease_id,
        kind=kind,
        volunteer_id=source.volunteer_id,
        device_id=source.device_id,
        team_id=source.team_id,
        campaign_id=source.campaign_id,
        samples=sign * source.samples,
        flops=sign * source.flops,
        reason=reason[:200],
        created_at=when,
    )


def _take_back(entries: QuerySet[CreditEntry], kind: str, reason: str, when: datetime | None) -> int:
    """Add a negative entry of ``kind`` for every lease among ``entries`` whose credit still sums above zero."""
    when = when or timezone.now()
    positive = (
        entries.values("lease_id").annotate(net=Sum("samples")).filter(net__gt=0).values_list("lease_id", flat=True)
    )
    grants = list(
        CreditEntry.objects.filter(kind=CreditEntry.Kind.GRANT, lease_id__in=list(positive))
        .exclude(Exists(CreditEntry.objects.filter(lease_id=OuterRef("lease_id"), kind=kind)))
        .only("lease_id", "volunteer_id", "device_id", "team_id", "campaign_id", "samples", "flops", "created_at")
    )
    entries_out = [_entry(g, kind, -1, reason, when) for g in grants]
    CreditEntry.objects.bulk_create(entries_out, ignore_conflicts=True)
    _project(entries_out, {g.lease_id: boards.hour_of(g.created_at) for g in grants})
    return len(entries_out)


def _project(entries: list[CreditEntry], hours: dict[int, int] | None = None) -> None:
    """Once the transaction commits, the leaderboards count the entries (a reversal in its grant's hour)."""
    _project_deltas(
        [
            boards.Delta(
                e.volunteer_id,
                e.team_id,
                e.campaign_id,
                e.flops / FLOPS_PER_CREDIT,
                hours[e.lease_id] if hours is not None else boards.hour_of(e.created_at),
            )
            for e in entries
        ]
    )


def _project_deltas(deltas: list[boards.Delta]) -> None:
    if deltas:
        transaction.on_commit(lambda: _to_boards(deltas))


# The leaderboards are a projection of the ledger: a step's commit hands its credit to this thread and goes
# on to open the next step and tell the aggregators, instead of waiting for a step's worth of
# sorted-set updates. One thread, so a process applies its batches in the order they committed;
# what it still holds when the process exits normally is applied before exit (the executor joins its
# thread at exit), and what a killed process held is repaired by the nightly rebuild from the ledger.
_boards_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crowdtrain-leaderboards")


def _to_boards(deltas: list[boards.Delta]) -> None:
    if settings.CROWDTRAIN_RECORDS_INLINE:
        _add_to_boards(deltas)
    else:
        _boards_thread.submit(_add_to_boards, deltas)


def _add_to_boards(deltas: list[boards.Delta]) -> None:
    try:
        boards.add(deltas)
    except Exception:  # the ledger has them: a rebuild (nightly, or manage.py rebuild_leaderboards) repairs it
        logger.exception("the leaderboards missed %s credit entries; they are in the ledger", len(deltas))
