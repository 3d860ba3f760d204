from __future__ import annotations

import msgspec
import pytest
from django.test import override_settings

from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import shard_table
from crowdtrain.scheduler import endings, leasing, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import LeaseDone, NoLease, Receipt, verify_ticket
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device, receipts_for, redo_samples

pytestmark = pytest.mark.django_db


def test_it_leases_whole_microbatches_with_a_verifiable_ticket() -> None:
    campaign = make_campaign()
    device, _ = make_device()

    lease = leasing.request_lease(device.pk, None, None)

    assert isinstance(lease, LeaseMessage)
    assert lease.num_samples == 2 * campaign.microbatch_size
    assert sum(r.count for r in lease.ranges) == lease.num_samples
    ticket = verify_ticket(lease.ticket, ticket_key(campaign.pk))
    assert (ticket.lease_id, ticket.device_id, ticket.num_samples) == (lease.lease_id, device.pk, lease.num_samples)


def test_lease_size_follows_the_measured_speed_up_to_the_room_left_in_the_step() -> None:
    make_campaign(target_batch_size=400, microbatch_size=4)
    device, _ = make_device()

    with override_settings(CROWDTRAIN_LEASE_TARGET_S=10.0):
        slow = leasing.request_lease(device.pk, None, samples_per_s=1.0)
        fast = leasing.request_lease(device.pk, None, samples_per_s=1000.0)

    assert slow.num_samples == 8  # 10 s at 1 sample/s, rounded down to microbatches
    assert fast.num_samples == 400 - 8  # capped by what the step still needs


