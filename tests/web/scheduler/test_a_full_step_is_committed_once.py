"""A full step goes to one committer, however many reports and sweeps notice it; if that one dies
before the step reaches the database, the next caller after a while takes over."""

from __future__ import annotations

import pytest

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import endings, leasing, reporting
from crowdtrain.scheduler.hotstate import hot_state
from tests.conftest import FakeClock
from tests.factories import done_for, make_campaign, make_device

pytestmark = pytest.mark.django_db


def _report_in_redis_only(campaign: Campaign, device_id: int, lease_id: int) -> dict[str, object]:
    """The done script alone, as a site process that dies before writing the step would have run it."""
    report = done_for(lease_id)
    return hot_state().run("done", campaign.hot_key.hex, {
        "id": lease_id, "device": device_id, "n": report.num_samples, "loss": report.loss_sum, "cs": 0.1,
        "problem": "", "gen": int(hot_state().snapshot(campaign.hot_key.hex)["meta"]["gen"]),
    })  # fmt: skip


def test_the_step_is_handed_to_one_committer_and_taken_over_when_it_died(clock: FakeClock) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    speed = 4.0 / leasing.settings.CROWDTRAIN_LEASE_TARGET_S
    first, second, ahead = (leasing.request_lease(device.pk, None, speed) for _ in range(3))
    reporting.report_done(device.pk, done_for(first.lease_id))

    claimed = _report_in_redis_only(campaign, device.pk, second.lease_id)  # fills step 0; its process dies
    meanwhile = reporting.report_done(device.pk, done_for(ahead.lease_id))
    clock.advance(11)
    taken_over = endings.sweep_campaign(campaign.pk).commits

    assert claimed["commit"] and claimed["commit"]["step"] == 0  # type: ignore[index]
    assert meanwhile.ack.accepted and not meanwhile.commits  # the step is someone else's to write
    assert [c.message.step for c in taken_over] == [0]
    assert taken_over[0].message.lease_ids == [first.lease_id, second.lease_id]
    campaign.refresh_from_db()
    assert campaign.committed_steps == 1
