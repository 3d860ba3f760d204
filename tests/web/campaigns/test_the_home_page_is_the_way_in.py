"""The home page says what Crowdtrain is and gives each open campaign a Join button; an empty My devices does too."""

from __future__ import annotations

import pytest
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from tests.factories import commit_steps, logged_in, make_campaign, make_device, make_volunteer

pytestmark = pytest.mark.django_db


def test_the_home_page_explains_crowdtrain_and_links_each_open_campaign_to_its_join_page(client: Client) -> None:
    running = make_campaign()
    invite_only = make_campaign()
    Campaign.objects.filter(pk=invite_only.pk).update(visibility=Campaign.Visibility.INVITE)

    html = client.get("/").content.decode()

    assert "Crowdtrain trains machine-learning models on GPUs that volunteers lend" in html
    assert f'href="/campaigns/{running.pk}/join"' in html
    assert f'href="/campaigns/{invite_only.pk}/join"' not in html


def test_a_count_of_one_contributor_is_singular(client: Client) -> None:
    campaign = make_campaign()
    device, _token = make_device("ada")
    commit_steps(campaign, device, steps=1)

    html = client.get("/").content.decode()

    assert '<b data-field="contributors">1</b> contributor</span>' in html


def test_an_empty_my_devices_page_offers_the_open_campaigns() -> None:
    campaign = make_campaign()
    browser = logged_in(make_volunteer("newcomer"))

    html = browser.get("/devices/").content.decode()

    assert "No devices yet" in html
    assert f'href="/campaigns/{campaign.pk}/join"' in html


def test_my_devices_with_a_device_lists_no_join_buttons() -> None:
    campaign = make_campaign()
    device, _token = make_device("owner")
    browser = logged_in(device.owner)

    html = browser.get("/devices/").content.decode()

    assert "No devices yet" not in html and f'href="/campaigns/{campaign.pk}/join"' not in html
