"""A device's speed on My devices is a moving average of its steps' rates, not the last lease's rate."""

from __future__ import annotations

import msgspec
import pytest

from crowdtrain.accounts.models import Device
from crowdtrain.scheduler import leasing, reporting
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


def _step(device: Device, compute_s: float, clock: FakeClock) -> None:
    """One lease of 4 samples, the whole step, computed in ``compute_s`` (the step commits with it)."""
    lease = leasing.request_lease(device.pk, None, 1000.0)
    clock.advance(5.0)  # held longer than it computed: the compute time is not capped
    outcome = reporting.report_done(device.pk, msgspec.structs.replace(done_for(lease.lease_id), compute_s=compute_s))
    assert outcome.ack.accepted and len(outcome.commits) == 1


def test_the_first_rate_is_taken_as_it_is_then_each_step_weighs_one_fifth(clock: FakeClock) -> None:
    make_campaign(target_batch_size=4, microbatch_size=4)
    device, _ = make_device()
    speeds = []

    for compute_s in (0.1, 0.4, 0.2, 0.2):  # 40, 10, 20 and 20 samples/s
        _step(device, compute_s, clock)
        device.refresh_from_db()
        speeds.append(device.samples_per_s)

    # By hand: 40; 0.8 * 40 + 0.2 * 10 = 34; 0.8 * 34 + 0.2 * 20 = 31.2; 0.8 * 31.2 + 0.2 * 20 = 28.96
    assert speeds == pytest.approx([40.0, 34.0, 31.2, 28.96])
    assert device.samples_accepted == 16


def test_each_device_in_a_step_averages_its_own_rate(clock: FakeClock) -> None:
    make_campaign(target_batch_size=8, microbatch_size=4)
    fast, _ = make_device("fast")
    slow, _ = make_device("slow")
    Device.objects.filter(pk=fast.pk).update(samples_per_s=100.0)  # measured before; slow never was
    first = leasing.request_lease(fast.pk, None, 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    second = leasing.request_lease(slow.pk, None, 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S)
    clock.advance(5.0)

    reporting.report_done(fast.pk, msgspec.structs.replace(done_for(first.lease_id), compute_s=0.02))  # 200/s
    reporting.report_done(slow.pk, msgspec.structs.replace(done_for(second.lease_id), compute_s=2.0))  # 2/s

    fast.refresh_from_db()
    slow.refresh_from_db()
    assert fast.samples_per_s == pytest.approx(0.8 * 100.0 + 0.2 * 200.0)
    assert slow.samples_per_s == pytest.approx(2.0)
