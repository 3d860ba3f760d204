"""A slice that holds a step's uploads but cannot apply them pauses the campaign with the reason, not a silent stall."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.organizers import grant_role
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.configs import run_state
from crowdtrain_agent.protocol import SliceReady, StepCommit, StepFailed
from tests.factories import commit_steps, logged_in, make_campaign, make_device

pytestmark = pytest.mark.django_db

DETAIL = "slice 0 could not apply step 0: RuntimeError: CUDA error: an illegal memory access was encountered"


def _fail_step_0(campaign: Campaign) -> list[tuple[int, object]]:
    s = campaign.slices.get()
    return backbone.step_failed(s.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=0, detail=DETAIL,
    ))  # fmt: skip


def _campaign_with_one_committed_step() -> Campaign:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, staleness=1)
    device, _ = make_device()
    commit_steps(campaign, device, 1)
    return campaign


def test_the_campaign_is_blocked_naming_the_aggregator_the_step_and_the_error() -> None:
    campaign = _campaign_with_one_committed_step()

    outbox = _fail_step_0(campaign)

    campaign.refresh_from_db()
    assert outbox == []
    name = campaign.slices.get().aggregator.name
    assert f"aggregator {name} could not apply step 0 to slice 0" in campaign.blocked_reason
    assert "RuntimeError: CUDA error" in campaign.blocked_reason
    assert f"manage.py restore_campaign {campaign.pk}" in campaign.blocked_reason
    assert campaign.committed_steps == 1  # nothing rolled back: the uploads are still there


def test_it_is_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    campaign = _campaign_with_one_committed_step()
    caplog.set_level(logging.ERROR, logger="crowdtrain.scheduler.backbone")

    _fail_step_0(campaign)

    assert any("could not apply step 0" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_no_more_leases_go_out_while_it_stands() -> None:
    campaign = _campaign_with_one_committed_step()

    _fail_step_0(campaign)

    campaign.refresh_from_db()
    leasing, why = run_state(campaign)
    assert not leasing and "waiting for aggregators: 0 of 1 slices ready" in why


def test_the_commit_is_not_sent_again_on_every_heartbeat() -> None:
    campaign = _campaign_with_one_committed_step()
    campaign.steps.update(committed_at=timezone.now() - timedelta(minutes=5))
    s = campaign.slices.get()

    _fail_step_0(campaign)

    assert backbone.stalled_commits(s.aggregator_id) == []


def test_the_slice_ready_again_unblocks_the_campaign_and_gets_the_step_again() -> None:
    campaign = _campaign_with_one_committed_step()
    s = campaign.slices.get()
    _fail_step_0(campaign)

    outbox = backbone.slice_ready(s.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=0, version=0))

    campaign.refresh_from_db()
    assert campaign.blocked_reason == ""
    assert [m.step for _, m in outbox if isinstance(m, StepCommit)] == [0]


def test_the_organizer_reads_it_on_the_campaign_page() -> None:
    campaign = _campaign_with_one_committed_step()
    _fail_step_0(campaign)
    grant_role(campaign.owner)
    client = logged_in(campaign.owner)

    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert "could not apply step 0 to slice 0" in page and "RuntimeError: CUDA error" in page


def test_a_failure_for_a_step_the_slice_is_past_changes_nothing() -> None:
    campaign = _campaign_with_one_committed_step()
    s = campaign.slices.get()
    s.version = 1
    s.save(update_fields=["version"])

    outbox = _fail_step_0(campaign)

    campaign.refresh_from_db()
    assert outbox == [] and campaign.blocked_reason == ""
