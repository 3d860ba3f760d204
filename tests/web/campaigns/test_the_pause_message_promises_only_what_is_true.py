"""Pausing: the organizer is told that leases still out count only if reported before their deadlines."""

from __future__ import annotations

import pytest

from crowdtrain.campaigns.models import Campaign
from tests.factories import logged_in, make_campaign, make_organizer

pytestmark = pytest.mark.django_db


def test_the_pause_button_and_the_paused_page_name_the_deadline() -> None:
    owner = make_organizer("olga")
    campaign = make_campaign()
    Campaign.objects.filter(pk=campaign.pk).update(owner=owner)
    browser = logged_in(owner)

    paused = browser.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": "pause"}, follow=True).content.decode()

    assert "leases already out count if reported before their deadlines" in paused
    assert "each counts only if its agent reports it before its deadline, and the rest expire" in paused
    assert "still count" not in paused
