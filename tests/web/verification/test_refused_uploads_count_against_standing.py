"""Uploads the aggregators refuse for their content count against the volunteer, once per lease, towards quarantine.

Before, a volunteer whose every upload was NaN was never checked (the
aggregators refused each upload first) and never quarantined.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler.models import Lease, SliceAssignment
from crowdtrain.verification import quarantine, refusals
from crowdtrain.verification.models import Refusal, Standing
from crowdtrain_agent.protocol import UploadRefused
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


def _lease(campaign: Campaign, device: Device) -> Lease:
    return Lease.objects.create(
        campaign=campaign, device=device, base_version=0, ranges=[[0, 0, 0, 4]], num_samples=4,
        deadline=timezone.now() + timedelta(minutes=5),
    )  # fmt: skip


def _refused(campaign: Campaign, lease_id: int, *, index: int = 0, code: str = "not finite") -> UploadRefused:
    return UploadRefused(
        campaign_id=campaign.pk, lease_id=lease_id, slice_index=index, code=code, detail="12 values are NaN"
    )


def _aggregator_of(campaign: Campaign, index: int = 0) -> int:
    return SliceAssignment.objects.get(campaign=campaign, index=index).aggregator_id


def test_two_refused_leases_quarantine_a_volunteer_with_no_checks() -> None:
    campaign = make_campaign(slices=2)
    device, _ = make_device("nan-sender")
    first, second = _lease(campaign, device), _lease(campaign, device)

    # Every slice of the first lease refused: one lease, counted once.
    assert refusals.note(_aggregator_of(campaign, 0), _refused(campaign, first.pk, index=0))
    assert not refusals.note(_aggregator_of(campaign, 1), _refused(campaign, first.pk, index=1))
    row = Standing.objects.get(volunteer=device.owner)
    assert (row.uploads_refused, row.state) == (1, Standing.State.GOOD)

    assert refusals.note(_aggregator_of(campaign, 0), _refused(campaign, second.pk))

    row.refresh_from_db()
    assert (row.uploads_refused, row.checks_failed, row.state) == (2, 0, Standing.State.QUARANTINED)
    assert "the aggregators refused 2 of its uploads" in row.reason


@pytest.mark.parametrize("code", ["stale version", "replayed upload", "incomplete upload", "norm bound", "busy"])
def test_a_refusal_an_honest_agent_can_meet_counts_for_nothing(code: str) -> None:
    campaign = make_campaign()
    device, _ = make_device("unlucky")
    lease = _lease(campaign, device)

    assert not refusals.note(_aggregator_of(campaign), _refused(campaign, lease.pk, code=code))

    assert not Refusal.objects.exists()
    assert not Standing.objects.filter(volunteer=device.owner, uploads_refused__gt=0).exists()


def test_an_aggregator_that_does_not_hold_the_slice_is_not_believed() -> None:
    campaign, other = make_campaign(), make_campaign()
    device, _ = make_device("target")
    lease = _lease(campaign, device)

    assert not refusals.note(_aggregator_of(other), _refused(campaign, lease.pk))

    assert not Refusal.objects.exists()


def test_a_refusal_that_came_before_its_lease_row_counts_once_the_row_is_written() -> None:
    campaign = make_campaign()
    device, _ = make_device("early")
    lease_id = _lease(campaign, device).pk + 1000  # a lease the batched records have not written yet

    assert refusals.note(_aggregator_of(campaign), _refused(campaign, lease_id))
    assert refusals.resolve() == 0
    Lease.objects.create(
        id=lease_id, campaign=campaign, device=device, base_version=0, ranges=[[0, 0, 4, 4]], num_samples=4,
        deadline=timezone.now() + timedelta(minutes=5),
    )  # fmt: skip

    assert refusals.resolve() == 1
    assert refusals.resolve() == 0, "counted once"
    assert Standing.objects.get(volunteer=device.owner).uploads_refused == 1


def test_a_refusal_whose_lease_never_appears_is_dropped() -> None:
    campaign = make_campaign()
    refusals.note(_aggregator_of(campaign), _refused(campaign, 987654))
    Refusal.objects.update(received_at=timezone.now() - timedelta(seconds=refusals.UNRESOLVED_FOR_S + 1))

    refusals.resolve()

    assert not Refusal.objects.exists()


def test_clearing_a_volunteer_forgets_their_refusals() -> None:
    campaign = make_campaign()
    device, _ = make_device("cleared")
    for _ in range(2):
        refusals.note(_aggregator_of(campaign), _refused(campaign, _lease(campaign, device).pk))
    assert Standing.objects.get(volunteer=device.owner).state == Standing.State.QUARANTINED

    assert quarantine.clear(device.owner_id, None)

    row = Standing.objects.get(volunteer=device.owner)
    assert (row.state, row.uploads_refused) == (Standing.State.GOOD, 0)


def test_an_aggregator_of_one_campaign_cannot_count_a_lease_of_another() -> None:
    campaign, other = make_campaign(), make_campaign()
    device, _ = make_device("bystander")
    lease = _lease(other, device)  # a lease of ``other``, reported as if it were ``campaign``'s

    refusals.note(_aggregator_of(campaign), _refused(campaign, lease.pk))

    assert not Standing.objects.filter(volunteer=device.owner, uploads_refused__gt=0).exists()
    assert not Refusal.objects.exists()
