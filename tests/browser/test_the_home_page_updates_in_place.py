"""The home page's campaign cards update from their progress feed; the page never reloads itself.

Seen in issue 34: a ``<meta http-equiv="refresh" content="5">`` reloaded the
whole page every 5 s, and its charts flashed while a person read.
"""

from __future__ import annotations

import pytest
from django.db import transaction
from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign, Step
from crowdtrain.scheduler import invariants
from tests.browser.live_site import LiveSite, Shot
from tests.factories import make_campaign

pytestmark = pytest.mark.timeout(90)


def test_a_campaign_card_moves_on_without_a_reload(page: Page, shot: Shot, live_site: LiveSite) -> None:
    campaign = make_campaign()
    page.goto(f"{live_site.url}/")
    card = page.locator(f"#campaign-{campaign.pk}")
    expect(card.locator('[data-field="committed_steps"]')).to_have_text("0")
    assert page.locator('meta[http-equiv="refresh"]').count() == 0
    page.evaluate("window.__sameHomePage = true")  # gone if the page reloads

    # Seven steps as a commit leaves them: the counter with its rows. A counter alone is a broken campaign,
    # which the site's minute check (``scheduler.invariants``) repaired by rolling it back in two make test runs.
    with transaction.atomic():
        Step.objects.bulk_create(Step(campaign=campaign, index=i, num_samples=8, loss_sum=8.0) for i in range(7))
        Campaign.objects.filter(pk=campaign.pk).update(committed_steps=7, version=7)
    assert not invariants.counter_mismatches(campaign.pk), "the site would repair this campaign, not show it"

    expect(card.locator('[data-field="committed_steps"]')).to_have_text("7", timeout=15_000)
    expect(card.locator('[data-field="version"]')).to_have_text("7")
    expect(card.locator('[data-field="samples"]')).to_have_text("56")
    assert page.evaluate("window.__sameHomePage === true"), "the page reloaded instead of updating its cards"
    shot(page, "home page updated in place")
