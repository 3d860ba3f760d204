"""The campaign's queue of waiting lease requests: a commit wakes as many as its room serves, in order,
and a wake that finds nobody to serve passes to the next in line."""

from __future__ import annotations

import pytest

from crowdtrain.scheduler import endings, leasing, parking, reporting
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db

WHOLE_STEP = 1e6


def test_a_commit_wakes_the_first_waiting_requests_whose_leases_fill_its_room() -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    device, _ = make_device()
    first = leasing.request_lease(device.pk, None, WHOLE_STEP)
    places = [parking.park(campaign.pk, device.pk, WHOLE_STEP, f"channel-{i}", 1) for i in range(3)]

    commits = reporting.report_done(device.pk, done_for(first.lease_id)).commits
    passed = parking.pass_on_wake(campaign.pk)
    nobody = [parking.pass_on_wake(campaign.pk) for _ in range(2)]

    assert all(places)
    assert commits[0].woken == ["channel-0"]  # a whole step of room: one lease's worth of waiters
    assert passed == ["channel-1"]  # channel-0 had nothing to serve: the next in line gets the room
    assert nobody == [["channel-2"], []]


def test_a_request_that_leaves_the_queue_is_not_woken() -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    device, _ = make_device()
    first = leasing.request_lease(device.pk, None, WHOLE_STEP)
    gone = parking.park(campaign.pk, device.pk, WHOLE_STEP, "gone", 1)
    parking.park(campaign.pk, device.pk, WHOLE_STEP, "stays", 1)

    parking.unpark(campaign.pk, gone or "")
    commits = reporting.report_done(device.pk, done_for(first.lease_id)).commits

    assert commits[0].woken == ["stays"]


def test_a_released_lease_wakes_the_first_request_waiting_for_the_next_step() -> None:
    # Its samples are back in the open step; left asleep, the request would wait for a commit that
    # itself waits for those samples (a dead agent's step stood still for the request's whole wait_s).
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    holder, _ = make_device("holder")
    waiter, _ = make_device("waiter")
    held = leasing.request_lease(holder.pk, None, WHOLE_STEP)
    assert parking.park(campaign.pk, waiter.pk, WHOLE_STEP, "waiting", 1)
    assert parking.pass_on_wake(campaign.pk) == []  # nothing was committed: it waits for the next step

    released = endings.release_leases(holder.pk, [held.lease_id], "agent disconnected")

    assert released.count == 1 and released.woken == {campaign.pk: ["waiting"]}
    again = leasing.request_lease(waiter.pk, None, WHOLE_STEP)
    assert again.num_samples == held.num_samples  # the released samples, at once


def test_a_verification_copy_calls_the_first_request_of_a_volunteer_who_may_take_it() -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4, staleness=0)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")
    leasing.request_lease(alice.pk, None, WHOLE_STEP)
    for device, channel in [(alice, "alice"), (bob, "bob"), (carol, "carol")]:
        assert parking.park(campaign.pk, device.pk, WHOLE_STEP, channel, 1)

    called = parking.wake_for_copy(campaign.pk, [alice.owner_id])
    again = parking.wake_for_copy(campaign.pk, [alice.owner_id, carol.owner_id])

    assert called == ["bob"]  # the first in line is the copy's own volunteer: passed over, not woken
    assert again == []  # nobody left who may take it: the copy waits for the next request
    assert parking.pass_on_wake(campaign.pk, any_step=True) == ["alice"]  # still in line, in order
    assert parking.pass_on_wake(campaign.pk, any_step=True) == ["carol"]
