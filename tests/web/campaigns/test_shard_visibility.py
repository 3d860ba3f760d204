"""Shard downloads respect campaign visibility: an invite-only campaign's shards need an invited device."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.permissions import can_download_shard
from crowdtrain.datasets.models import Shard
from tests.factories import make_campaign, make_device, make_text_dataset

pytestmark = pytest.mark.django_db


def _invite_only_shard() -> tuple[Campaign, Shard]:
    campaign = make_campaign()
    campaign.visibility = Campaign.Visibility.INVITE
    campaign.save(update_fields=["visibility"])
    return campaign, campaign.dataset.shards.first()


def _get(sha: str, token: str, **headers: str) -> Any:
    return Client().get(f"/api/shards/{sha}", headers={"Authorization": f"Bearer {token}", **headers})


def test_a_stranger_cannot_download_an_invite_only_campaigns_shard() -> None:
    _, shard = _invite_only_shard()
    _, token = make_device("stranger")

    response = _get(shard.sha256, token)

    assert response.status_code == 403
    assert response.json() == {"error": "shard of an invite-only campaign you are not invited to"}


def test_a_stranger_gets_no_304_for_a_private_shard_either() -> None:
    _, shard = _invite_only_shard()
    _, token = make_device("stranger")

    response = _get(shard.sha256, token, If_None_Match=f'"{shard.sha256}"')

    assert response.status_code == 403


@pytest.mark.parametrize("persona", ["invited", "owner", "staff"])
def test_invited_volunteers_the_owner_and_staff_download_it_with_ranges(persona: str) -> None:
    campaign, shard = _invite_only_shard()
    device, token = make_device(persona if persona != "owner" else "organizer")
    if persona == "invited":
        campaign.invited.add(device.owner)
    if persona == "staff":
        device.owner.is_staff = True
        device.owner.save(update_fields=["is_staff"])

    full = _get(shard.sha256, token)
    part = _get(shard.sha256, token, Range="bytes=0-3")
    cached = _get(shard.sha256, token, If_None_Match=f'"{shard.sha256}"')

    assert full.status_code == 200 and full["ETag"] == f'"{shard.sha256}"'
    assert part.status_code == 206 and part.content == b"".join(full.streaming_content)[:4]
    assert cached.status_code == 304


def test_a_public_campaign_using_the_same_bytes_opens_the_shard() -> None:
    _, shard = _invite_only_shard()
    make_campaign(make_text_dataset())  # same generated text, so the same content-addressed shards
    device, token = make_device("stranger")

    response = _get(shard.sha256, token)

    assert response.status_code == 200
    assert can_download_shard(device, shard.sha256)


def test_a_dataset_no_campaign_uses_stays_downloadable() -> None:
    shard = make_text_dataset().shards.first()
    device, _ = make_device("stranger")

    assert can_download_shard(device, shard.sha256)


def test_an_invitation_to_another_campaign_does_not_open_this_one() -> None:
    _, shard = _invite_only_shard()
    other = make_campaign(make_text_dataset(num_samples=50, samples_per_shard=20))  # other shard bytes
    other.visibility = Campaign.Visibility.INVITE
    other.save(update_fields=["visibility"])
    device, token = make_device("guest")
    other.invited.add(device.owner)

    response = _get(shard.sha256, token)

    assert response.status_code == 403
