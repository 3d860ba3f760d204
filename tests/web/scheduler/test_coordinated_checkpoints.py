"""The site's side of checkpoints: which versions are complete, where a lost slice goes, and who unblocks it."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.organizers import grant_role
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Checkpoint
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    BackboneHello,
    CheckpointComplete,
    CheckpointSaved,
    Rollback,
    SliceAssignment,
    SliceLost,
    SliceReady,
    StepApplied,
    StepFailed,
)
from tests.factories import commit_steps, make_campaign, make_device, make_user

pytestmark = pytest.mark.django_db


def confirm(campaign: Campaign, version: int, slices: list[int] | None = None) -> list[tuple[int, object]]:
    outbox: list[tuple[int, object]] = []
    for s in campaign.slices.order_by("index"):
        if slices is None or s.index in slices:
            saved = CheckpointSaved(campaign_id=campaign.pk, slice_index=s.index, version=version)
            outbox += backbone.checkpoint_saved(s.aggregator_id, saved)
    return outbox


def stepped(steps: int, *, slices: int = 2, checkpoint_every: int = 2) -> Campaign:
    campaign = make_campaign(target_batch_size=4, microbatch_size=4, staleness=1, slices=slices,
                             checkpoint_every=checkpoint_every)  # fmt: skip
    device, _ = make_device()
    commit_steps(campaign, device, steps)
    campaign.slices.update(version=steps)
    campaign.version = steps
    campaign.save(update_fields=["version"])
    return campaign


def test_a_version_is_complete_once_every_slice_confirmed_it_and_the_aggregators_hear_so() -> None:
    campaign = stepped(4)

    assert confirm(campaign, 2, slices=[0]) == []
    assert backbone.complete_versions(campaign) == []
    outbox = confirm(campaign, 2, slices=[1])

    assert backbone.complete_versions(campaign) == [2]
    aggregators = sorted(campaign.slices.values_list("aggregator_id", flat=True))
    assert outbox == [(a, CheckpointComplete(campaign_id=campaign.pk, versions=[2])) for a in aggregators]


def test_a_confirmation_of_a_version_never_committed_or_from_a_stranger_is_ignored() -> None:
    campaign = stepped(2)
    other = make_campaign(slices=1)
    stranger = other.slices.get().aggregator_id

    assert backbone.checkpoint_saved(stranger, CheckpointSaved(campaign_id=campaign.pk, slice_index=0, version=2)) == []
    owner = campaign.slices.get(index=0).aggregator_id
    assert backbone.checkpoint_saved(owner, CheckpointSaved(campaign_id=campaign.pk, slice_index=0, version=9)) == []
    assert not Checkpoint.objects.filter(campaign=campaign).exists()


def test_a_slice_is_assigned_its_own_version_with_the_newest_complete_one_to_fall_back_to() -> None:
    campaign = stepped(5)
    confirm(campaign, 2)
    confirm(campaign, 4, slices=[0])  # slice 1 never confirmed v4
    s = campaign.slices.get(index=1)

    outbox = backbone.aggregator_joined(s.aggregator_id, _hello(), channel_name="x")

    assignments = [m for _, m in outbox if isinstance(m, SliceAssignment)]
    assert [(m.version, m.restore_version) for m in assignments] == [(5, 2)]


def test_a_lost_slice_resumes_from_the_complete_version_and_rolls_back_everyone_once() -> None:
    campaign = stepped(5)
    confirm(campaign, 4)
    first, second = campaign.slices.order_by("index")

    outbox = backbone.slice_ready(first.aggregator_id, SliceReady(campaign_id=campaign.pk, slice_index=0, version=4))
    # The same failure noticed again (its replayed commit failing for lost uploads): nothing more happens.
    again = backbone.step_failed(first.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=4, missing_lease_ids=[1], detail="restarted",
    ))  # fmt: skip

    campaign.refresh_from_db()
    assert (campaign.committed_steps, campaign.version) == (4, 4)
    assert [(a, m) for a, m in outbox if isinstance(m, Rollback)] == [
        (second.aggregator_id, Rollback(campaign_id=campaign.pk, version=4, timeline=1))
    ]
    assert not [m for _, m in again if isinstance(m, Rollback)]


def test_a_failed_step_with_slices_ahead_goes_back_to_a_complete_version_not_one_they_lack() -> None:
    campaign = stepped(5)
    confirm(campaign, 2)
    first, second = campaign.slices.order_by("index")
    first.version = 3
    first.save(update_fields=["version"])

    outbox = backbone.step_failed(first.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=3, missing_lease_ids=[3], detail="restarted",
    ))  # fmt: skip

    campaign.refresh_from_db()
    assert campaign.committed_steps == 2
    assert sorted((a, m.version) for a, m in outbox if isinstance(m, Rollback)) == sorted(
        [(first.aggregator_id, 2), (second.aggregator_id, 2)]
    )


def test_a_slice_lost_without_a_complete_checkpoint_blocks_the_campaign_and_says_why() -> None:
    campaign = stepped(5)
    s = campaign.slices.get(index=0)

    backbone.slice_lost(
        s.aggregator_id, SliceLost(campaign_id=campaign.pk, slice_index=0, version=5, detail="disk gone")
    )

    campaign.refresh_from_db()
    assert f"aggregator {s.aggregator.name} lost slice 0 (disk gone); newest complete checkpoint: none" in (
        campaign.blocked_reason
    )
    assert campaign.committed_steps == 5  # nothing was reset
    assert not campaign.slices.get(index=0).ready
    assert backbone.restore_target(campaign) is None


def test_restoring_needs_a_complete_version_or_zero_and_reassigns_every_slice() -> None:
    campaign = stepped(5)
    confirm(campaign, 2)
    campaign.blocked_reason = "lost"
    campaign.save(update_fields=["blocked_reason"])

    with pytest.raises(ValueError, match="complete versions: 2"):
        backbone.restore_campaign(campaign.pk, 4)
    outbox = backbone.restore_campaign(campaign.pk, 2)

    campaign.refresh_from_db()
    assert (campaign.committed_steps, campaign.blocked_reason) == (2, "")
    assert sorted((m.version, m.restore_version) for _, m in outbox) == [(2, 2), (2, 2)]


def test_the_command_lists_the_choices_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    campaign = stepped(5)
    confirm(campaign, 4)

    call_command("restore_campaign", str(campaign.pk))
    assert "complete checkpoints: 4" in capsys.readouterr().out
    with pytest.raises(CommandError, match="complete versions: 4"):
        call_command("restore_campaign", str(campaign.pk), "--to", "3")
    call_command("restore_campaign", str(campaign.pk), "--from-scratch")

    campaign.refresh_from_db()
    assert campaign.committed_steps == 0
    assert Device.objects.get().samples_accepted == 0  # the credit went with the steps


def test_the_campaign_page_shows_the_block_and_only_staff_can_restore(client: Client) -> None:
    campaign = stepped(5)
    confirm(campaign, 4)
    campaign.blocked_reason = "aggregator agg-1 lost slice 0; newest complete checkpoint: version 4"
    campaign.save(update_fields=["blocked_reason"])

    grant_role(campaign.owner)
    client.force_login(campaign.owner)
    page = client.get(f"/campaigns/{campaign.pk}/").content.decode()
    assert 'data-code="blocked"' in page and "lost slice 0" in page and 'data-testid="restore"' not in page
    refused = client.post(f"/campaigns/{campaign.pk}/restore", {"version": "4"})
    assert refused.status_code == 302 and "/admin/login" in refused["Location"]

    staff = make_user("staff")
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    client.force_login(staff)
    assert 'value="4"' in client.get(f"/campaigns/{campaign.pk}/").content.decode()
    client.post(f"/campaigns/{campaign.pk}/restore", {"version": "4"})
    campaign.refresh_from_db()
    assert (campaign.committed_steps, campaign.blocked_reason) == (4, "")


def _hello() -> BackboneHello:
    return BackboneHello(
        protocol_version=PROTOCOL_VERSION,
        name="agg",
        upload_url="ws://127.0.0.1:1/upload",
        params_url="http://127.0.0.1:1/params/",
    )


def test_a_slice_whose_reply_for_the_failed_step_is_not_in_yet_is_rolled_back_too() -> None:
    # Both slices got commit 4; slice 1 applied it but its reply is still on the way (recorded at 4),
    # slice 0 restarted and lost the uploads. Left alone, slice 1 would stay at 5 while the campaign redoes 4.
    campaign = stepped(5)
    confirm(campaign, 4)
    campaign.slices.update(version=4)
    first, second = campaign.slices.order_by("index")

    outbox = backbone.step_failed(first.aggregator_id, StepFailed(
        campaign_id=campaign.pk, slice_index=0, step=4, missing_lease_ids=[5], detail="restarted",
    ))  # fmt: skip
    late = backbone.step_applied(second.aggregator_id, StepApplied(campaign_id=campaign.pk, slice_index=1, step=4,
                                                                  version=5))  # fmt: skip

    campaign.refresh_from_db()
    assert campaign.committed_steps == 4
    assert [(a, m) for a, m in outbox if isinstance(m, Rollback)] == [
        (second.aggregator_id, Rollback(campaign_id=campaign.pk, version=4, timeline=1))
    ]
    assert late is None and campaign.slices.get(index=1).version == 4  # the undone step's reply changes nothing
