"""Property: whatever the order of commits, rollbacks, expiries, quarantines and clearances, each volunteer's ledger
total equals the samples of their committed leases while they are in good standing, and nothing while quarantined
(granted once, taken back once, given back once, never left behind)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.db.models import Sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain.credit.models import CreditEntry
from crowdtrain.scheduler import backbone, endings, leasing, reporting
from crowdtrain.scheduler.models import Lease
from crowdtrain.verification import quarantine
from crowdtrain.verification.models import Standing
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import SliceReady
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device, make_text_dataset

OPS = st.sampled_from(["lease", "lease", "done", "done", "done", "crash", "roll_back", "quarantine", "clear"])


@pytest.mark.django_db
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(OPS, st.integers(0, 2)), max_size=40))
def test_each_volunteers_total_is_their_committed_work(
    ops: list[tuple[str, int]], clock: FakeClock, django_capture_on_commit_callbacks: Any
) -> None:
    campaign = make_campaign(make_text_dataset(num_samples=60, samples_per_shard=13), target_batch_size=8,
                             microbatch_size=2, staleness=1)  # fmt: skip
    devices = [make_device(f"v{campaign.pk}-{i}")[0] for i in range(3)]
    held: dict[int, list[int]] = {d.pk: [] for d in devices}

    for op, who in ops:
        device = devices[who]
        if op == "lease":
            lease = leasing.request_lease(device.pk, campaign.pk, None)
            if isinstance(lease, LeaseMessage):
                held[device.pk].append(lease.lease_id)
        elif op == "done" and held[device.pk]:
            reporting.report_done(device.pk, done_for(held[device.pk].pop(0)))
        elif op == "crash" and held[device.pk]:
            held[device.pk] = []
            clock.advance(leasing.settings.CROWDTRAIN_LEASE_MAX_DEADLINE_S + 1)
            endings.expire_overdue(campaign)
        elif op == "quarantine":
            with django_capture_on_commit_callbacks(execute=True):
                quarantine.quarantine(device.owner_id, "property test")
            held[device.pk] = []  # its leases were dropped
        elif op == "clear":
            with django_capture_on_commit_callbacks(execute=True):
                quarantine.clear(device.owner_id, None)
        elif op == "roll_back":
            backbone.restore_campaign(campaign.pk, 0)
            held = {d.pk: [] for d in devices}  # their leases were rejected with the steps
            for s in campaign.slices.all():
                backbone.slice_ready(
                    s.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=s.index, version=0)
                )

    committed: Counter[int] = Counter()
    quarantined = set(Standing.objects.exclude(state=Standing.State.GOOD).values_list("volunteer_id", flat=True))
    for owner, n in Lease.objects.filter(campaign=campaign, step__isnull=False).values_list(
        "device__owner", "num_samples"
    ):
        if owner not in quarantined:
            committed[owner] += n
    ledger = dict(
        CreditEntry.objects.filter(campaign=campaign)
        .values_list("volunteer")
        .annotate(n=Sum("samples"))
        .values_list("volunteer", "n")
    )
    assert {v: n for v, n in ledger.items() if n} == dict(committed)
    assert not CreditEntry.objects.filter(campaign=campaign, lease__step__isnull=False, kind="reversal").exists()
