"""Property: within an epoch every sample lands in exactly one committed step,
whatever agents crash, retry, replay or run late."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings, strategies as st

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import backbone, leasing
from crowdtrain.scheduler.models import Lease
from crowdtrain_agent.protocol import Lease as LeaseMessage, StepApplied
from tests.factories import done_for, make_campaign, make_device, make_text_dataset

OPS = st.sampled_from(["lease", "lease", "done", "done", "replay", "crash", "late", "release", "apply"])


def _apply_all(campaign: Campaign) -> None:
    """Play the aggregators: apply every committed step."""
    campaign.refresh_from_db()
    for s in campaign.slices.all():
        backbone.step_applied(s.aggregator_id, StepApplied(
            campaign_id=campaign.pk, slice_index=s.index, step=campaign.committed_steps - 1,
            version=campaign.committed_steps,
        ))  # fmt: skip


def _committed_samples(campaign: Campaign) -> Counter[tuple[int, int, int]]:
    shards = dict(campaign.dataset.shards.values_list("index", "first_sample"))
    counted: Counter[tuple[int, int, int]] = Counter()
    for lease in Lease.objects.filter(campaign=campaign, step__isnull=False):
        for epoch, shard, start, count in lease.ranges:
            for i in range(start, start + count):
                counted[(epoch, shards[shard] + i, 0)] += 1
    return counted


@pytest.mark.django_db
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(OPS, st.integers(0, 2)), max_size=40), staleness=st.integers(0, 1))
def test_every_sample_of_an_epoch_is_counted_exactly_once(ops: list[tuple[str, int]], staleness: int) -> None:
    campaign = make_campaign(make_text_dataset(num_samples=40, samples_per_shard=13), target_batch_size=8,
                             microbatch_size=2, staleness=staleness, slices=2)
    devices = [make_device(f"v{campaign.pk}-{i}")[0] for i in range(3)]
    held: dict[int, list[int]] = {d.pk: [] for d in devices}
    reported: list[tuple[int, int]] = []

    for op, who in ops:
        device = devices[who]
        if op == "lease":
            lease = leasing.request_lease(device.pk, campaign.pk, None)
            if isinstance(lease, LeaseMessage):
                held[device.pk].append(lease.lease_id)
        elif op == "done" and held[device.pk]:
            lease_id = held[device.pk].pop(0)
            leasing.report_done(device.pk, done_for(lease_id))
            reported.append((device.pk, lease_id))
        elif op == "replay" and reported:
            leasing.report_done(*reported[who % len(reported)][:1], done_for(reported[who % len(reported)][1]))
        elif op == "crash":
            device.last_seen_at = timezone.now() - timedelta(minutes=5)
            device.save(update_fields=["last_seen_at"])
            leasing.expire_overdue(Campaign.objects.get(pk=campaign.pk))
            device.last_seen_at = timezone.now()
            device.save(update_fields=["last_seen_at"])
        elif op == "late" and held[device.pk]:
            Lease.objects.filter(pk=held[device.pk][0]).update(deadline=timezone.now() - timedelta(seconds=1))
        elif op == "release" and held[device.pk]:
            leasing.release_lease(device.pk, held[device.pk].pop())
        elif op == "apply":
            _apply_all(campaign)

    # Drain: the agents of the random phase vanish (their leases run out), and one
    # well-behaved agent works until every sample of epoch 0 is in a committed step.
    Lease.objects.filter(campaign=campaign, state=Lease.State.ACTIVE).update(deadline=timezone.now() - timedelta(seconds=1))
    worker = devices[0]
    for _ in range(60):
        counted = _committed_samples(campaign)
        if sum(1 for (epoch, _, _) in counted if epoch == 0) == 40:
            break
        _apply_all(campaign)
        lease = leasing.request_lease(worker.pk, campaign.pk, None)
        if isinstance(lease, LeaseMessage):
            leasing.report_done(worker.pk, done_for(lease.lease_id))
        else:
            Lease.objects.filter(campaign=campaign, state=Lease.State.ACTIVE).update(
                deadline=timezone.now() - timedelta(seconds=1)
            )

    counted = _committed_samples(campaign)
    epoch0 = {key: n for key, n in counted.items() if key[0] == 0}
    assert len(epoch0) == 40, f"only {len(epoch0)} of 40 samples of epoch 0 were committed"
    assert set(epoch0.values()) == {1}, f"samples counted twice: {[k for k, n in epoch0.items() if n > 1]}"
    assert max(counted.values()) == 1
