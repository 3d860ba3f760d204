"""The credit ledger: one grant per lease of a committed step, taken back by a reversal when the step is rolled back,
so every total equals the committed work."""

from __future__ import annotations

import pytest
from django.db.models import Sum

from crowdtrain.accounts.models import Profile, Team
from crowdtrain.credit import ledger
from crowdtrain.credit.models import FLOPS_PER_CREDIT, CreditEntry
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import SliceReady
from tests.factories import make_campaign, make_device, work_until_committed

pytestmark = pytest.mark.django_db


def _totals(**filters: object) -> int:
    return CreditEntry.objects.filter(**filters).aggregate(n=Sum("samples"))["n"] or 0


def test_a_committed_step_credits_each_lease_once_with_its_flops_volunteer_and_team() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    team = Team.objects.create(name="Night Owls")
    Profile.objects.filter(user=alice.owner).update(team=team)

    work_until_committed(campaign, [alice.pk, bob.pk], steps=2)

    committed = Lease.objects.filter(campaign=campaign, step__isnull=False)
    grants = CreditEntry.objects.filter(kind=CreditEntry.Kind.GRANT)
    per_sample = get_model(campaign.architecture).flops_per_sample(campaign.model_config)
    assert sorted(grants.values_list("lease_id", flat=True)) == sorted(committed.values_list("id", flat=True))
    for entry in grants:
        lease = committed.get(pk=entry.lease_id)
        assert (entry.samples, entry.flops) == (lease.num_samples, lease.num_samples * per_sample)
        assert entry.volunteer_id == lease.device.owner_id and entry.device_id == lease.device_id
        assert entry.team_id == (team.pk if lease.device_id == alice.pk else None)
        assert entry.credit == pytest.approx(entry.flops / FLOPS_PER_CREDIT)
    assert _totals() == 2 * 8


def test_crediting_a_step_again_adds_nothing() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    work_until_committed(campaign, [device.pk], steps=1)
    leases = [(lease.pk, lease.device_id, lease.num_samples) for lease in Lease.objects.filter(step__isnull=False)]

    ledger.grant(campaign.pk, 1.0, leases)  # a step write tried again after its transaction was retried

    assert CreditEntry.objects.count() == len(leases) and _totals() == 8


def test_a_rollback_takes_back_exactly_the_undone_steps_credit() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    work_until_committed(campaign, [alice.pk, bob.pk], steps=3)
    granted = CreditEntry.objects.filter(kind=CreditEntry.Kind.GRANT).count()

    backbone.restore_campaign(campaign.pk, 0)  # the operator restarts it from scratch: every step undone
    backbone.restore_campaign(campaign.pk, 0)  # asked twice: nothing more is taken back

    reversals = CreditEntry.objects.filter(kind=CreditEntry.Kind.REVERSAL)
    assert granted == Lease.objects.filter(campaign=campaign, state=Lease.State.REJECTED).count() >= 3
    assert reversals.count() == granted
    assert _totals() == 0 and _totals(volunteer=alice.owner) == 0
    assert all("rolled back to version 0" in r.reason for r in reversals)

    for s in campaign.slices.all():  # the aggregators load version 0 again
        backbone.slice_ready(s.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=s.index, version=0))
    work_until_committed(campaign, [alice.pk], steps=1)  # the redone work is credited afresh
    committed = Lease.objects.filter(campaign=campaign, step__isnull=False)
    assert _totals() == sum(committed.values_list("num_samples", flat=True)) == 8
    assert _totals(volunteer=alice.owner) == 8 and _totals(volunteer=bob.owner) == 0


def test_a_device_removed_later_keeps_its_volunteers_credit() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    owner = device.owner
    work_until_committed(campaign, [device.pk], steps=1)

    Lease.objects.filter(device=device).update(device=make_device("other")[0])  # the leases stay with the campaign
    device.delete()

    assert _totals(volunteer=owner) == 8 and not CreditEntry.objects.filter(device__isnull=False).exists()
