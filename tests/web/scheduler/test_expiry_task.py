from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from crowdtrain.scheduler import leasing
from crowdtrain.scheduler.models import Lease
from crowdtrain.scheduler.tasks import expire_leases
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


def test_the_periodic_sweep_expires_overdue_leases_once() -> None:
    campaign = make_campaign()
    device, _ = make_device()
    overdue = leasing.request_lease(device.pk, None, None)
    current = leasing.request_lease(device.pk, None, None)
    Lease.objects.filter(pk=overdue.lease_id).update(deadline=timezone.now() - timedelta(seconds=1))

    first = expire_leases()
    second = expire_leases()

    assert (first, second) == (1, 0)
    assert Lease.objects.get(pk=current.lease_id).state == Lease.State.ACTIVE
    assert sum(r.count for r in campaign.returned_ranges.all()) == overdue.num_samples
