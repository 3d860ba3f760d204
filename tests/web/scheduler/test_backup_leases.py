"""A lease that runs long gets a backup on another device; the first valid report wins (MapReduce's backup tasks)."""

from __future__ import annotations

import pytest

from crowdtrain.scheduler import endings, leasing, parking, reporting
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import NoLease
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


HARD_DEADLINE_S = leasing.settings.CROWDTRAIN_LEASE_MIN_DEADLINE_S


def _measured(clock: FakeClock, device_id: int, seconds: float = 1.0) -> None:
    """The device takes a whole step and reports it after ``seconds``: the site has measured it (16 samples/s)."""
    lease = leasing.request_lease(device_id, None, 1000.0)
    assert isinstance(lease, LeaseMessage)
    clock.advance(seconds)
    assert reporting.report_done(device_id, done_for(lease.lease_id)).ack.accepted


def _slow_lease_and_backup(clock: FakeClock) -> tuple[LeaseMessage, LeaseMessage]:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    slow, _ = make_device("slow")
    helper, _ = make_device("helper")
    _measured(clock, slow.pk)  # a step in 1 s: the next is late at 2 s (BACKUP_FACTOR x its own time)
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
    assert rows[backup.lease_id].target_step == rows[original.lease_id].target_step


def test_the_backup_that_reports_first_commits_the_step_and_the_original_is_released(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)
    campaign = Lease.objects.get(pk=original.lease_id).campaign

    won = reporting.report_done(Lease.objects.get(pk=backup.lease_id).device_id, done_for(backup.lease_id))
    late = reporting.report_done(Lease.objects.get(pk=original.lease_id).device_id, done_for(original.lease_id))

    assert won.ack.accepted and [c.message.lease_ids for c in won.commits] == [[backup.lease_id]]
    assert not late.ack.accepted and late.ack.reason == "lease released: the backup lease finished first"
    assert Lease.objects.get(pk=original.lease_id).state == Lease.State.RELEASED
    assert redo_samples(campaign) == 0  # the samples are counted once, by the backup


def test_the_original_that_reports_first_wins_and_the_backup_is_released(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)

    won = reporting.report_done(Lease.objects.get(pk=original.lease_id).device_id, done_for(original.lease_id))
    late = reporting.report_done(Lease.objects.get(pk=backup.lease_id).device_id, done_for(backup.lease_id))

    assert [c.message.lease_ids for c in won.commits] == [[original.lease_id]]
    assert late.ack.reason == "lease released: the original lease finished first"


def test_a_failed_backup_leaves_the_samples_with_the_original_and_another_backup_may_follow(clock: FakeClock) -> None:
    original, backup = _slow_lease_and_backup(clock)
    campaign = Lease.objects.get(pk=original.lease_id).campaign
    third, _ = make_device("third")

    endings.release_lease(Lease.objects.get(pk=backup.lease_id).device_id, backup.lease_id)
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
        # Nobody has finished a lease yet: no history to be late against, so the hard deadline decides.
        clock.advance(HARD_DEADLINE_S + 1 if not committed else leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)
        lease = leasing.request_lease(honest.pk, None, 1000.0)
        if isinstance(lease, LeaseMessage):
            committed += len(reporting.report_done(honest.pk, done_for(lease.lease_id)).commits)

    campaign.refresh_from_db()
    assert isinstance(held, LeaseMessage)
    assert committed >= 4 and campaign.committed_steps == committed
    refusal = reporting.report_done(stalls.pk, done_for(held.lease_id))
    assert not refusal.ack.accepted


def test_a_backup_is_not_given_to_the_device_that_holds_the_original(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    device, _ = make_device()
    _measured(clock, device.pk)
    leasing.request_lease(device.pk, None, 1000.0)
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)

    again = leasing.request_lease(device.pk, None, 1000.0)

    assert isinstance(again, NoLease) and again.reason == "step_full"


def test_a_site_that_is_behind_gives_no_backups(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    slow, _ = make_device("slow")
    helper, _ = make_device("helper")
    _measured(clock, slow.pk)
    leasing.request_lease(slow.pk, None, 1000.0)
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)

    busy = leasing.ask_lease(helper.pk, None, 1000.0, backups=False).message
    later = leasing.request_lease(helper.pk, None, 1000.0)

    assert isinstance(busy, NoLease)  # its own backlog may be what makes the lease late
    assert isinstance(later, LeaseMessage)  # once it keeps up again, the step gets its backup


