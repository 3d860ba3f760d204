"""Who may read a campaign's shard coverage: whoever may read its progress feed; to others it does not exist."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from tests.factories import logged_in, make_admin, make_campaign, make_organizer, make_persona

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner() -> AbstractBaseUser:
    return make_organizer("olga")


@pytest.fixture
def campaign(owner: AbstractBaseUser) -> Campaign:
    campaign = make_campaign()
    Campaign.objects.filter(pk=campaign.pk).update(owner=owner)
    return Campaign.objects.get(pk=campaign.pk)


@pytest.mark.parametrize(
    ("who", "visibility", "state", "visible"),
    [
        ("anonymous", "public", "running", True),
        ("volunteer", "public", "paused", True),
        ("anonymous", "invite", "running", False),
        ("volunteer", "invite", "running", False),
        ("owner", "invite", "running", True),
        ("owner", "public", "draft", True),
        ("admin", "public", "draft", True),
        ("other organizer", "public", "draft", False),
        ("volunteer", "public", "draft", False),
        ("anonymous", "public", "draft", False),
    ],
)
def test_it_answers_exactly_whoever_may_watch_the_progress_feed(
    campaign: Campaign, owner: AbstractBaseUser, who: str, visibility: str, state: str, visible: bool
) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(visibility=visibility, state=state)
    client = logged_in(owner if who == "owner" else make_persona(who))

    coverage = client.get(f"/api/campaigns/{campaign.pk}/coverage")
    progress = client.get(f"/api/campaigns/{campaign.pk}/progress")

    assert coverage.status_code == progress.status_code == (200 if visible else 404)
    if not visible:
        assert coverage.json() == {"error": f"no campaign {campaign.pk}"}


def test_a_campaign_that_does_not_exist_gets_the_same_json_answer(campaign: Campaign) -> None:
    response = Client().get(f"/api/campaigns/{campaign.pk + 1000}/coverage")

    assert response.status_code == 404
    assert response.json() == {"error": f"no campaign {campaign.pk + 1000}"}


def test_it_only_answers_get(campaign: Campaign) -> None:
    response = logged_in(make_admin("ada")).post(f"/api/campaigns/{campaign.pk}/coverage")

    assert response.status_code == 405
