from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Lease
from crowdtrain.scheduler.records import RecordWriter
from crowdtrain_agent.protocol import SliceReady, StepCommit, StepFailed
from tests.factories import commit_steps, make_campaign, make_device, redo_samples

pytestmark = pytest.mark.django_db


def test_a_slice_that_lost_its_uploads_makes_the_site_redo_those_steps() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1, slices=2)
    device, _ = make_device()
    lost = commit_steps(campaign, device, 1)
    first, second = campaign.slices.order_by("index")
    second.version = 1
    second.save()

    outbox = backbone.step_failed(first.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=0, missing_lease_ids=lost, detail="restarted",
    ))  # fmt: skip

    campaign.refresh_from_db()
    assert (campaign.committed_steps, campaign.version) == (0, 0)
    assert Lease.objects.get(pk=lost[0]).state == Lease.State.REJECTED
    assert redo_samples(campaign) == 8
    assert [(agg, type(m).__name__, m.version) for agg, m in outbox] == [(second.aggregator_id, "Rollback", 0)]


@pytest.mark.django_db(transaction=True)
def test_lease_records_are_written_before_the_campaign_is_locked_for_a_rollback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The writer thread holds its own lock while its batch waits for the campaign's row (a cursor
    # update); flushing with that row locked was a deadlock PostgreSQL cannot see, and froze a campaign.
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1, slices=2)
    device, _ = make_device()
    lost = commit_steps(campaign, device, 1)
    second = campaign.slices.get(index=1)
    second.version = 1
    second.save()
    in_transaction: list[bool] = []
    flush = RecordWriter.flush

    def watched(self: RecordWriter) -> None:
        in_transaction.append(connection.in_atomic_block)
        flush(self)

    monkeypatch.setattr(RecordWriter, "flush", watched)
    first = campaign.slices.get(index=0)
    backbone.step_failed(first.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=0, missing_lease_ids=lost, detail="restarted",
    ))  # fmt: skip
    backbone.slice_ready(first.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))
    backbone.restore_campaign(campaign.pk, 0)

    campaign.refresh_from_db()
    assert campaign.committed_steps == 0
    assert in_transaction == [False, False, False]


def test_a_commit_that_arrived_too_early_is_sent_again_with_the_ones_before_it() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    commit_steps(campaign, device, 2)
    s = campaign.slices.get()

    outbox = backbone.step_failed(s.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=1, detail="slice 0 is at version 0",
    ))  # fmt: skip

    assert [m.step for _, m in outbox if isinstance(m, StepCommit)] == [0, 1]


def test_commits_an_aggregator_never_applied_are_sent_again_once_overdue() -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    commit_steps(campaign, device, 1)
    s = campaign.slices.get()

    fresh = backbone.stalled_commits(s.aggregator_id)
    campaign.steps.update(committed_at=timezone.now() - timedelta(minutes=1))
    overdue = backbone.stalled_commits(s.aggregator_id)

    assert fresh == []
    assert [(agg, m.step) for agg, m in overdue] == [(s.aggregator_id, 0)]
