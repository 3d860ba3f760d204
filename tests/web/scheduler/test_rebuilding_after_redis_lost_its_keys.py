"""Redis keeps no durable truth: when it loses the scheduler's keys, the database's record rebuilds them."""

from __future__ import annotations

import pytest

from crowdtrain.scheduler import leasing, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.conftest import FakeClock, redis_lost_its_keys
from tests.factories import done_for, make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


def _lose_redis() -> None:
    redis_lost_its_keys()


def test_leases_in_flight_still_count_after_redis_lost_its_keys() -> None:
    make_campaign(target_batch_size=16, microbatch_size=4)
    device, _ = make_device()
    first = leasing.request_lease(device.pk, None, 8.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    second = leasing.request_lease(device.pk, None, 8.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    reporting.report_done(device.pk, done_for(first.lease_id))

    _lose_redis()
    outcome = reporting.report_done(device.pk, done_for(second.lease_id))

    assert outcome.ack.accepted
    assert [c.message.lease_ids for c in outcome.commits] == [[first.lease_id, second.lease_id]]


def test_the_cursor_resumes_past_every_recorded_lease_and_nothing_is_leased_twice() -> None:
    campaign = make_campaign(target_batch_size=64, microbatch_size=4)
    device, _ = make_device()
    before = [leasing.request_lease(device.pk, None, None) for _ in range(3)]

    _lose_redis()
    after = leasing.request_lease(device.pk, None, None)

    taken = {(r.shard, r.start + i) for lease in before for r in lease.ranges for i in range(r.count)}
    assert isinstance(after, LeaseMessage)
    assert not taken & {(r.shard, r.start + i) for r in after.ranges for i in range(r.count)}
    assert redo_samples(campaign) == 0


def test_samples_of_leases_the_record_never_heard_of_are_redone() -> None:
    campaign = make_campaign(target_batch_size=64, microbatch_size=4)
    device, _ = make_device()
    lost = leasing.request_lease(device.pk, None, None)
    kept = leasing.request_lease(device.pk, None, None)
    Lease.objects.filter(pk=lost.lease_id).delete()  # a process died before its batch reached the database

    _lose_redis()
    refused = reporting.report_done(device.pk, done_for(kept.lease_id))  # loads the state again

    assert refused.ack.accepted
    assert redo_samples(campaign) == lost.num_samples


def test_of_two_live_leases_over_the_same_samples_only_the_newer_survives(clock: FakeClock) -> None:
    make_campaign(target_batch_size=64, microbatch_size=4)
    gone, _ = make_device("gone")
    other, _ = make_device("other")
    old = leasing.request_lease(gone.pk, None, None)
    clock.advance(old.deadline_s + 1)
    new = leasing.request_lease(other.pk, None, None)  # expires the old lease and takes its samples
    assert new.ranges == old.ranges
    Lease.objects.filter(pk=old.lease_id).update(state=Lease.State.ACTIVE, reason="")  # its end never got written

    _lose_redis()
    stale = reporting.report_done(gone.pk, done_for(old.lease_id))
    fresh = reporting.report_done(other.pk, done_for(new.lease_id))

    assert not stale.ack.accepted
    assert fresh.ack.accepted
    assert Lease.objects.get(pk=old.lease_id).reason == "superseded when the scheduler restarted"


def test_a_live_lease_over_samples_of_a_committed_step_is_not_revived() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, 1000.0)
    assert reporting.report_done(device.pk, done_for(lease.lease_id)).commits
    ghost = Lease.objects.get(pk=lease.lease_id)
    ghost.pk, ghost.step, ghost.state = None, None, Lease.State.ACTIVE  # a stale row over the same samples
    ghost.save()

    _lose_redis()
    refused = reporting.report_done(device.pk, done_for(ghost.pk))

    assert not refused.ack.accepted
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
