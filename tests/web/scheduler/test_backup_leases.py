"""A lease that runs long gets a backup on another device; the first valid report wins (MapReduce's backup tasks)."""

from __future__ import annotations

import pytest

from crowdtrain.scheduler import leasing
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import NoLease
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


def _slow_lease_and_backup(clock: FakeClock) -> tuple[LeaseMessage, LeaseMessage]:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    slow, _ = make_device("slow")
    helper, _ = make_device("helper")
    original = leasing.request_lease(slow.pk, None, 1000.0)  # a whole step
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)
    backup = leasing.request_lease(helper.pk, None, 1000.0)
    assert isinstance(original, LeaseMessage) and isinstance(backup, LeaseMessage)
    return original, backup


def test_a_lease_past_its_soft_deadline_is_given_to_another_device_too(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)

    assert backup.lease_id != original.lease_id
    assert backup.ranges == original.ranges
    rows = {row.pk: row for row in Lease.objects.filter(pk__in=[original.lease_id, backup.lease_id])}
    assert rows[backup.lease_id].target_step == rows[original.lease_id].target_step == 0


def test_the_backup_that_reports_first_commits_the_step_and_the_original_is_released(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)
    campaign = Lease.objects.get(pk=original.lease_id).campaign

    won = leasing.report_done(Lease.objects.get(pk=backup.lease_id).device_id, done_for(backup.lease_id))
    late = leasing.report_done(Lease.objects.get(pk=original.lease_id).device_id, done_for(original.lease_id))

    assert won.ack.accepted and [c.message.lease_ids for c in won.commits] == [[backup.lease_id]]
    assert not late.ack.accepted and late.ack.reason == "lease released: the backup lease finished first"
    assert Lease.objects.get(pk=original.lease_id).state == Lease.State.RELEASED
    assert redo_samples(campaign) == 0  # the samples are counted once, by the backup


def test_the_original_that_reports_first_wins_and_the_backup_is_released(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)

    won = leasing.report_done(Lease.objects.get(pk=original.lease_id).device_id, done_for(original.lease_id))
    late = leasing.report_done(Lease.objects.get(pk=backup.lease_id).device_id, done_for(backup.lease_id))

    assert [c.message.lease_ids for c in won.commits] == [[original.lease_id]]
    assert late.ack.reason == "lease released: the original lease finished first"


def test_a_failed_backup_leaves_the_samples_with_the_original_and_another_backup_may_follow(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)
    campaign = Lease.objects.get(pk=original.lease_id).campaign
    third, _ = make_device("third")

    leasing.release_lease(Lease.objects.get(pk=backup.lease_id).device_id, backup.lease_id)
    again = leasing.request_lease(third.pk, None, 1000.0)

    assert redo_samples(campaign) == 0
    assert isinstance(again, LeaseMessage) and again.ranges == original.ranges


def test_a_device_that_holds_a_lease_and_never_reports_does_not_stall_the_campaign(clock: FakeClock) -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    stalls, _ = make_device("stalls")
    honest, _ = make_device("honest")
    held = leasing.request_lease(stalls.pk, None, 1e9)  # claims a huge speed, then sits on the whole step
    committed = 0
    for _ in range(5):
        hot_state().mark_seen([stalls.pk])  # its socket stays open: it is never expired
        clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)
        lease = leasing.request_lease(honest.pk, None, 1000.0)
        if isinstance(lease, LeaseMessage):
            committed += len(leasing.report_done(honest.pk, done_for(lease.lease_id)).commits)

    campaign.refresh_from_db()
    assert isinstance(held, LeaseMessage)
    assert committed >= 4 and campaign.committed_steps == committed
    refusal = leasing.report_done(stalls.pk, done_for(held.lease_id))
    assert not refusal.ack.accepted


def test_a_backup_is_not_given_to_the_device_that_holds_the_original(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    device, _ = make_device()
    leasing.request_lease(device.pk, None, 1000.0)
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)

    again = leasing.request_lease(device.pk, None, 1000.0)

    assert isinstance(again, NoLease) and again.reason == "step_full"


def test_a_site_that_is_behind_gives_no_backups(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    slow, _ = make_device("slow")
    helper, _ = make_device("helper")
    leasing.request_lease(slow.pk, None, 1000.0)
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)

    busy = leasing.ask_lease(helper.pk, None, 1000.0, backups=False).message
    later = leasing.request_lease(helper.pk, None, 1000.0)

    assert isinstance(busy, NoLease)  # its own backlog may be what makes the lease late
    assert isinstance(later, LeaseMessage)  # once it keeps up again, the step gets its backup


def test_a_late_lease_ahead_of_the_open_step_is_not_backed_up(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=1)
    first, second, third, fourth = (make_device(name)[0] for name in ("first", "second", "third", "fourth"))
    holds_open = leasing.request_lease(first.pk, None, 1000.0)  # step 0
    holds_ahead = leasing.request_lease(second.pk, None, 1000.0)  # step 1
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)  # both are late now

    backup = leasing.request_lease(third.pk, None, 1000.0)
    nothing = leasing.request_lease(fourth.pk, None, 1000.0)

    assert isinstance(backup, LeaseMessage) and backup.ranges == holds_open.ranges
    assert isinstance(nothing, NoLease)  # step 1's lease holds no commit back yet
    assert holds_ahead.ranges != holds_open.ranges
