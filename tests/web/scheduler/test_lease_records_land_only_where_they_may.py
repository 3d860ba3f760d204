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


def test_a_lease_issued_and_ended_in_one_batch_is_written_with_its_outcome() -> None:
    kept, returned = _two_leases()
    rows = {row.pk: row for row in Lease.objects.filter(pk__in=(kept, returned))}
    Lease.objects.filter(pk__in=rows).delete()  # as if the batch that issued them had not been written yet
    at = timezone.now()
    outcomes = [
        Finished(kept, Lease.State.ACCEPTED, "", at, loss_sum=2.5, compute_s=0.75),
        Finished(kept, Lease.State.ACCEPTED, "", at, loss_sum=9.0, compute_s=9.0),  # only the first lands
        Finished(returned, Lease.State.RELEASED, "released by the agent", at),
    ]

    _write(list(rows.values()), outcomes, {})

    accepted, released = Lease.objects.get(pk=kept), Lease.objects.get(pk=returned)
    assert (accepted.state, accepted.loss_sum, accepted.compute_s) == (Lease.State.ACCEPTED, 2.5, 0.75)
    assert abs(accepted.finished_at - at) < timedelta(milliseconds=1)
    assert accepted.ranges == rows[kept].ranges and accepted.device_id == rows[kept].device_id
    assert (released.state, released.reason) == (Lease.State.RELEASED, "released by the agent")


def test_a_row_written_already_is_left_as_it_is_by_a_batch_that_issued_it_too() -> None:
    lease_id, _ = _two_leases()
    row = Lease.objects.get(pk=lease_id)
    Lease.objects.filter(pk=lease_id).update(state=Lease.State.EXPIRED, reason="agent went silent")

    _write([row], [], {})  # the other process's batch wrote it first

    assert Lease.objects.get(pk=lease_id).state == Lease.State.EXPIRED