def test_a_late_lease_ahead_of_the_open_step_is_not_backed_up(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=1)
    first, second, third, fourth = (make_device(name)[0] for name in ("first", "second", "third", "fourth"))
    _measured(clock, first.pk)
    holds_open = leasing.request_lease(first.pk, None, 1000.0)  # step 0
    holds_ahead = leasing.request_lease(second.pk, None, 1000.0)  # step 1
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)  # both are late now

    backup = leasing.request_lease(third.pk, None, 1000.0)
    nothing = leasing.request_lease(fourth.pk, None, 1000.0)

    assert isinstance(backup, LeaseMessage) and backup.ranges == holds_open.ranges
    assert isinstance(nothing, NoLease)  # step 1's lease holds no commit back yet
    assert holds_ahead.ranges != holds_open.ranges


# ------------------------------------------------------------------ no finished work thrown away by design


def test_with_no_lease_finished_yet_only_the_hard_deadline_makes_a_lease_late(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    first, helper = make_device("first")[0], make_device("helper")[0]
    original = leasing.request_lease(first.pk, None, 1000.0)
    clock.advance(HARD_DEADLINE_S - 1)  # long, but nobody knows yet how long a lease takes here

    early = leasing.request_lease(helper.pk, None, 1000.0)
    clock.advance(2)
    late = leasing.request_lease(helper.pk, None, 1000.0)

    assert isinstance(early, NoLease) and early.reason == "step_full"
    assert isinstance(late, LeaseMessage) and late.ranges == original.ranges


def test_a_lease_is_late_against_its_own_devices_measured_time(clock: FakeClock) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    steady, helper = make_device("steady")[0], make_device("helper")[0]
    _measured(clock, steady.pk, seconds=10.0)  # a slow device: a step takes it 10 s
    _measured(clock, helper.pk, seconds=1.0)
    original = leasing.request_lease(steady.pk, None, 1000.0)
    clock.advance(15)  # slower than the swarm's typical lease, not than itself

    within = leasing.request_lease(helper.pk, None, 1000.0)
    clock.advance(6)  # past twice its own 10 s
    overdue = leasing.request_lease(helper.pk, None, 1000.0)

    assert isinstance(within, NoLease)
    assert isinstance(overdue, LeaseMessage) and overdue.ranges == original.ranges


def test_no_backup_goes_to_a_device_that_would_finish_after_the_original_has_already_taken(
    clock: FakeClock,
) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    quick, crawler, helper = make_device("quick")[0], make_device("crawler")[0], make_device("helper")[0]
    _measured(clock, crawler.pk, seconds=20.0)  # 20 s a step
    _measured(clock, helper.pk, seconds=1.0)
    _measured(clock, quick.pk, seconds=1.0)
    original = leasing.request_lease(quick.pk, None, 1000.0)
    clock.advance(4)  # late against its own 1 s

    too_slow = leasing.request_lease(crawler.pk, None, 1000.0)  # its backup could only lose: its upload wasted
    useful = leasing.request_lease(helper.pk, None, 1000.0)

    assert isinstance(too_slow, NoLease)
    assert isinstance(useful, LeaseMessage) and useful.ranges == original.ranges


def test_the_sweep_wakes_a_waiting_request_when_a_backup_is_due(clock: FakeClock) -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    slow, helper = make_device("slow")[0], make_device("helper")[0]
    _measured(clock, slow.pk)
    leasing.request_lease(slow.pk, None, 1000.0)
    refused = leasing.request_lease(helper.pk, None, 1000.0)
    assert isinstance(refused, NoLease) and refused.reason == "step_full"
    assert parking.park(campaign.pk, helper.pk, 1000.0, "channel-of-helper", ready_at=refused.ready_at_step)

    _, _, before = endings.expire_all_overdue()
    clock.advance(leasing.settings.CROWDTRAIN_BACKUP_MIN_S + 1)
    hot_state().mark_seen([slow.pk])
    _, _, after = endings.expire_all_overdue()

    assert before == {} and after == {campaign.pk: ["channel-of-helper"]}
