from __future__ import annotations

import pytest

from crowdtrain.scheduler import leasing
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain.scheduler.tasks import expire_leases
from tests.conftest import FakeClock
from tests.factories import make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


def test_the_periodic_sweep_expires_overdue_leases_of_gone_agents_once(clock: FakeClock) -> None:
    campaign = make_campaign()
    gone, _ = make_device("gone")
    connected, _ = make_device("connected")
    overdue = leasing.request_lease(gone.pk, None, None)
    kept = leasing.request_lease(connected.pk, None, None)
    clock.advance(max(overdue.deadline_s, kept.deadline_s) + 1)
    hot_state().mark_seen([connected.pk])  # its socket is open: the site's housekeeping says so

    first = expire_leases()
    second = expire_leases()

    assert (first, second) == (1, 0)
    assert Lease.objects.get(pk=overdue.lease_id).state == Lease.State.EXPIRED
    assert Lease.objects.get(pk=kept.lease_id).state == Lease.State.ACTIVE
    assert redo_samples(campaign) == overdue.num_samples