def test_it_commits_the_step_when_the_global_batch_is_full(clock: FakeClock) -> None:
    campaign = make_campaign(target_batch_size=16, microbatch_size=4)
    device, _ = make_device()
    first = leasing.request_lease(device.pk, None, 8.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    second = leasing.request_lease(device.pk, None, 8.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    clock.advance(1.0)  # held long enough for 0.1 s of compute

    one = reporting.report_done(device.pk, done_for(first.lease_id))
    two = reporting.report_done(device.pk, done_for(second.lease_id))

    assert one.ack.accepted and not one.commits
    assert two.ack.accepted and len(two.commits) == 1
    commit = two.commits[0].message
    assert (commit.step, commit.lease_ids, commit.num_samples) == (0, [first.lease_id, second.lease_id], 16)
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
    device.refresh_from_db()  # credited, and its speed is what its accepted leases took (0.1 s each)
    assert (device.samples_accepted, device.samples_per_s) == (16, pytest.approx(16 / 0.2))


def test_it_says_the_step_is_full_while_waiting_for_its_commit_when_synchronous() -> None:
    make_campaign(target_batch_size=8, microbatch_size=4, staleness=0)
    device, _ = make_device()
    leasing.request_lease(device.pk, None, None)

    refusal = leasing.request_lease(device.pk, None, None)

    assert isinstance(refusal, NoLease)
    assert refusal.reason == "step_full"
    assert refusal.retry_after_s > 0


def test_with_staleness_one_it_leases_ahead_for_the_next_step() -> None:
    make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    leasing.request_lease(device.pk, None, None)

    ahead = leasing.request_lease(device.pk, None, None)
    beyond = leasing.request_lease(device.pk, None, None)

    assert isinstance(ahead, LeaseMessage) and ahead.base_version == 0
    assert isinstance(beyond, NoLease) and beyond.reason == "step_full"


def test_it_rejects_a_done_report_for_another_devices_lease() -> None:
    make_campaign()
    owner, _ = make_device("owner")
    stranger, _ = make_device("stranger")
    lease = leasing.request_lease(owner.pk, None, None)

    outcome = reporting.report_done(stranger.pk, done_for(lease.lease_id))

    assert not outcome.ack.accepted
    assert outcome.ack.reason == "unknown lease"
    assert Lease.objects.get(pk=lease.lease_id).state == Lease.State.ACTIVE


def test_it_rejects_a_replayed_done_report() -> None:
    make_campaign(target_batch_size=32)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    reporting.report_done(device.pk, done_for(lease.lease_id))

    replay = reporting.report_done(device.pk, done_for(lease.lease_id))

    assert not replay.ack.accepted
    assert replay.ack.reason == "lease already reported"


def test_it_rejects_a_report_without_a_valid_receipt_and_requeues_the_samples() -> None:
    campaign = make_campaign(slices=2)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    forged = LeaseDone(
        lease_id=lease.lease_id,
        receipts=[receipts_for(lease.lease_id)[0], Receipt(slice_index=1, token="forged")],
        num_samples=lease.num_samples,
        loss_sum=1.0,
        compute_s=0.1,
    )

    outcome = reporting.report_done(device.pk, forged)

    assert not outcome.ack.accepted
    assert "receipt for slice 1" in outcome.ack.reason
    assert redo_samples(campaign) == lease.num_samples


def test_a_gone_agents_lease_expires_at_its_deadline_and_its_samples_go_to_the_next_lease(clock: FakeClock) -> None:
    campaign = make_campaign()
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    clock.advance(lease.deadline_s + 1)  # nothing heard from the agent meanwhile

    expired = endings.expire_overdue(campaign)
    outcome = reporting.report_done(device.pk, done_for(lease.lease_id))
    again = leasing.request_lease(device.pk, None, None)

    assert expired == 1
    assert Lease.objects.get(pk=lease.lease_id).reason == "deadline passed"
    assert not outcome.ack.accepted and outcome.ack.reason == "lease expired: deadline passed"
    assert again.ranges == lease.ranges


def test_a_released_lease_is_redone_by_the_next_one() -> None:
    make_campaign()
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)

    released = endings.release_lease(device.pk, lease.lease_id)
    again = leasing.request_lease(device.pk, None, None)

    assert released
    assert again.ranges == lease.ranges


def test_it_explains_why_there_is_no_work() -> None:
    device, _ = make_device()

    nothing = leasing.request_lease(device.pk, None, None)

    assert isinstance(nothing, NoLease)
    assert nothing.reason == "no_campaign"


def test_it_pauses_leasing_while_an_aggregator_is_missing() -> None:
    campaign = make_campaign()
    campaign.slices.update(ready=False)
    device, _ = make_device()

    refusal = leasing.request_lease(device.pk, campaign.pk, None)

    assert isinstance(refusal, NoLease)
    assert refusal.reason == "campaign_paused"
    assert "aggregators" in refusal.detail


def test_a_lease_overtaken_by_later_ones_still_counts_in_the_step_it_reserved() -> None:
    make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    speed = 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S
    first, second, third, fourth = (leasing.request_lease(device.pk, None, speed) for _ in range(4))

    early = [reporting.report_done(device.pk, done_for(lease.lease_id)) for lease in (third, fourth, second)]
    last = reporting.report_done(device.pk, done_for(first.lease_id))

    assert [o.ack.step for o in early] == [1, 1, 0]
    assert all(o.ack.accepted and not o.commits for o in early)
    assert [c.message.step for c in last.commits] == [0, 1]
    assert last.commits[0].message.lease_ids == [first.lease_id, second.lease_id]
    assert last.commits[1].message.lease_ids == [third.lease_id, fourth.lease_id]


def test_samples_of_an_expired_lease_refill_the_step_they_were_reserved_in(clock: FakeClock) -> None:
    make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    other, _ = make_device("other")
    speed = 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S
    lost = leasing.request_lease(device.pk, None, speed)
    leasing.request_lease(device.pk, None, speed)  # the rest of step 0 stays reserved
    clock.advance(lost.deadline_s + 1)  # the device went away with both

    refill = leasing.request_lease(other.pk, None, speed)

    assert Lease.objects.get(pk=refill.lease_id).target_step == 0
    assert refill.ranges == lost.ranges


def test_a_fast_device_gets_a_whole_step_even_with_others_around() -> None:
    make_campaign(target_batch_size=64, microbatch_size=4, staleness=1)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    fast = 1000.0  # a whole step is a fraction of a second for either

    first, second = (leasing.request_lease(device.pk, None, fast) for device in (alice, bob))

    # One lease per step: each lease costs a report and an upload, whatever its size.
    assert (first.num_samples, second.num_samples) == (64, 64)
    assert [Lease.objects.get(pk=lease.lease_id).target_step for lease in (first, second)] == [0, 1]


def _apply(campaign: Campaign, version: int) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(version=version)


def test_an_idle_device_is_served_before_a_busy_one_leases_ahead() -> None:
    campaign = make_campaign(target_batch_size=64, microbatch_size=4, staleness=1)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    step0 = leasing.request_lease(alice.pk, None, 1000.0)
    step1 = leasing.request_lease(alice.pk, None, 1000.0)  # nobody else asked: alice may lease ahead
    waiting = leasing.request_lease(bob.pk, None, 1000.0)  # step 2 needs version 1
    reporting.report_done(alice.pk, done_for(step0.lease_id))
    _apply(campaign, 1)

    ahead = leasing.request_lease(alice.pk, None, 1000.0)  # still computing step 1, bob has nothing
    served = leasing.request_lease(bob.pk, None, 1000.0)

    assert isinstance(step1, LeaseMessage) and isinstance(waiting, NoLease)
    assert isinstance(ahead, NoLease) and "idle volunteers are served" in ahead.detail
    assert isinstance(served, LeaseMessage)
    assert Lease.objects.get(pk=served.lease_id).target_step == 2


def test_a_device_that_went_silent_is_not_waited_for(clock: FakeClock) -> None:
    campaign = make_campaign(target_batch_size=64, microbatch_size=4, staleness=1)
    alice, _ = make_device("alice")
    gone, _ = make_device("gone")
    step0 = leasing.request_lease(alice.pk, None, 1000.0)
    leasing.request_lease(alice.pk, None, 1000.0)
    leasing.request_lease(gone.pk, None, 1000.0)  # refused: step 2 needs version 1
    reporting.report_done(alice.pk, done_for(step0.lease_id))
    _apply(campaign, 1)
    clock.advance(leasing.settings.CROWDTRAIN_GONE_AFTER_S + 1)  # "gone" never asked again

    ahead = leasing.request_lease(alice.pk, None, 1000.0)

    assert isinstance(ahead, LeaseMessage)
    assert Lease.objects.get(pk=ahead.lease_id).target_step == 2


def test_a_full_step_refusal_says_which_commit_makes_room() -> None:
    make_campaign(target_batch_size=64, microbatch_size=4, staleness=1)
    device, _ = make_device()
    leasing.request_lease(device.pk, None, 1000.0)  # all of step 0
    leasing.request_lease(device.pk, None, 1000.0)  # all of step 1, ahead on version 0

    refusal = leasing.request_lease(device.pk, None, 1000.0)  # step 2 needs version 1: step 0 committed

    assert isinstance(refusal, NoLease) and refusal.reason == "step_full"
    assert refusal.ready_at_step == 1


def test_leases_are_computed_on_the_newest_committed_version_before_the_aggregators_apply_it() -> None:
    campaign = make_campaign(target_batch_size=64, microbatch_size=4, staleness=0)
    device, _ = make_device()
    first = leasing.request_lease(device.pk, None, 1000.0)
    assert reporting.report_done(device.pk, done_for(first.lease_id)).commits

    following = leasing.request_lease(device.pk, None, 1000.0)

    campaign.refresh_from_db()
    assert (campaign.version, campaign.committed_steps) == (0, 1)  # no aggregator has applied step 0 yet
    assert isinstance(following, LeaseMessage) and following.base_version == 1
    assert Lease.objects.get(pk=following.lease_id).target_step == 1


@pytest.mark.parametrize("loss", [-1.0, 1e308])
def test_it_rejects_a_report_with_an_impossible_loss(loss: float) -> None:
    campaign = make_campaign()
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    report = done_for(lease.lease_id)

    outcome = reporting.report_done(device.pk, msgspec.structs.replace(report, loss_sum=loss))

    assert not outcome.ack.accepted
    assert "is outside 0..1e+06 per sample" in outcome.ack.reason
    assert redo_samples(campaign) == lease.num_samples


def test_a_resent_request_gets_the_same_lease_back() -> None:
    make_campaign(target_batch_size=64, microbatch_size=4)
    device, _ = make_device()

    first = leasing.request_lease(device.pk, None, 1.0, request_id="r-1")
    again = leasing.request_lease(device.pk, None, 1.0, request_id="r-1")
    other = leasing.request_lease(device.pk, None, 1.0, request_id="r-2")

    assert again.lease_id == first.lease_id and again.ranges == first.ranges
    assert verify_ticket(again.ticket, ticket_key(again.campaign_id)).lease_id == first.lease_id
    assert other.lease_id != first.lease_id
    assert Lease.objects.count() == 2


def test_an_invite_only_campaign_leases_only_to_devices_of_invited_volunteers() -> None:
    campaign = make_campaign(visibility=Campaign.Visibility.INVITE)
    stranger, _ = make_device("stranger")
    guest, _ = make_device("guest")
    campaign.invited.add(guest.owner)

    anything = leasing.request_lease(stranger.pk, None, None)
    this_one = leasing.request_lease(stranger.pk, campaign.pk, None)
    invited = leasing.request_lease(guest.pk, None, None)

    assert isinstance(anything, NoLease) and anything.reason == "no_campaign"
    assert isinstance(this_one, NoLease) and "invite-only" in this_one.detail
    assert isinstance(invited, LeaseMessage) and invited.campaign_id == campaign.pk
    assert not Lease.objects.filter(device=stranger).exists()


@pytest.mark.parametrize("speed", [1e-9, -5.0, 0.0])
def test_a_device_claiming_an_absurd_speed_cannot_hold_a_step_for_ever(speed: float) -> None:
    make_campaign(target_batch_size=16, microbatch_size=4)
    device, _ = make_device("claims-to-be-slow")

    with override_settings(CROWDTRAIN_LEASE_MAX_DEADLINE_S=600.0):
        lease = leasing.request_lease(device.pk, None, speed)

    assert lease.num_samples >= 4
    assert 0 < lease.deadline_s <= 600.0  # freed after ten minutes at most, and the step refilled


def test_a_reported_compute_time_longer_than_the_lease_was_held_is_cut_to_it() -> None:
    make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, None)
    report = done_for(lease.lease_id)

    reporting.report_done(device.pk, msgspec.structs.replace(report, compute_s=1e9))

    stored = Lease.objects.get(pk=lease.lease_id)
    assert 0.0 <= stored.compute_s <= (stored.finished_at - stored.issued_at).total_seconds()


