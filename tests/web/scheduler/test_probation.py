"""Probation: a volunteer with no verified record holds no more of a step than its robust rule outvotes.

Seen in CI: the hostile agent of ``tests/trust`` started seconds before the four
honest ones and filled 139 of 160 leases of the campaign's steps alone. A
trimmed mean outvotes a minority, never a majority, so its flipped gradients went
into the model (validation loss 5.6 times the honest run's), and every check of
its leases was abandoned for want of another volunteer to copy them.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import configs, endings, leasing, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain.verification import standing
from crowdtrain.verification.models import Standing
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import NoLease
from tests.conftest import FakeClock, redis_lost_its_keys
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def leases_of_four(settings: Any) -> None:
    # Leases of at most 4 samples: a step of 16 has at least 4 leases, and a trimmed mean of 4 drops 1 at each end.
    settings.CROWDTRAIN_MAX_LEASE_SAMPLES = 4


def _trimmed(**fields: Any) -> Campaign:
    options: dict[str, Any] = {
        "target_batch_size": 16, "microbatch_size": 4, "staleness": 1, "check_fraction": 0.05,
        "aggregation": Campaign.Aggregation.TRIMMED_MEAN, "trim_fraction": 0.25,
    }  # fmt: skip
    options.update(fields)
    return make_campaign(**options)


def _leases(campaign: Campaign, device_id: int, asks: int = 6) -> tuple[list[LeaseMessage], NoLease | None]:
    """What ``asks`` requests of one device get: its leases, and the last refusal."""
    got, refused = [], None
    for _ in range(asks):
        answer = leasing.request_lease(device_id, campaign.pk, 1e6)
        if isinstance(answer, LeaseMessage):
            got.append(answer)
        else:
            refused = answer
    return got, refused


def _steps(leases: list[LeaseMessage]) -> list[int]:
    return sorted(Lease.objects.get(pk=lease.lease_id).target_step for lease in leases)


def test_a_newcomer_holds_one_lease_per_step_and_is_told_why() -> None:
    campaign = _trimmed()
    newcomer, _ = make_device("newcomer")

    got, refused = _leases(campaign, newcomer.pk)

    assert _steps(got) == [0, 1], "one lease in each step of the window (staleness 1)"
    assert refused is not None and refused.reason == "step_full" and refused.ready_at_step == 1
    assert "at most 1 of a step's leases" in refused.detail, refused.detail


def test_near_the_last_step_a_capped_newcomer_is_told_about_probation_not_the_last_step() -> None:
    campaign = _trimmed(max_steps=1)
    newcomer, _ = make_device("newcomer")

    got, refused = _leases(campaign, newcomer.pk)

    assert _steps(got) == [0]
    assert refused is not None and refused.ready_at_step == 1, refused
    assert "at most 1 of a step's leases" in refused.detail, refused.detail


def test_other_volunteers_fill_the_rest_of_the_step_and_it_commits() -> None:
    campaign = _trimmed(staleness=0)
    volunteers = [make_device(f"v{i}")[0] for i in range(4)]

    for device in volunteers:
        got, _ = _leases(campaign, device.pk, asks=3)
        assert len(got) == 1
        assert reporting.report_done(device.pk, done_for(got[0].lease_id)).ack.accepted

    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
    assert _leases(campaign, volunteers[0].pk, asks=1)[0], "the next step has room for them again"


def test_newcomers_fewer_than_a_steps_leases_fill_it_after_it_waited_and_one_alone_never_does(
    clock: FakeClock,
) -> None:
    # Issue 33: a campaign with fewer volunteers than leases per step must not stall on probation.
    campaign = _trimmed(staleness=0)
    alone, _ = make_device("alone")
    assert len(_leases(campaign, alone.pk)[0]) == 1
    clock.advance(settings.CROWDTRAIN_PROBATION_RELIEF_S + 1)
    got, refused = _leases(campaign, alone.pk)
    assert not got and refused is not None and "at most 1" in refused.detail, "one account never fills a step"

    others = [make_device(f"v{i}")[0] for i in range(2)]
    assert [len(_leases(campaign, device.pk)[0]) for device in others] == [1, 1]
    assert not _leases(campaign, alone.pk, asks=1)[0], "leases were just taken: others may still come"
    clock.advance(settings.CROWDTRAIN_PROBATION_RELIEF_S + 1)
    # Nobody took a lease for a relief period, three volunteers in the step: each may hold twice the cap of it.
    extra, _ = _leases(campaign, alone.pk)
    assert len(extra) == 1 and _steps(extra) == [0], "a step of four leases, three volunteers: one takes two"
    assert Lease.objects.filter(campaign=campaign, target_step=0).count() == 4, "the step is full: it can commit"


def test_the_cap_holds_until_the_step_has_waited(clock: FakeClock) -> None:
    campaign = _trimmed(staleness=0)
    devices = [make_device(f"v{i}")[0] for i in range(3)]
    for device in devices:
        assert len(_leases(campaign, device.pk)[0]) == 1
    clock.advance(settings.CROWDTRAIN_PROBATION_RELIEF_S / 2)
    assert not _leases(campaign, devices[0].pk, asks=1)[0]


def test_a_lease_given_back_frees_its_place_in_the_step() -> None:
    campaign = _trimmed(staleness=0)
    newcomer, _ = make_device("newcomer")
    (first,), _ = _leases(campaign, newcomer.pk)

    assert endings.release_lease(newcomer.pk, first.lease_id)
    again, _ = _leases(campaign, newcomer.pk)

    assert len(again) == 1 and _steps(again) == [0]


def test_verified_volunteers_the_organizer_and_campaigns_that_cannot_end_probation_are_not_limited() -> None:
    trimmed = _trimmed(staleness=0)
    veteran, _ = make_device("veteran")
    Standing.objects.create(volunteer_id=veteran.owner_id, checks_passed=standing.NEWCOMER_CHECKS)
    organizer, _ = make_device("organizer")  # make_campaign's owner
    assert trimmed.owner_id == organizer.owner_id

    assert len(_leases(trimmed, veteran.pk)[0]) == 4
    assert len(_leases(_trimmed(staleness=0), organizer.pk)[0]) == 4
    plain, _ = make_device("plain")
    assert len(_leases(_trimmed(staleness=0, aggregation=Campaign.Aggregation.MEAN), plain.pk)[0]) == 4
    unchecked, _ = make_device("unchecked")
    assert len(_leases(_trimmed(staleness=0, check_fraction=0.0), unchecked.pk)[0]) == 4


def test_the_limit_survives_a_redis_that_lost_the_scheduler_state() -> None:
    campaign = _trimmed(staleness=0)
    newcomer, _ = make_device("newcomer")
    assert len(_leases(campaign, newcomer.pk)[0]) == 1
    leasing.writer().flush()

    redis_lost_its_keys()  # rebuilt from the record at the next request

    got, refused = _leases(campaign, newcomer.pk)
    assert got == [] and refused is not None and "at most 1" in refused.detail


def test_a_rebuild_keeps_a_newcomers_reported_lease_over_a_live_one_the_record_still_shows() -> None:
    campaign = _trimmed(staleness=0)
    newcomer, _ = make_device("newcomer")
    (reported,), _ = _leases(campaign, newcomer.pk, asks=1)
    assert reporting.report_done(newcomer.pk, done_for(reported.lease_id)).ack.accepted
    leasing.writer().flush()
    # A second live lease of the same step in the record: what is left when another process had
    # queued, not written, the end of one when Redis lost its keys (the scripts never issue it).
    row = Lease.objects.get(pk=reported.lease_id)
    stale = Lease.objects.create(
        campaign=campaign, device=newcomer, base_version=0, target_step=0, ranges=[[0, 0, 4, 4]], epoch=0,
        num_samples=4, state=Lease.State.ACTIVE, issued_at=row.issued_at, deadline=row.deadline,
    )  # fmt: skip

    redis_lost_its_keys()
    got, refused = _leases(campaign, newcomer.pk)  # the first request rebuilds the state from the record

    leasing.writer().flush()
    stale.refresh_from_db()
    assert stale.state == Lease.State.EXPIRED and "superseded" in stale.reason
    assert Lease.objects.get(pk=reported.lease_id).state == Lease.State.ACCEPTED, "the reported work stays"
    assert got == [] and refused is not None and "at most 1" in refused.detail


@pytest.mark.parametrize(
    ("aggregation", "trim", "target", "expected"),
    [
        (Campaign.Aggregation.TRIMMED_MEAN, 0.25, 16, 1),  # 4 leases at least: 1 trimmed at each end
        (Campaign.Aggregation.TRIMMED_MEAN, 0.25, 40, 2),  # 10 leases: 2
        (Campaign.Aggregation.TRIMMED_MEAN, 0.1, 8, 1),  # 2 leases outvote nobody: still one lease
        (Campaign.Aggregation.CENTERED_CLIP, 0.1, 40, 4),  # a minority of 10
        (Campaign.Aggregation.MEAN, 0.25, 40, 0),  # the plain mean outvotes nobody: no probation
    ],
)
def test_the_limit_is_what_the_campaigns_rule_outvotes(
    aggregation: str, trim: float, target: int, expected: int
) -> None:
    campaign = _trimmed(aggregation=aggregation, trim_fraction=trim, target_batch_size=target)
    assert configs.probation_cap(campaign) == expected
