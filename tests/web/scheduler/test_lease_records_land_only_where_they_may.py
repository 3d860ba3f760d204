"""The durable record of lease outcomes, written in batches: each outcome lands on its lease only where it may.

An acceptance lands only on a lease still active, an ending never on a lease
of a committed step, so writes racing across site processes converge.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from crowdtrain.scheduler import leasing
from crowdtrain.scheduler.models import Lease
from crowdtrain.scheduler.records import Finished, _write
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


def _two_leases() -> tuple[int, int]:
    """Two leases of 8 samples (0.6 samples/s for the 15 s lease target), of two volunteers."""
    make_campaign(target_batch_size=64, microbatch_size=4)
    leases = [leasing.request_lease(make_device(name)[0].pk, None, 0.6) for name in ("alice", "bob")]
    assert all(isinstance(lease, LeaseMessage) for lease in leases), leases
    return leases[0].lease_id, leases[1].lease_id


def test_an_acceptance_lands_on_an_active_lease_only() -> None:
    active, expired = _two_leases()
    Lease.objects.filter(pk=expired).update(state=Lease.State.EXPIRED, reason="agent went silent")
    at = timezone.now()

    _write([], [Finished(i, Lease.State.ACCEPTED, "", at, loss_sum=2.5, compute_s=0.75) for i in (active, expired)], {})

    row = Lease.objects.get(pk=active)
    assert (row.state, row.loss_sum, row.compute_s) == (Lease.State.ACCEPTED, 2.5, 0.75)
    assert abs(row.finished_at - at) < timedelta(milliseconds=1)
    assert Lease.objects.get(pk=expired).state == Lease.State.EXPIRED  # a late acceptance changes nothing


def test_an_ending_never_touches_a_lease_of_a_committed_step_and_keeps_its_reason_short() -> None:
    open_lease, committed = _two_leases()
    # A commit as the step's transaction leaves it: the lease's row names its step.
    step = Lease.objects.get(pk=committed).campaign.steps.create(index=0, num_samples=4, loss_sum=1.0)
    Lease.objects.filter(pk=committed).update(state=Lease.State.ACCEPTED, step=step)

    _write([], [Finished(i, Lease.State.EXPIRED, "x" * 300, timezone.now()) for i in (open_lease, committed)], {})

    ended = Lease.objects.get(pk=open_lease)
    assert (ended.state, ended.reason) == (Lease.State.EXPIRED, "x" * 200)
    assert Lease.objects.get(pk=committed).state == Lease.State.ACCEPTED