def test_a_lease_names_the_shards_the_next_leases_will_read() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    table = shard_table(campaign.dataset)

    lease = leasing.request_lease(device.pk, None, None)

    campaign.refresh_from_db()
    at_cursor = table.locate(campaign.cursor)
    assert lease.prefetch == [table.sha256s[at_cursor], table.sha256s[(at_cursor + 1) % len(table.sha256s)]]


def test_a_lease_of_many_shards_names_as_many_ahead_up_to_a_bound() -> None:
    # 100 samples in 4 shards of 25: a lease of 40 samples reads two shards; the next one will read as many.
    campaign = make_campaign(target_batch_size=40, microbatch_size=4)
    device, _ = make_device()
    table = shard_table(campaign.dataset)

    lease = leasing.request_lease(device.pk, None, 1e9)  # a fast device: the whole step in one lease

    assert lease.num_samples == 40 and len(table.sha256s) == 4
    last = table.sha256s.index(lease.ranges[-1].shard)
    # From the lease's last shard on, until the shards after it hold another 40 samples: two more.
    assert lease.prefetch == [table.sha256s[(last + k) % 4] for k in range(3)]
    assert len(lease.prefetch) <= leasing.MAX_PREFETCH_SHARDS


def test_a_report_sent_again_after_its_step_committed_is_told_it_was_counted() -> None:
    make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    lease = leasing.request_lease(device.pk, None, 1000.0)
    assert reporting.report_done(device.pk, done_for(lease.lease_id)).commits

    again = reporting.report_done(device.pk, done_for(lease.lease_id))

    assert not again.ack.accepted and again.ack.reason == "lease already reported"
