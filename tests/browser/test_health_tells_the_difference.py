"""A campaign nobody has joined is not an emergency, a dead aggregator is, and the pages say which (issue 34).

Seen by a newcomer organizer: a new campaign no volunteer had joined raised
"Critical: campaign stalled", /healthz answered 503, the dashboard's badge said
"degraded" for it and for a dead aggregator alike, and the campaign page showed
a green RUNNING badge beside a red "Stalled" box.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler.models import Aggregator
from tests.browser.live_site import LiveSite, Shot, log_in
from tests.factories import make_admin, make_campaign

pytestmark = pytest.mark.timeout(120)


def test_no_volunteers_is_a_warning_and_a_dead_aggregator_is_critical_on_every_page(
    page: Page, shot: Shot, live_site: LiveSite
) -> None:
    campaign = make_campaign()
    Campaign.objects.filter(pk=campaign.pk).update(running_since=timezone.now() - timedelta(minutes=30))
    make_admin("ada")
    log_in(page, "ada@example.org")

    health = page.request.get(f"{live_site.url}/healthz")
    assert health.status == 200 and health.json()["summary"] == "no volunteers", health.json()

    page.goto(f"{live_site.url}/dashboard/")
    status = page.get_by_test_id("status")
    expect(status).to_have_text("no volunteers")
    expect(status).to_have_attribute("data-status", "warning")
    alert = page.locator('[data-testid=alert][data-code="campaign_waiting_for_volunteers"]')
    expect(alert).to_contain_text("Warning")
    expect(page.locator('[data-testid=alert][data-code="campaign_stalled"]')).to_have_count(0)
    shot(page, "no volunteers")

    page.goto(f"{live_site.url}/campaigns/{campaign.pk}/")
    expect(page.get_by_test_id("condition")).to_have_attribute("data-code", "waiting_for_volunteers")
    badge = page.get_by_test_id("state")
    expect(badge).to_have_class(re.compile(r"\bstate-caution\b"))
    expect(badge).not_to_have_class(re.compile(r"\bstate-running\b(?!.*\bstate-(caution|trouble)\b)"))
    shot(page, "campaign waiting for volunteers")

    # Its aggregator dies: now it is critical, the badges say so, and nothing on the page is green.
    Aggregator.objects.filter(slices__campaign=campaign).update(connected=False)
    page.goto(f"{live_site.url}/dashboard/")
    expect(status).to_have_text("aggregator down")
    expect(status).to_have_attribute("data-status", "degraded")
    page.goto(f"{live_site.url}/campaigns/{campaign.pk}/")
    expect(page.get_by_test_id("condition")).to_have_attribute("data-code", "aggregator_silent")
    expect(badge).to_have_class(re.compile(r"\bstate-trouble\b"))
    color = badge.evaluate("node => getComputedStyle(node).backgroundColor")
    condition = page.get_by_test_id("condition").evaluate("node => getComputedStyle(node).backgroundColor")
    assert color == condition, f"the RUNNING badge ({color}) is not the red of the condition ({condition})"
    shot(page, "campaign with a dead aggregator")
    health = page.request.get(f"{live_site.url}/healthz")
    assert health.status == 200 and health.json()["summary"] == "aggregator down", "the site itself serves"
