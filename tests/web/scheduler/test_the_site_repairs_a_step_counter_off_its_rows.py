"""The step counter equals the step rows; the site checks it every minute and repairs a campaign found off it
(the state an earlier race left: the counter stuck at 41 while rows went on to 60)."""

from __future__ import annotations

import pytest

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import invariants
from crowdtrain.scheduler.models import Checkpoint
from crowdtrain_agent.protocol import Rollback
from tests.factories import commit_steps, make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


def test_a_consistent_campaign_is_left_alone() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4)
    device, _ = make_device()
    commit_steps(campaign, device, 3)

    outbox = invariants.repair_step_counters()

    campaign.refresh_from_db()
    assert (invariants.counter_mismatches(), outbox, campaign.committed_steps) == ([], [], 3)


def test_a_counter_behind_its_rows_is_rolled_back_to_a_complete_checkpoint_below_it() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, slices=2, checkpoint_every=2)
    device, _ = make_device()
    commit_steps(campaign, device, 5)
    campaign.slices.update(version=5)  # the aggregators applied every row
    for s in campaign.slices.all():
        Checkpoint.objects.create(campaign=campaign, slice_index=s.index, version=2, aggregator_id=s.aggregator_id)
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=3, version=3)  # rows 3 and 4 are past it

    found = invariants.counter_mismatches()
    outbox = invariants.repair_step_counters()

    assert [(m.committed_steps, m.newest_row, m.rows) for m in found] == [(3, 4, 5)]
    campaign.refresh_from_db()
    assert (campaign.committed_steps, campaign.timeline, campaign.blocked_reason) == (2, 1, "")
    assert sorted(campaign.steps.values_list("index", flat=True)) == [0, 1]
    assert redo_samples(campaign) == 12  # steps 2, 3 and 4, each sample once
    assert sorted((a, m.version) for a, m in outbox if isinstance(m, Rollback)) == sorted(
        (s.aggregator_id, 2) for s in campaign.slices.all()
    )
    assert invariants.counter_mismatches() == []


def test_a_counter_off_with_no_checkpoint_below_it_blocks_the_campaign_with_the_reason() -> None:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, checkpoint_every=2)
    device, _ = make_device()
    commit_steps(campaign, device, 5)
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=3)

    invariants.repair_step_counters()

    campaign.refresh_from_db()
    assert "the step counter says 3 steps are committed, but it has 5 step rows" in campaign.blocked_reason
    assert "restore_campaign" in campaign.blocked_reason
    assert campaign.committed_steps == 3  # nothing undone without a checkpoint to go back to
