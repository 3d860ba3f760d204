"""A campaign whose checkpoints fall too far behind its steps stops taking work, says why, and goes on by
itself once a checkpoint completes: what a crash may cost stays bounded however long storage is down."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.scheduler import backbone, leasing
from crowdtrain.scheduler.durability import durability
from crowdtrain_agent.protocol import CheckpointSaved, NoLease
from crowdtrain_agent.protocol import Lease as LeaseMessage
from tests.factories import commit_steps, make_campaign, make_device

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def bound(settings: Any) -> None:
    settings.CROWDTRAIN_CHECKPOINT_LAG_MAX = 3


def test_no_work_past_the_bound_until_a_checkpoint_completes_then_training_goes_on() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=2, slices=2)
    device, _ = make_device()
    commit_steps(campaign, device, 6)  # no checkpoint confirmed: storage is down

    refused = leasing.request_lease(device.pk, campaign.pk, None)
    for s in campaign.slices.all():
        backbone.checkpoint_saved(s.aggregator_id, CheckpointSaved(campaign_id=campaign.pk, slice_index=s.index,
                                                                   version=4))  # fmt: skip
    resumed = leasing.request_lease(device.pk, campaign.pk, None)

    assert isinstance(refused, NoLease) and refused.reason == "campaign_paused"
    assert "waits for its checkpoints: the newest complete one is version 0, and no more than 6" in refused.detail
    assert isinstance(resumed, LeaseMessage) and resumed.base_version == 6
    campaign.refresh_from_db()
    assert (durability(campaign).lag, durability(campaign).hold) == (2, 10)


def test_one_slice_confirming_is_not_enough() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=2, slices=2)
    device, _ = make_device()
    commit_steps(campaign, device, 6)
    first = campaign.slices.get(index=0)

    backbone.checkpoint_saved(first.aggregator_id, CheckpointSaved(campaign_id=campaign.pk, slice_index=0, version=6))

    assert isinstance(leasing.request_lease(device.pk, campaign.pk, None), NoLease)


def test_the_bound_never_holds_a_campaign_that_checkpoints_every_step_on_its_own_pipeline() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=1, staleness=1)

    campaign.committed_steps = 3  # applied 2, checkpointing 1: the usual distance with a staleness of 1

    assert durability(campaign).hold == 4  # one interval plus staleness plus two, not 3 x 1


def test_no_bound_with_the_setting_at_zero(settings: Any) -> None:
    settings.CROWDTRAIN_CHECKPOINT_LAG_MAX = 0
    unbounded = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=2)

    assert durability(unbounded).hold == -1
