"""Campaign lifecycle from the organizer's page: start, pause (leases drain), resume, finish, archive."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.campaigns import lifecycle
from crowdtrain.campaigns.lifecycle import LifecycleError, apply_move
from crowdtrain.campaigns.models import Campaign, ValidationResult
from crowdtrain.gateway.outbox import campaign_agents_group
from crowdtrain.scheduler import leasing, reporting
from crowdtrain.scheduler.models import Aggregator, SliceAssignment
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import NoLease, VersionPublished, decode_message
from tests.factories import done_for, make_aggregator, make_campaign, make_device, make_organizer

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner() -> AbstractBaseUser:
    return make_organizer("olga")


@pytest.fixture
def owner_client(client: Client, owner: AbstractBaseUser) -> Client:
    client.force_login(owner)
    return client


def campaign_in(state: str, owner: AbstractBaseUser, **fields: object) -> Campaign:
    campaign = make_campaign(**fields)
    Campaign.objects.filter(pk=campaign.pk).update(state=state, owner=owner)
    return Campaign.objects.get(pk=campaign.pk)


def act(client: Client, campaign: Campaign, action: str) -> list[str]:
    # confirmed: Finish and Archive ask first (test_irreversible_moves_ask_first covers the asking)
    response = client.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": action, "confirmed": "yes"}, follow=True)
    assert response.redirect_chain[0] == (f"/campaigns/{campaign.pk}/", 302)
    return [str(m) for m in response.context["messages"]]


def test_starting_a_draft_runs_it_and_assigns_live_aggregators(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.DRAFT, owner)
    SliceAssignment.objects.filter(campaign=campaign).delete()
    Aggregator.objects.update(connected=False)  # the factory's own aggregator is gone
    aggregator = make_aggregator("agg-live")

    messages = act(owner_client, campaign, "start")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.RUNNING
    assert list(campaign.slices.values_list("aggregator_id", flat=True)) == [aggregator.pk]
    assert "started" in messages[0]


def test_a_started_campaign_without_aggregators_says_it_waits(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.DRAFT, owner)
    SliceAssignment.objects.filter(campaign=campaign).delete()
    Aggregator.objects.update(connected=False)  # the factory's own aggregator is gone

    act(owner_client, campaign, "start")
    page = owner_client.get(f"/campaigns/{campaign.pk}/")

    assert "Waiting for aggregators: 0 of 1 slice ready" in page.content.decode()


def test_a_dataset_still_being_sharded_cannot_start(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.DRAFT, owner)
    type(campaign.dataset).objects.filter(pk=campaign.dataset_id).update(status="sharding")

    messages = act(owner_client, campaign, "start")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.DRAFT
    assert "is not ready yet (sharding)" in messages[0]


def test_pausing_stops_new_leases_but_leases_already_out_still_count(
    owner_client: Client, owner: AbstractBaseUser, django_capture_on_commit_callbacks: Any
) -> None:
    campaign = campaign_in(Campaign.State.RUNNING, owner, target_batch_size=4, microbatch_size=4)
    device, _ = make_device("vera")
    out = leasing.request_lease(device.pk, campaign.pk, None)
    assert isinstance(out, LeaseMessage)

    with django_capture_on_commit_callbacks(execute=True):  # the site publishes the pause once it is committed
        act(owner_client, campaign, "pause")
    refused = leasing.request_lease(device.pk, campaign.pk, None)
    drained = reporting.report_done(device.pk, done_for(out.lease_id))

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.PAUSED
    assert isinstance(refused, NoLease) and refused.reason == "campaign_paused"
    assert drained.ack.accepted and campaign.committed_steps == 1


def test_resuming_leases_again(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.PAUSED, owner)
    device, _ = make_device("vera")

    act(owner_client, campaign, "resume")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.RUNNING
    assert isinstance(leasing.request_lease(device.pk, campaign.pk, None), LeaseMessage)


def test_resuming_wakes_the_agents_waiting_on_the_campaign(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.PAUSED, owner)
    layer = get_channel_layer()
    waiting_agent = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(campaign_agents_group(campaign.pk), waiting_agent)

    act(owner_client, campaign, "resume")

    event = async_to_sync(layer.receive)(waiting_agent)
    # A version push: agents told "paused, ask again in 10 s" ask at once instead.
    assert decode_message(event["text"]) == VersionPublished(campaign_id=campaign.pk, version=campaign.version)


@pytest.mark.parametrize("state", [Campaign.State.RUNNING, Campaign.State.PAUSED])
def test_finishing_ends_leasing(owner_client: Client, owner: AbstractBaseUser, state: str) -> None:
    campaign = campaign_in(state, owner)
    device, _ = make_device("vera")

    act(owner_client, campaign, "finish")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.FINISHED
    assert leasing.request_lease(device.pk, campaign.pk, None).reason == "campaign_finished"


def test_archived_campaigns_leave_the_default_lists(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.FINISHED, owner)
    campaign.name = "Old run"
    campaign.save(update_fields=["name"])

    act(owner_client, campaign, "archive")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.ARCHIVED
    assert "Old run" not in owner_client.get("/campaigns/").content.decode()
    assert "Old run" in owner_client.get("/campaigns/?archived=1").content.decode()
    assert "Old run" not in Client().get("/").content.decode()


INVALID = [
    (Campaign.State.DRAFT, "pause", "cannot pause a draft campaign; Pause works on running campaigns"),
    (Campaign.State.DRAFT, "resume", "cannot resume a draft campaign"),
    (Campaign.State.DRAFT, "finish", "cannot finish a draft campaign"),
    (Campaign.State.RUNNING, "start", "cannot start a running campaign"),
    (Campaign.State.RUNNING, "archive", "cannot archive a running campaign"),
    (Campaign.State.PAUSED, "pause", "cannot pause a paused campaign"),
    (Campaign.State.FINISHED, "resume", "cannot resume a finished campaign"),
    (Campaign.State.FINISHED, "start", "cannot start a finished campaign"),
    (Campaign.State.ARCHIVED, "start", "cannot start a archived campaign"),
    (Campaign.State.RUNNING, "explode", "unknown action 'explode'"),
]


@pytest.mark.parametrize(("state", "action", "message"), INVALID, ids=[f"{s}-{a}" for s, a, _ in INVALID])
def test_an_invalid_move_changes_nothing_and_says_why(
    owner_client: Client, owner: AbstractBaseUser, state: str, action: str, message: str
) -> None:
    campaign = campaign_in(state, owner)

    messages = act(owner_client, campaign, action)

    campaign.refresh_from_db()
    assert campaign.state == state
    assert messages[0].startswith("Nothing changed:") and message in messages[0]


def test_a_campaign_past_its_max_steps_cannot_resume(owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.PAUSED, owner, max_steps=5)
    Campaign.objects.filter(pk=campaign.pk).update(committed_steps=5)

    with pytest.raises(LifecycleError, match="raise max steps"):
        apply_move(campaign.pk, "resume", owner)

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.PAUSED


def test_the_page_offers_only_the_moves_the_state_allows(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.RUNNING, owner)

    html = owner_client.get(f"/campaigns/{campaign.pk}/").content.decode()

    assert 'data-testid="action-pause"' in html and 'data-testid="action-finish"' in html
    assert 'data-testid="action-start"' not in html and 'data-testid="action-archive"' not in html


def test_lifecycle_moves_need_a_post(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.RUNNING, owner)

    response = owner_client.get(f"/campaigns/{campaign.pk}/lifecycle?action=pause")

    campaign.refresh_from_db()
    assert response.status_code == 405 and campaign.state == Campaign.State.RUNNING


def test_a_draft_broken_outside_the_form_cannot_start(owner_client: Client, owner: AbstractBaseUser) -> None:
    campaign = campaign_in(Campaign.State.DRAFT, owner)
    broken = {"n_layer": 1, "n_head": 3, "n_embd": 8, "block_size": 8}
    Campaign.objects.filter(pk=campaign.pk).update(model_config=broken)

    messages = act(owner_client, campaign, "start")

    campaign.refresh_from_db()
    assert campaign.state == Campaign.State.DRAFT
    assert "cannot train as configured: gpt.n_embd (8) must be divisible by gpt.n_head (3)" in messages[0]


@pytest.mark.parametrize(("version", "validated", "scheduled"), [(3, False, [3]), (3, True, []), (0, False, [])])
def test_finishing_by_hand_validates_the_last_version_once(
    owner_client: Client,
    owner: AbstractBaseUser,
    monkeypatch: pytest.MonkeyPatch,
    version: int,
    validated: bool,
    scheduled: list[int],
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(lifecycle, "schedule_validation", lambda campaign_id, v: calls.append((campaign_id, v)))
    campaign = campaign_in(Campaign.State.RUNNING, owner)
    Campaign.objects.filter(pk=campaign.pk).update(version=version, committed_steps=version)
    if validated:
        ValidationResult.objects.create(campaign=campaign, version=version, loss=1.0, num_samples=4)

    act(owner_client, campaign, "finish")

    assert calls == [(campaign.pk, v) for v in scheduled]
